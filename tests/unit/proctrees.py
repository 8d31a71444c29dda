"""Fixture /proc trees for attribution by port: processes (stat, comm, cmdline, fd links) and the
listening sockets of /proc/net/tcp and tcp6, written under a tmp_path root. Never this machine's /proc.

    fp = FakeProc(tmp_path / "proc")
    serve = fp.listen("127.0.0.1", 11434)                      # a listening socket: its inode
    fp.process(800, "engine", ["/opt/engine", "serve"], sockets=[serve])
    fp.process(801, "worker", ["/opt/worker"], ppid=800)       # a child: belongs to the port's owner
    fp.write_net()
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot, ProcessTree

GIB = 2**30
CLK_TCK = 100
_HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")


def hex_address(address: str) -> str:
    """An address as the kernel prints it in /proc/net/tcp{,6}: 32-bit words in host byte order."""
    packed = ipaddress.ip_address(address).packed
    return "".join(f"{struct.unpack('=I', packed[i:i + 4])[0]:08X}" for i in range(0, len(packed), 4))


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "net").mkdir(parents=True, exist_ok=True)
        self._inodes = itertools.count(70000)
        self._lines: dict[str, list[str]] = {"tcp": [], "tcp6": []}

    def listen(self, address: str, port: int, *, uid: int | None = None, state: str = "0A") -> int:
        """A socket in /proc/net/tcp (IPv4) or tcp6 (IPv6); returns its inode for `process(sockets=...)`."""
        inode = next(self._inodes)
        table = "tcp6" if ipaddress.ip_address(address).version == 6 else "tcp"
        remote = "0" * len(hex_address(address))
        uid = os.getuid() if uid is None else uid
        n = len(self._lines[table])
        self._lines[table].append(f"{n:4}: {hex_address(address)}:{port:04X} {remote}:0000 {state} "
                                  f"00000000:00000000 00:00000000 00000000 {uid:5} 0 {inode} 1 0000000000000000 100 0 0 10 0\n")
        return inode

    def write_net(self) -> None:
        for table, lines in self._lines.items():
            (self.root / "net" / table).write_text(_HEADER + "".join(lines))

    def process(self, pid: int, comm: str, argv: list[str], *, ppid: int = 1, starttime: int = 12345,
                sockets: Iterable[int] = (), other_fds: int = 3, uid: int | None = None) -> None:
        """A process: its listening sockets as `socket:[inode]` links, plus pipes and files as other fds."""
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        fields = ["S", str(ppid)] + ["0"] * 17 + [str(starttime)] + ["0"] * 30  # field 3, 4 (ppid), ...; 22: starttime
        (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
        uid = os.getuid() if uid is None else uid
        (d / "status").write_text(f"Name:\t{comm}\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        fd = itertools.count()
        for inode in sockets:
            os.symlink(f"socket:[{inode}]", d / "fd" / str(next(fd)))
        for i in range(other_fds):
            target = f"pipe:[{900000 + pid * 10 + i}]" if i % 2 else "/dev/null"
            os.symlink(target, d / "fd" / str(next(fd)))


def gpu_proc(pid: int, name: str, cmdline: str, used: int | None = GIB, start: float | None = 100.0) -> GpuProcess:
    return GpuProcess(pid=pid, name=name, cmdline=cmdline, used_bytes=used, start_time=start)


def snapshot(*procs: GpuProcess, tree: ProcessTree | None = None) -> GpuSnapshot:
    return GpuSnapshot(DeviceMemory(0, "card", 24 * GIB, 0, 0, 24 * GIB), tuple(procs), tree=tree)
