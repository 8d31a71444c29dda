"""What /proc says about the processes the proxy starts: who they are (pid and start time, their
command line), what descends from them, and who holds a TCP port.

A pid alone names nothing for good (numbers are reused); a pid with the kernel's start time of it
(/proc/PID/stat field 22, clock ticks since boot) and the boot it was read in does. Descendants are
found three ways: by session (the child starts one of its own, so everything it spawns is in it
unless it calls `setsid` itself), by parent links (which also find a `setsid` child while its
parent lives), and by the run's id in their environment (`marked`: a `setsid` child whose parent
died too, what a proxy killed -9 left). Port holders come from the listening sockets (netlink sock_diag, else /proc/net/tcp,
the helpers of `proxy.gpu`) and the `socket:[inode]` links in /proc/PID/fd.

Blocking file reads: callers run them off the event loop. Off Linux every answer is "cannot tell"
(None or empty), never an error.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from proxy.gpu.proctree import read_fd_links, read_listeners
from proxy.gpu.sockdiag import read_listeners_netlink

ANY_ADDRESS = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    session: int
    start_time: int  # clock ticks since boot
    state: str  # "R", "S", "Z"...

    @property
    def alive(self) -> bool:
        """Runs (a zombie, dead and waiting to be reaped, holds nothing and does not count)."""
        return self.state not in ("Z", "X")


def proc(pid: int) -> Proc | None:
    """/proc/PID/stat, or None when it is gone (or off Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
        fields = text.rpartition(")")[2].split()  # comm may hold spaces or ')': split after the last one
        return Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    p = proc(pid)
    return None if p is None else p.start_time


def cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return tuple(part.decode("utf-8", "replace") for part in raw.split(b"\0")[:-1]) if raw else ()


def boot_id() -> str | None:
    """This boot's id: start times are counted from the boot, so a record from another boot names nothing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def processes() -> list[Proc]:
    """Every process this reader can see."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for entry in entries:
        if entry.isdigit():
            p = proc(int(entry))
            if p is not None:
                out.append(p)
    return out


RUN_VAR = "HYPERSWAP_RUN"  # in a started app's environment: a random id of its run, inherited by what it spawns


def marked(marker: str, since: int = 0) -> dict[int, int]:
    """The live processes started at `since` or later whose environment carries RUN_VAR=`marker`:
    what one run spawned, found even after a `setsid` and its parent's death (a proxy killed -9),
    unless it cleared its environment. pid -> start time. Reads stat first, the environment only of
    the few processes as young as the run; another user's environment cannot be read (skipped)."""
    want = f"{RUN_VAR}={marker}".encode()
    out: dict[int, int] = {}
    for p in processes():
        if not p.alive or p.start_time < since:
            continue
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if want in env.split(b"\0"):
            out[p.pid] = p.start_time
    return out


def tree(root: int | None, session: int | None, known: Iterable[tuple[int, int]] = (), *,
         since: int = 0) -> dict[int, int]:
    """The live processes that belong to an app: pid -> start time. `root` (the child, while it runs),
    its `session`'s members started at `since` or later, whatever descends from them by parent links
    (a `setsid` child found while its parent lives), and the `known` (pid, start time) pairs seen
    earlier that still run as themselves."""
    table = {p.pid: p for p in processes()}
    ours = _seeds(table, root, session, since) | _still_known(table, known)
    _add_descendants(table, ours)
    return {pid: table[pid].start_time for pid in ours}


def _seeds(table: Mapping[int, Proc], root: int | None, session: int | None, since: int) -> set[int]:
    """The live root, and the live members of its session started at `since` or later."""
    return {pid for pid, p in table.items()
            if p.alive and (pid == root or (session is not None and p.session == session and p.start_time >= since))}


def _still_known(table: Mapping[int, Proc], known: Iterable[tuple[int, int]]) -> set[int]:
    """The `known` (pid, start time) pairs that still run as themselves."""
    return {pid for pid, started in known if (p := table.get(pid)) is not None and p.alive and p.start_time == started}


def _add_descendants(table: Mapping[int, Proc], ours: set[int]) -> None:
    """Adds to `ours` every live process descending from one of them by parent links."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    todo = list(ours)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in ours and table[child].alive:
                ours.add(child)
                todo.append(child)


def same(pid: int, started: int) -> bool:
    """The process `pid` still runs as the one started at `started` (not a later one with its number)."""
    p = proc(pid)
    return p is not None and p.alive and p.start_time == started


def describe(pid: int) -> str:
    """`pid 4242 (python3 -m http.server 8081)`, for messages."""
    argv = cmdline(pid)
    if not argv:
        try:
            argv = (Path(f"/proc/{pid}/comm").read_text().strip(),)
        except OSError:
            argv = ()
    text = " ".join(argv)
    return f"pid {pid} ({text[:200]})" if text else f"pid {pid}"


# -- ports ---------------------------------------------------------------------------------------------

def _addresses(host: str) -> frozenset[str]:
    if host in ("localhost", ""):
        return frozenset({"127.0.0.1", "::1"}) | ANY_ADDRESS
    return frozenset({host}) | ANY_ADDRESS


def listening_inodes(host: str, port: int) -> frozenset[int]:
    """The listening sockets a connection to host:port could reach (its address, or a wildcard)."""
    try:
        listeners = read_listeners_netlink()
    except OSError:
        listeners = read_listeners(Path("/proc"))
    addresses = _addresses(host)
    return frozenset(listener.inode for listener in listeners
                     if listener.port == port and listener.address in addresses)


def holders(inodes: frozenset[int], pids: Iterable[int] | None = None) -> list[int]:
    """The processes among `pids` (all when None) holding one of the socket `inodes`; processes whose
    fds cannot be read (another user's) are left out."""
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    if pids is None:
        try:
            pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
        except OSError:
            return []
    out = []
    for pid in pids:
        try:
            links = read_fd_links(f"/proc/{pid}/fd")
        except OSError:
            continue
        if wanted.intersection(links):
            out.append(pid)
    return out


@dataclass(frozen=True, slots=True)
class PortUse:
    """Who listens on a port: `ours` of them (pids of the app's tree), and the `others`."""

    listening: bool
    ours: tuple[int, ...] = ()
    others: tuple[int, ...] = ()

    def stranger(self) -> str | None:
        """A message naming who else holds it, or None when nobody else does (as far as can be seen)."""
        if not self.others:
            return None
        return ", ".join(describe(pid) for pid in self.others[:3])


def port_use(host: str, port: int, ours: Iterable[int] = ()) -> PortUse:
    """Who holds host:port: `ours` (a small set, read first: the common case costs a few reads), then,
    only when none of them does, every process, to name the holder."""
    inodes = listening_inodes(host, port)
    if not inodes:
        return PortUse(False)
    mine = holders(inodes, list(ours))
    if mine:
        return PortUse(True, tuple(mine))
    return PortUse(True, (), tuple(holders(inodes)))
