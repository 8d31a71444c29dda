"""Which tenant does each GPU process belong to.

The attributor only knows the tenants' upstreams and match rules from the registry; it knows no
engine. Evidence, strongest first:

1. **Port.** The process that holds the listening socket of a tenant's upstream port, or any of its
   descendants (Ollama's runners are children of `ollama serve`), belongs to that tenant, whatever
   its command line. Read from the snapshot's `ProcessTree` (the reader's thread walked /proc). The
   nearest holder in the lineage wins; a process holding the ports of several tenants goes to the
   first in registry order. Skipped where the reader has no tree (the simulated GPU: its pids are
   not in /proc), for an upstream on another machine, and for a lineage whose sockets could not be
   read (another user's processes): those fall back to the rules below, and the snapshot says so.
   **Pod.** On Kubernetes, a process in a pod whose namespace and labels a tenant's `match.pod`
   names belongs to it (the snapshot's `pods`, from `proxy.gpu.pods`), first tenant in registry order.
2. **Name.** An exact name match (comm, or the basename of argv[0], against `match.process_names`),
   first tenant in registry order wins. Linux truncates comm to 15 characters
   (`ollama_llama_server` shows as `ollama_llama_se`), so a 15-character comm also matches a
   configured name it is the prefix of.
3. **Pattern.** Only when no tenant matches by name are the `cmdline_patterns` searched, again first
   tenant in registry order wins: a pattern in one tenant cannot steal a process another names exactly.

A process matching nobody is `unmanaged` (the shipped `desktop` tenant is an ordinary tenant whose
release kind is `none`).

Results are cached by (pid, start time), bounded LRU: a reused pid with another start time is a
different process and is attributed afresh. A port verdict is final for the process's life; a
name or pattern verdict is kept but the port is looked up again in later snapshots (a dict walk,
no I/O), since ComfyUI holds VRAM before it binds its port. A process without a start time is
never cached. Attribution's own notes are appended to the snapshot's notes, where health,
`/api/stats` and the event stream show them.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import urlsplit

from proxy.config.registry import Registry
from proxy.config.schema import PodMatch, Tenant
from proxy.gpu.placement import Placement
from proxy.gpu.snapshot import GpuProcess, GpuSnapshot, Listener, PodRef, ProcessTree, ProcNode
from proxy.hosts import IpAddress, is_local_address, parse_ip

UNMANAGED = "unmanaged"
COMM_MAX = 15  # TASK_COMM_LEN - 1 on Linux
DEFAULT_CACHE_SIZE = 4096
# Service managers hold the sockets they activate on a service's behalf; counted as owners, they would
# hand every process they started (a whole desktop session) to that tenant. pid 1 is never read at all.
SERVICE_MANAGERS = frozenset({"systemd"})
NOTE_PIDS_MAX = 5
LOCALHOST: frozenset[IpAddress] = frozenset({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")})

Basis = Literal["port", "pod", "name", "pattern"]


@dataclass(frozen=True, slots=True)
class AttributedProcess:
    process: GpuProcess
    tenant: str
    by: Basis | None = None  # the evidence; None: no rule matched (unmanaged), or not attributed here (self-reports)
    pod: PodRef | None = None  # the Kubernetes pod it runs in, when known


@dataclass(frozen=True, slots=True)
class AttributedSnapshot:
    snapshot: GpuSnapshot
    processes: tuple[AttributedProcess, ...]
    # tenant -> the devices its engine uses (proxy/gpu/devices.py), on a host with several; empty: one device
    placement: Mapping[str, Placement] = field(default_factory=dict, hash=False)

    def on_device(self, index: int) -> AttributedSnapshot:
        """The snapshot of one card: its figures and the processes' entries on it (pure; see GpuSnapshot.on_device)."""
        if not self.snapshot.several_devices:
            return self
        return AttributedSnapshot(self.snapshot.on_device(index),
                                  tuple(p for p in self.processes if p.process.device == index), self.placement)

    @property
    def free_bytes(self) -> int:
        return self.snapshot.free_bytes

    @property
    def estimated(self) -> bool:
        return self.snapshot.estimated

    def held_by(self, tenant: str) -> int:
        """Bytes the tenant's processes hold, counting only known amounts (unknown is not zero, but not countable)."""
        return sum(p.process.used_bytes or 0 for p in self.processes if p.tenant == tenant)

    def processes_of(self, tenant: str) -> tuple[AttributedProcess, ...]:
        return tuple(p for p in self.processes if p.tenant == tenant)

    def unmanaged(self) -> tuple[AttributedProcess, ...]:
        return self.processes_of(UNMANAGED)

    def tenants(self) -> tuple[str, ...]:
        """Tenants present in the snapshot, in first-seen order."""
        return tuple(dict.fromkeys(p.tenant for p in self.processes))


@dataclass(frozen=True, slots=True)
class _Rules:
    tenant: str
    names: frozenset[str]
    truncated: tuple[str, ...]  # names longer than COMM_MAX: a 15-char comm may be their prefix
    patterns: tuple[re.Pattern[str], ...]
    pod: PodMatch | None = None


@dataclass(frozen=True, slots=True)
class _Verdict:
    tenant: str
    by: Basis | None


@dataclass(frozen=True, slots=True)
class _Upstream:
    """Where a tenant's engine listens on this machine."""

    order: int  # registry order: the first tenant wins a socket serving several
    tenant: str
    port: int
    addresses: frozenset[IpAddress] | None  # None: any address of this machine (its own name, 0.0.0.0)


@dataclass(frozen=True, slots=True)
class _Owners:
    """One snapshot's listening sockets that serve a tenant's upstream, and those no readable process holds."""

    tenant_of: dict[int, tuple[int, str]]  # inode -> (registry order, tenant)
    unplaced_uids: frozenset[int]  # uids of tenant sockets whose holder was not seen: it may hide in an unreadable lineage


_NO_OWNERS = _Owners({}, frozenset())
_MATCH_FALLBACK = "attributed by name and pattern"


def _argv0_basename(cmdline: str) -> str:
    first = cmdline.split(maxsplit=1)[0] if cmdline.strip() else ""
    return first.rsplit("/", 1)[-1]


def _addresses_here(host: str, probe: Callable[[IpAddress], bool],
                    hostname: Callable[[], str]) -> tuple[bool, frozenset[IpAddress] | None]:
    """Whether an upstream host is this machine, and the addresses it names there (None: any of them)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True, LOCALHOST
    ip = parse_ip(host)
    if ip is None:
        # a name: resolving it is DNS, not for this path; only this machine's own name is known to be here
        own = hostname().lower()
        return host in (own, own.split(".")[0]), None
    if ip.is_unspecified:
        return True, None
    return (True, frozenset({ip})) if ip.is_loopback or probe(ip) else (False, None)


def _serves(listener: Listener, up: _Upstream) -> bool:
    if listener.port != up.port:
        return False
    if up.addresses is None:
        return True
    ip = parse_ip(listener.address)
    if ip is None:
        return False
    if ip.is_unspecified:  # 0.0.0.0 takes IPv4; :: takes both unless IPV6_V6ONLY, which /proc does not show
        return ip.version == 6 or any(a.version == 4 for a in up.addresses)
    return ip in up.addresses


class Attributor:
    def __init__(self, registry: Registry, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 probe: Callable[[IpAddress], bool] = is_local_address,
                 hostname: Callable[[], str] = socket.gethostname) -> None:
        self._rules = tuple(
            _Rules(
                tenant=t.name,
                names=frozenset(t.match.process_names),
                truncated=tuple(n for n in t.match.process_names if len(n) > COMM_MAX),
                patterns=tuple(re.compile(p) for p in t.match.cmdline_patterns),
                pod=t.match.pod,
            )
            for t in registry
        )
        self._pod_rules = tuple(r for r in self._rules if r.pod is not None)
        self._upstreams: list[_Upstream] = []
        self._remote: list[tuple[str, str]] = []  # (tenant, host) whose engine is not on this machine
        for order, t in enumerate(registry):
            self._add_upstream(order, t, probe, hostname)
        self._cache: OrderedDict[tuple[int, float], _Verdict] = OrderedDict()
        self._cache_size = max(0, cache_size)
        self._lock = threading.Lock()  # reads run off the loop; keep the LRU consistent anyway
        self.hits = 0
        self.misses = 0

    def _add_upstream(self, order: int, tenant: Tenant, probe: Callable[[IpAddress], bool],
                      hostname: Callable[[], str]) -> None:
        if not tenant.upstream:
            return  # VRAM-only: patterns and names alone
        parts = urlsplit(tenant.upstream)
        host = (parts.hostname or "").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        here, addresses = _addresses_here(host, probe, hostname)
        if here:
            self._upstreams.append(_Upstream(order, tenant.name, port, addresses))
        else:
            self._remote.append((tenant.name, host))

    # -- match rules -----------------------------------------------------------------------------
    def match(self, process: GpuProcess) -> str:
        """The tenant whose rules (names, then patterns) match this process, uncached."""
        return self._by_rules(process).tenant

    def _by_rules(self, process: GpuProcess) -> _Verdict:
        comm = process.name
        argv0 = _argv0_basename(process.cmdline)
        for r in self._rules:
            if comm in r.names or argv0 in r.names:
                return _Verdict(r.tenant, "name")
            if len(comm) == COMM_MAX and any(n.startswith(comm) for n in r.truncated):
                return _Verdict(r.tenant, "name")
        if process.cmdline:
            for r in self._rules:
                if any(p.search(process.cmdline) for p in r.patterns):
                    return _Verdict(r.tenant, "pattern")
        return _Verdict(UNMANAGED, None)

    def _by_pod(self, pod: PodRef | None) -> _Verdict | None:
        if pod is None:
            return None
        for r in self._pod_rules:
            if r.pod is not None and r.pod.matches(pod.namespace, pod.labels):
                return _Verdict(r.tenant, "pod")
        return None

    # -- ports -----------------------------------------------------------------------------------
    def _owners(self, tree: ProcessTree | None) -> _Owners:
        """Which listening sockets serve a tenant's upstream: once per snapshot, a few dozen sockets."""
        if tree is None or not self._upstreams:
            return _NO_OWNERS
        tenant_of: dict[int, tuple[int, str]] = {}
        for listener in tree.listeners:
            up = next((u for u in self._upstreams if _serves(listener, u)), None)
            if up is not None:
                tenant_of[listener.inode] = (up.order, up.tenant)
        seen = {i for n in tree.nodes.values() if n.sockets for i in n.sockets}
        unplaced = frozenset(lst.uid for lst in tree.listeners if lst.inode in tenant_of and lst.inode not in seen)
        return _Owners(tenant_of, unplaced)

    @staticmethod
    def _by_port(pid: int, tree: ProcessTree, owners: _Owners) -> tuple[str | None, tuple[ProcNode, ...]]:
        """The tenant whose port the nearest ancestor (or the process) holds, else the lineage's
        unreadable processes that might hold one (same uid as an unplaced socket, or unknown uid)."""
        blind: list[ProcNode] = []
        for node in tree.lineage(pid):
            if node.name in SERVICE_MANAGERS:
                continue
            if node.sockets is None:
                # a socket is held by processes of its creator's uid, save hand-overs (socket activation):
                # an unreadable process of another uid is no place an unplaced socket could hide
                if node.uid is None or node.uid in owners.unplaced_uids:
                    blind.append(node)
                continue
            held = [owners.tenant_of[i] for i in node.sockets if i in owners.tenant_of]
            if held:
                return min(held)[1], ()
        return None, tuple(blind)

    # -- one process -----------------------------------------------------------------------------
    def tenant_of(self, process: GpuProcess, tree: ProcessTree | None = None, pod: PodRef | None = None) -> str:
        return self._verdict(process, tree, self._owners(tree), pod)[0].tenant

    def _verdict(self, process: GpuProcess, tree: ProcessTree | None,
                 owners: _Owners, pod: PodRef | None = None) -> tuple[_Verdict, tuple[ProcNode, ...]]:
        """The verdict, and the unreadable processes that kept the port from deciding it."""
        by_port = tree is not None and bool(owners.tenant_of)
        # without a start time a pid is not an identity: never cached
        key = None if process.start_time is None else (process.pid, process.start_time)
        cached = None
        if key is not None:
            with self._lock:  # the hot path: one lock, no further call
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    if cached.by in ("port", "pod") or (not by_port and (pod is None or not self._pod_rules)):
                        self.hits += 1
                        return cached, ()
        blind: tuple[ProcNode, ...] = ()
        if tree is not None and by_port:
            tenant, blind = self._by_port(process.pid, tree, owners)
            if tenant is not None:
                return self._store(key, _Verdict(tenant, "port")), ()
        by_pod = self._by_pod(pod)
        if by_pod is not None:
            return self._store(key, by_pod), blind
        if cached is not None:
            with self._lock:
                self.hits += 1
            return cached, blind
        return self._store(key, self._by_rules(process)), blind

    def _store(self, key: tuple[int, float] | None, verdict: _Verdict) -> _Verdict:
        with self._lock:
            self.misses += 1
            if key is not None and self._cache_size:
                self._cache[key] = verdict
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return verdict

    # -- one snapshot ----------------------------------------------------------------------------
    def attribute(self, snapshot: GpuSnapshot) -> AttributedSnapshot:
        tree = snapshot.tree
        owners = self._owners(tree)
        processes: list[AttributedProcess] = []
        blind: dict[int, ProcNode] = {}
        for p in snapshot.processes:
            pod = snapshot.pods.get(p.pid)
            verdict, unread = self._verdict(p, tree, owners, pod)
            processes.append(AttributedProcess(p, verdict.tenant, verdict.by, pod))
            for n in unread:
                blind[n.pid] = n
        notes = self._notes(tree, tuple(blind.values()))
        if notes:
            snapshot = replace(snapshot, notes=snapshot.notes + notes)
        return AttributedSnapshot(snapshot=snapshot, processes=tuple(processes))

    def _notes(self, tree: ProcessTree | None, blind: tuple[ProcNode, ...]) -> tuple[str, ...]:
        if tree is None:
            return ()  # no socket step at all (simulated GPU, estimates): nothing fell back from it
        notes = [f"tenant {t}: upstream host {h} is not this machine, so its processes cannot be found by port: "
                 f"{_MATCH_FALLBACK} only" for t, h in self._remote]
        if blind:
            shown = ", ".join(f"pid {n.pid} ({n.name})" for n in sorted(blind, key=lambda n: n.pid)[:NOTE_PIDS_MAX])
            more = f" and {len(blind) - NOTE_PIDS_MAX} more" if len(blind) > NOTE_PIDS_MAX else ""
            notes.append(f"cannot read the open sockets of {shown}{more} (another user's processes): the GPU processes "
                         f"under them were {_MATCH_FALLBACK}, not by port; run the proxy as root or as that user "
                         "to attribute them by the port they serve")
        return tuple(notes)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    @property
    def cache_len(self) -> int:
        return len(self._cache)
