"""The GPU processes' ancestry and the listening sockets it holds, read from /proc.

Attribution by port needs two facts /proc gives: which process holds the listening socket of a
tenant's upstream port (/proc/net/tcp and tcp6 list listening sockets, state 0A, with their inode,
as does netlink sock_diag, much faster: `proxy.gpu.sockdiag`; /proc/<pid>/fd/* link to `socket:[inode]`),
and which processes descend from it (field 4 of
/proc/<pid>/stat is the parent). Only the GPU processes and their ancestors are read, never every
process: a GPU process belongs to a port's owner exactly when the owner is in its lineage, so the
cost follows the number of GPU processes, not of processes on the machine.

What a process holds is remembered by (pid, start time) while the set of listening sockets stays
the same: the fds are read again only for new processes, or for all once a socket opens or closes
(ComfyUI binding its port, an engine restarting). A socket handed to a running process without any
listener opening or closing (SCM_RIGHTS) is missed until then: rare, and its lineage still counts.

Blocking file reads: called from the GPU reader's thread, once per snapshot. Nothing raises but
programming errors: a process that vanished is left out, an fd directory that cannot be read (another
user's process) is recorded as unreadable, and attribution falls back to the match rules for it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from proxy.gpu.snapshot import Listener, ProcessTree, ProcNode
from proxy.gpu.sockdiag import read_listeners_netlink

LISTEN_STATE = "0A"  # TCP_LISTEN as /proc/net/tcp prints it
MAX_DEPTH = 64  # a lineage longer than this is a loop or a fork bomb: stop reading

FdLinks = Callable[[str], list[str]]  # "/proc/<pid>/fd" -> its link targets; raises OSError

# Plain os calls on str paths: per file, pathlib's joins and read_text cost several times the read.


def _read(path: str) -> str:
    """A small /proc file in one read; raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16).decode("utf-8", "replace")
    finally:
        os.close(fd)


def read_fd_links(fd_dir: str) -> list[str]:
    """The targets of a /proc/<pid>/fd directory. An fd closed while we read is skipped."""
    dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = []
        for name in os.listdir(dir_fd):
            try:
                out.append(os.readlink(name, dir_fd=dir_fd))
            except OSError:
                continue
        return out
    finally:
        os.close(dir_fd)


_V4_MAPPED = bytes(10) + b"\xff\xff"


def _address(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host byte order, in hex."""
    raw = b"".join(struct.pack("=I", int(hex_addr[i:i + 8], 16)) for i in range(0, len(hex_addr), 8))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    if raw[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, raw[12:])  # ::ffff:127.0.0.1 is 127.0.0.1
    return socket.inet_ntop(socket.AF_INET6, raw)


def parse_listeners(text: str) -> list[Listener]:
    """Listening sockets from the text of /proc/net/tcp or tcp6 (the header line is skipped)."""
    out = []
    for line in text.splitlines()[1:]:
        if f" {LISTEN_STATE} " not in line:
            continue  # most lines are connections: skip them before splitting
        f = line.split()
        if len(f) < 10 or f[3] != LISTEN_STATE:
            continue
        try:
            addr, _, port = f[1].partition(":")
            out.append(Listener(inode=int(f[9]), address=_address(addr), port=int(port, 16), uid=int(f[7])))
        except ValueError:
            continue  # a line we do not understand is no evidence either way
    return out


def read_listeners(proc_root: Path) -> tuple[Listener, ...]:
    out: list[Listener] = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/net/{name}", "rb") as f:  # one line per socket: may exceed one read
                out += parse_listeners(f.read().decode("ascii", "replace"))
        except OSError:
            continue  # no IPv6, or /proc/net hidden
    return tuple(listener for listener in out if listener.inode)  # inode 0: a socket being torn down, no holder to find


@dataclass(frozen=True, slots=True)
class _Stat:
    name: str
    ppid: int
    start_ticks: int  # with the pid, the process's identity across pid reuse


def _stat(base: str) -> _Stat | None:
    """Fields 2, 4 and 22 of /proc/<pid>/stat; comm may hold spaces or ')': split after the last one."""
    try:
        text = _read(f"{base}/stat")
        head, _, rest = text.rpartition(")")
        fields = rest.split()  # fields[0] is field 3 (state)
        return _Stat(head.partition("(")[2], int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _uid(base: str) -> int | None:
    """The effective uid from /proc/<pid>/status (sockets carry their creator's)."""
    try:
        for line in _read(f"{base}/status").splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # Uid: real effective saved fs
    except (OSError, IndexError, ValueError):
        pass
    return None


def _held(base: str, inodes: frozenset[int], fd_links: FdLinks) -> frozenset[int] | None:
    """Which of the listening inodes the process holds; None when its fds cannot be read."""
    try:
        links = fd_links(f"{base}/fd")
    except FileNotFoundError:
        return frozenset()  # gone since NVML listed it: holds nothing now
    except OSError:
        return None  # EACCES: another user's process (Ollama often runs as `ollama`)
    held = set()
    for link in links:
        if link.startswith("socket:["):
            try:
                inode = int(link[8:-1])
            except ValueError:
                continue
            if inode in inodes:
                held.add(inode)
    return frozenset(held)


class ProcTreeReader:
    """Reads the tree once per snapshot, remembering what each process held (see the module doc).

    Listeners come from netlink sock_diag when reading this machine's /proc (`proxy.gpu.sockdiag`: the
    /proc/net files cost milliseconds on a large machine), from `<proc_root>/net` otherwise (fixture
    trees) or when netlink is not available."""

    def __init__(self, proc_root: Path = Path("/proc"), *, fd_links: FdLinks = read_fd_links,
                 netlink: bool | None = None) -> None:
        self.proc_root = proc_root
        self._fd_links = fd_links
        self._netlink = Path(proc_root) == Path("/proc") if netlink is None else netlink
        self._inodes: frozenset[int] = frozenset()
        self._held: dict[tuple[int, int], frozenset[int] | None] = {}  # (pid, start ticks) -> held listeners
        self._lock = threading.Lock()  # one snapshot at a time already; keep the memo whole regardless
        self.fd_reads = 0

    def read(self, pids: Iterable[int]) -> ProcessTree:
        """The lineage of each pid up to (not including) init, with the listening sockets each holds."""
        pids = list(pids)
        if not pids:
            return ProcessTree()
        listeners = self._listeners()
        if not listeners:
            return ProcessTree()  # no port can be owned: nothing to learn from fds or parents
        with self._lock:
            return self._read(pids, listeners)

    def _listeners(self) -> tuple[Listener, ...]:
        if self._netlink:
            try:
                return read_listeners_netlink()
            except OSError:
                self._netlink = False  # refused here (a sandbox): /proc/net from now on
        return read_listeners(self.proc_root)

    def _read(self, pids: list[int], listeners: tuple[Listener, ...]) -> ProcessTree:
        inodes = frozenset(listener.inode for listener in listeners)
        memo = self._held if inodes == self._inodes else {}
        nodes: dict[int, ProcNode] = {}
        fresh: dict[tuple[int, int], frozenset[int] | None] = {}
        for pid in pids:
            for _ in range(MAX_DEPTH):
                if pid <= 1 or pid in nodes:
                    break  # init holds sockets it activates for others: it is never an owner
                node = self._node(pid, inodes, memo, fresh)
                if node is None:
                    break
                nodes[pid] = node
                pid = node.ppid
        self._inodes, self._held = inodes, fresh  # only the processes of this tree are remembered
        return ProcessTree(listeners=listeners, nodes=nodes)

    def _node(self, pid: int, inodes: frozenset[int], memo: dict[tuple[int, int], frozenset[int] | None],
              fresh: dict[tuple[int, int], frozenset[int] | None]) -> ProcNode | None:
        base = f"{self.proc_root}/{pid}"
        stat = _stat(base)
        if stat is None:
            return None
        key = (pid, stat.start_ticks)
        if key in memo:
            held = memo[key]
        else:
            self.fd_reads += 1
            held = _held(base, inodes, self._fd_links)
        fresh[key] = held
        # the uid only matters for a process whose fds are hidden: whose socket could it be holding?
        return ProcNode(pid=pid, ppid=stat.ppid, name=stat.name, uid=_uid(base) if held is None else None, sockets=held)


def read_process_tree(proc_root: Path, pids: Iterable[int], *, fd_links: FdLinks = read_fd_links) -> ProcessTree:
    """One tree, read without a memo (tests, one-off reads)."""
    return ProcTreeReader(proc_root, fd_links=fd_links).read(pids)
