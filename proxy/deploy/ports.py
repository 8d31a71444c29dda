"""Who holds a TCP port on this machine: the check `hyperswap install` makes before it takes one.

The listening sockets come from netlink sock_diag (`proxy.gpu.sockdiag`, /proc/net as the fallback),
their holders from the `socket:[inode]` links under /proc/<pid>/fd. Unlike the GPU reader, which
reads only the GPU processes' lineage, this reads every process's fds once: install runs once, and
the holder can be any program.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxy.gpu.proctree import FdLinks, read_fd_links, read_listeners
from proxy.gpu.snapshot import Listener
from proxy.gpu.sockdiag import read_listeners_netlink


@dataclass(frozen=True, slots=True)
class PortHolder:
    """A listening socket on the port, and the process holding it when it could be found."""

    port: int
    address: str
    pid: int | None  # None: held by a process whose fds could not be read (another user's, without root)
    name: str  # comm, or "" when unknown
    cmdline: str

    def describe(self) -> str:
        if self.pid is None:
            return f"{self.address}:{self.port} is held by a process this user cannot see (run as root to name it)"
        return f"{self.address}:{self.port} is held by pid {self.pid} ({self.name}: {self.cmdline or '?'})"


Holders = Callable[[int], list[PortHolder]]  # port -> who listens on it (empty: free)


def _text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return ""


def find_holders(port: int, listeners: tuple[Listener, ...], proc_root: Path = Path("/proc"),
                 fd_links: FdLinks = read_fd_links) -> list[PortHolder]:
    """The holders of `port` among `listeners`, found by scanning proc_root/<pid>/fd."""
    wanted = {sock.inode: sock for sock in listeners if sock.port == port and sock.inode}
    if not wanted:
        return []
    found: dict[int, PortHolder] = {}
    try:
        pids = [int(n) for n in os.listdir(proc_root) if n.isdigit()]
    except OSError:
        pids = []
    for pid in sorted(pids):
        base = f"{proc_root}/{pid}"
        try:
            links = fd_links(f"{base}/fd")
        except OSError:
            continue  # gone, or another user's
        for link in links:
            if not link.startswith("socket:["):
                continue
            try:
                inode = int(link[8:-1])
            except ValueError:
                continue
            if inode in wanted and inode not in found:
                listener = wanted[inode]
                cmdline = _text(f"{base}/cmdline").replace("\0", " ").strip()
                found[inode] = PortHolder(port, listener.address, pid, _text(f"{base}/comm").strip(), cmdline)
    unseen = [PortHolder(port, sock.address, None, "", "") for i, sock in wanted.items() if i not in found]
    return list(found.values()) + unseen


def holders_here(port: int) -> list[PortHolder]:
    """Who listens on `port` in this machine's network namespace."""
    try:
        listeners = read_listeners_netlink()
    except OSError:
        listeners = read_listeners(Path("/proc"))
    return find_holders(port, listeners)
