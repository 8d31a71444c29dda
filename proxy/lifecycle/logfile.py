"""A `process` app's output file: a fresh one per run, kept under a size the tenant sets.

The child writes to the file itself (its stdout and stderr are the file, opened O_APPEND), never a
pipe: nothing it writes can block or fail because the proxy stopped reading. Issue 42 found no bound
on it: 980 MB in 49 s from an app writing 20 MB/s, kept after the stop, and 6.4 GB in 20 s from one
writing as fast as it can. So:

- Each start truncates the file (one run per file: an old run is gone when the app starts again).
- While it is open, the file is looked at every `CHECK_S`; past `max_bytes` it is rotated the way
  logrotate's `copytruncate` does it (the child's descriptor cannot be swapped): its content goes to
  `<tenant>.log.1` (its last `max_bytes`, replacing the one before), then the file is truncated, and
  the child's appends continue at its start. On disk: at most `max_bytes` twice, plus what the app
  writes in `CHECK_S` (5 MB at 20 MB/s). Lines written between the copy and the truncation
  (microseconds) are lost, and so is what an app writes past `max_bytes` between two checks.
  Without a state directory the file is an unlinked temporary one, cut the same way with no `.1`.
- The last lines (health, /api/tenants, a failed start's answer) come from the file's tail, and from
  `.1`'s when the file was just cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from proxy.clock import Clock

CHECK_S = 0.25  # how often the size is looked at
COPY_CHUNK = 1 << 20
TAIL_BYTES = 64 * 1024  # read back from the end of the log for the last lines
MAX_LINE = 1000  # characters kept of one line (a progress bar can write megabytes without a newline)
DEFAULT_MAX_MIB = 20.0


def _tail(fd: int, limit: int) -> list[bytes]:
    """The whole lines in the last `limit` bytes of the file (the first, partial one dropped)."""
    try:
        size = os.fstat(fd).st_size
        begin = max(0, size - limit)
        data = os.pread(fd, size - begin, begin)
    except OSError:
        return []
    lines = data.split(b"\n")
    if begin > 0:
        lines = lines[1:]
    if lines and not lines[-1]:
        lines.pop()
    return lines


def clean_line(raw: bytes) -> str:
    """One line as it is shown: decoded, a progress bar's last state, cut to MAX_LINE characters."""
    text = raw.decode("utf-8", "replace").rstrip("\r")
    return (text.rsplit("\r", 1)[-1] or text)[:MAX_LINE]


class LogFile:
    """One tenant's output file: `open_run` at each start, `close` at the proxy's shutdown."""

    def __init__(self, name: str, path: Callable[[], Path | None], max_bytes: int, clock: Clock) -> None:
        self.name = name
        self._path = path  # where the file goes now (the instance's slot; None: a temporary file)
        self.max_bytes = max_bytes
        self.clock = clock
        self.fd: int | None = None  # open for reading its tail (and the child's writes)
        self.run = 0  # counts the files opened (one per start): a follower sees a new run by it
        self.cuts = 0  # rotations of the current run
        self._where: Path | None = None
        self._bound: asyncio.Task[None] | None = None

    def open_run(self) -> int:
        """A fresh file for a run, open for appending (the child) and reading (the tail)."""
        self.close()
        fd: int | None = None
        where = self._path()
        if where is not None:
            with contextlib.suppress(OSError):
                where.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
                with contextlib.suppress(OSError):
                    self.rotated(where).unlink()  # the run before's
        if fd is None:
            where = None
            fd, tmp = tempfile.mkstemp(prefix=f"hyperswap-{self.name}-", suffix=".log")
            os.unlink(tmp)  # lives as long as the proxy or the child holds it
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self.fd, self._where, self.cuts = fd, where, 0
        self.run += 1
        with contextlib.suppress(RuntimeError):  # no loop (a test calling it bare): no periodic check
            self._bound = asyncio.get_running_loop().create_task(self._keep_bounded(), name=f"log-bound-{self.name}")
        return fd

    @staticmethod
    def rotated(path: Path) -> Path:
        return path.with_name(path.name + ".1")

    def dup(self) -> tuple[int, int] | None:
        """A descriptor of its own onto the current file and the run's number; None before the first start."""
        if self.fd is None:
            return None
        try:
            return os.dup(self.fd), self.run
        except OSError:
            return None

    def rotate_if_big(self) -> bool:
        """Past max_bytes: copy the file to `.1` and truncate it (blocking; run off the loop)."""
        fd = self.fd
        if fd is None:
            return False
        try:
            size = os.fstat(fd).st_size
            if size <= self.max_bytes:
                return False
            if self._where is not None:
                self._copy_out(fd, self.rotated(self._where), max(0, size - self.max_bytes))
            os.ftruncate(fd, 0)
        except OSError:
            return False
        self.cuts += 1
        return True

    @staticmethod
    def _copy_out(fd: int, target: Path, offset: int) -> None:
        """The file from `offset` (its last max_bytes: what an app wrote faster than the checks is dropped
        from the front) to its end as it is now, what was appended meanwhile included, into `target`."""
        tmp = target.with_name(target.name + ".tmp")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            while True:
                data = os.pread(fd, COPY_CHUNK, offset)
                if not data:
                    break
                os.write(out, data)
                offset += len(data)
        finally:
            os.close(out)
        os.replace(tmp, target)

    async def _keep_bounded(self) -> None:
        while True:
            await self.clock.sleep(CHECK_S)
            if self.fd is not None and os.fstat(self.fd).st_size > self.max_bytes:
                await asyncio.to_thread(self.rotate_if_big)

    def lines(self, keep: int, hide: str | None) -> tuple[str, ...]:
        """The last `keep` lines, oldest first, leaving out those holding `hide` (the ready probe's)."""
        fd = self.fd
        if fd is None:
            return ()
        raws = _tail(fd, TAIL_BYTES)
        if len(raws) < keep and self.cuts and self._where is not None:  # just cut: the lines before are in .1
            with contextlib.suppress(OSError):
                old = os.open(self.rotated(self._where), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    raws = _tail(old, TAIL_BYTES) + raws
                finally:
                    os.close(old)
        out: list[str] = []
        for raw in reversed(raws):
            text = clean_line(raw)
            if hide is None or hide not in text:
                out.append(text)
                if len(out) >= keep:
                    break
        return tuple(reversed(out))

    def close(self) -> None:
        if self._bound is not None:
            self._bound.cancel()
            self._bound = None
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
