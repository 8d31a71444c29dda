"""Following a `process` app's output file (GET /api/tenants/{name}/logs): the last lines of the
current run, then each line as it is written, and a new run's lines from its beginning when the
app is started again (its file starts over at each start).

The follower never keeps the controller's descriptor: each read takes a duplicate of it (on the
loop, so it cannot race a start that replaces the file), reads it off the loop and closes it. Only
whole lines are sent; a line the app has not ended yet waits for its newline (or for MAX_PARTIAL
bytes, then it is sent as it stands). A line is cut to MAX_LINE characters, a progress bar's `\r`
updates shrink to their last state, and the ready probe's own request lines are left out, as in
the last lines health and /api/tenants show.

Bounded (issue 42: 30 readers, which needed no token, took 5.9 s of the proxy's CPU in 15 s and
slowed another tenant's POSTs from 0.03 s to 2.7 s): at most `MAX_FOLLOWERS` follow one tenant at
a time (`admit`; the next is answered 429), and each reads at most READ_CHUNK per poll: a follower
that falls further behind than BEHIND_MAX (an app writing faster than a stream can carry) jumps to
the recent output and is told how much it skipped. The file's rotation (`logfile.py`) starts it over
within the run: the follower reads on from its new beginning, no new run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import Protocol

from proxy.lifecycle.logfile import MAX_LINE

LINES_BACK_DEFAULT = 100
LINES_BACK_MAX = 1000
BACK_BYTES = 512 * 1024  # read from the end of the file for the lines back
READ_CHUNK = 64 * 1024  # read at most this much new output per poll (256 KiB/s a stream: a reader, not a copy)
MAX_PARTIAL = 64 * 1024  # a line with no newline yet is sent as it stands past this many bytes
FOLLOW_EVERY_S = 0.25  # how often the file is looked at for new lines
MAX_FOLLOWERS = 4  # streams of one tenant's output at a time
BEHIND_MAX = 4 * READ_CHUNK  # past this much unread output a follower skips to the recent part


class LogSource(Protocol):
    hide: str | None
    followers: int  # streams following it now (`admit`, `LogFollower.close`)

    def open_log(self) -> tuple[int, int] | None:
        """A descriptor of its own onto the current output file and the run's number; None: none yet."""


@dataclass(slots=True)
class Chunk:
    """What one read found: the lines, and whether they begin a run the follower had not seen."""

    lines: list[str]
    new_run: int | None = None  # the run's number when these lines are the start of a new run


@dataclass(slots=True)
class LogFollower:
    source: LogSource
    run: int = 0  # the run being followed (0: none yet)
    offset: int = 0  # bytes of the run's file already read
    partial: bytes = field(default=b"")
    admitted: bool = False

    def admit(self) -> bool:
        """Take one of the tenant's MAX_FOLLOWERS places; False when all are taken (answer 429)."""
        if self.source.followers >= MAX_FOLLOWERS:
            return False
        self.source.followers += 1
        self.admitted = True
        return True

    def close(self) -> None:
        """Give the place back (the stream ended: the client left, or the proxy stops)."""
        if self.admitted:
            self.admitted = False
            self.source.followers -= 1

    async def back(self, lines: int) -> Chunk:
        """The current run's last `lines` lines; the follower then stands at the file's end."""
        opened = self.source.open_log()
        if opened is None:
            return Chunk([])
        fd, run = opened
        try:
            size, data, begin = await asyncio.to_thread(_read_tail, fd, BACK_BYTES)
        finally:
            _close(fd)
        self.run, self.offset = run, size
        parts = data.split(b"\n")
        if begin > 0:
            parts = parts[1:]  # the first is part of a line the read began in
        self.partial = parts.pop() if parts else b""
        out = self._texts(parts)
        return Chunk(out[-lines:] if lines > 0 else [])

    async def new(self) -> Chunk:
        """The whole lines written since the last read; the start of a new run (the app started again)
        from its beginning."""
        opened = self.source.open_log()
        if opened is None:
            return Chunk([])
        fd, run = opened
        try:
            size = await asyncio.to_thread(_size, fd)
            new_run, skipped = None, 0
            if run != self.run:  # started again (the file starts over each start)
                self.run, self.offset, self.partial, new_run = run, 0, b"", run
            elif size < self.offset:  # rotated (logfile.py): it starts over within the run
                self.offset, self.partial = 0, b""
            if size - self.offset > BEHIND_MAX:  # too far behind: on to the recent output
                skipped = size - READ_CHUNK - self.offset
                self.offset, self.partial = size - READ_CHUNK, b""
            data = await asyncio.to_thread(_pread, fd, min(size - self.offset, READ_CHUNK), self.offset)
        finally:
            _close(fd)
        self.offset += len(data)
        if skipped:
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""  # from the next whole line
        parts = (self.partial + data).split(b"\n")
        self.partial = parts.pop()
        if len(self.partial) > MAX_PARTIAL:
            parts.append(self.partial)
            self.partial = b""
        lines = self._texts(parts)
        if skipped:
            lines.insert(0, f"[hyperswap: {skipped} bytes of output skipped: the app writes faster than this "
                            f"stream carries; the whole output is in its log file]")
        return Chunk(lines, new_run)

    def _texts(self, raws: list[bytes]) -> list[str]:
        hide = self.source.hide
        out = []
        for raw in raws:
            text = raw.decode("utf-8", "replace").rstrip("\r")
            text = text.rsplit("\r", 1)[-1] or text  # a progress bar's last state
            if hide is None or hide not in text:
                out.append(text[:MAX_LINE])
        return out


def _size(fd: int) -> int:
    return os.fstat(fd).st_size


def _pread(fd: int, length: int, offset: int) -> bytes:
    return os.pread(fd, length, offset) if length > 0 else b""


def _read_tail(fd: int, limit: int) -> tuple[int, bytes, int]:
    """(the file's size, its last `limit` bytes at most, where they begin)."""
    size = _size(fd)
    begin = max(0, size - limit)
    return size, _pread(fd, size - begin, begin), begin


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
