"""Which tenant does each GPU process belong to.

The attributor only knows the tenants' match rules from the registry; it knows no engine. A process
matching tenant T's rules belongs to T (the shipped `desktop` tenant is an ordinary tenant whose
release kind is `none`); a process matching nobody is `unmanaged`.

Precedence when several tenants match: first an exact name match (comm, or the basename of argv[0],
against `match.process_names`), first tenant in registry order wins; only when no tenant matches by
name are the `cmdline_patterns` searched, again first tenant in registry order wins. Names are
stronger evidence than a substring of a command line, so a pattern in one tenant cannot steal a
process another tenant names exactly.

Linux truncates comm to 15 characters (`ollama_llama_server` shows as `ollama_llama_se`), so a
15-character comm also matches a configured name it is the prefix of.

Results are cached by (pid, start time), bounded LRU: a reused pid with another start time is a
different process and is attributed afresh. A process without a start time is never cached.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .gpu import GpuProcess, GpuSnapshot
from .tenants import Registry

UNMANAGED = "unmanaged"
COMM_MAX = 15  # TASK_COMM_LEN - 1 on Linux
DEFAULT_CACHE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class AttributedProcess:
    process: GpuProcess
    tenant: str


@dataclass(frozen=True, slots=True)
class AttributedSnapshot:
    snapshot: GpuSnapshot
    processes: tuple[AttributedProcess, ...]

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


def _argv0_basename(cmdline: str) -> str:
    first = cmdline.split(maxsplit=1)[0] if cmdline.strip() else ""
    return first.rsplit("/", 1)[-1]


class Attributor:
    def __init__(self, registry: Registry, *, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._rules = tuple(
            _Rules(
                tenant=t.name,
                names=frozenset(t.match.process_names),
                truncated=tuple(n for n in t.match.process_names if len(n) > COMM_MAX),
                patterns=tuple(re.compile(p) for p in t.match.cmdline_patterns),
            )
            for t in registry
        )
        self._cache: OrderedDict[tuple[int, float], str] = OrderedDict()
        self._cache_size = max(0, cache_size)
        self._lock = threading.Lock()  # reads run off the loop; keep the LRU consistent anyway
        self.hits = 0
        self.misses = 0

    def match(self, process: GpuProcess) -> str:
        """The tenant whose rules match this process, uncached."""
        comm = process.name
        argv0 = _argv0_basename(process.cmdline)
        for r in self._rules:
            if comm in r.names or argv0 in r.names:
                return r.tenant
            if len(comm) == COMM_MAX and any(n.startswith(comm) for n in r.truncated):
                return r.tenant
        if process.cmdline:
            for r in self._rules:
                if any(p.search(process.cmdline) for p in r.patterns):
                    return r.tenant
        return UNMANAGED

    def tenant_of(self, process: GpuProcess) -> str:
        if process.start_time is None:
            return self.match(process)  # without a start time a pid is not an identity: never cache
        key = (process.pid, process.start_time)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        tenant = self.match(process)
        with self._lock:
            self.misses += 1
            if self._cache_size:
                self._cache[key] = tenant
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return tenant

    def attribute(self, snapshot: GpuSnapshot) -> AttributedSnapshot:
        return AttributedSnapshot(
            snapshot=snapshot,
            processes=tuple(AttributedProcess(p, self.tenant_of(p)) for p in snapshot.processes),
        )

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    @property
    def cache_len(self) -> int:
        return len(self._cache)
