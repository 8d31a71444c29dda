"""Reading model files into the page cache ahead of a load, never at the price of swapping.

`warm_files` reads each file start to end with sequential-readahead advice, in chunks, and before
every chunk asks `may_read`: only while MemAvailable stays above the margin after that chunk. It
runs on the model-file threads (`fileio.FileWork`, never asyncio's default pool);

A warm is bounded (issue 25: `/dev/zero` read 720 GiB, a 100 GB sparse file put 14.5 GiB of zeros in
the page cache):
- only regular files, opened without blocking or following a link (`open_regular`);
- each file at most what it would occupy: the least of its size when the warm started, the size
  its manifest gives (Ollama's layer sizes), and its allocated blocks (`st_blocks * 512`). A sparse
  file's holes are zeros the engine gets without a disk read, yet reading them fills the page cache
  with zero pages that push real data out; so what a sparse file "would occupy" worth warming is
  what the file system holds for it, and the warm stops there. (On a compressing file system, ZFS
  or btrfs with compression, the allocated blocks are the compressed size: such a warm stops short
  of the end rather than over it.);
- the margin, rechecked before every chunk;
- time: `60 s + bytes / 50 MB/s` (a disk slower than that gains nothing from a warm); past it the
  warm ends `timeout`. `Warmer` owns the jobs on the event loop (one read at a time, since two
would only share the disk), lets them be stopped, and tells the residency cache which files changed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from proxy.encoding import JSONModel
from proxy.engines.model_files import NotRegular, open_regular
from proxy.models.fileio import FileWork, FileWorkBusy

log = logging.getLogger("hyperswap.models")

CHUNK_BYTES = 8 << 20
WARM_MIN_S = 60.0
WARM_MIN_BPS = 50e6  # the time bound assumes at least this read speed
WarmState = Literal["queued", "running", "done", "stopped", "margin", "timeout", "skipped", "failed"]
MemAvailable = Callable[[], "int | None"]


def read_mem_available(path: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (the kernel's estimate of what can be used without swapping), or None."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def may_read(available: int | None, chunk: int, margin: int) -> str | None:
    """None when `chunk` more bytes of page cache keep MemAvailable at or above `margin`; else why not.
    Unknown MemAvailable stops a warm: it could be pushing the machine into swap, and nobody could tell."""
    if available is None:
        return "MemAvailable cannot be read (/proc/meminfo): warming stops rather than risk swapping"
    if available - chunk < margin:
        return (f"MemAvailable {available / 2**30:.2f} GiB would fall below the margin of "
                f"{margin / 2**30:.2f} GiB (proxy.warm_margin_gb)")
    return None


@dataclass(slots=True)
class WarmJob:
    key: str  # "tenant:model"
    files: tuple[str, ...]
    total_bytes: int
    reason: str  # "admin", "handoff", "keep recent"
    sizes: tuple[int, ...] = ()  # per file, what the manifest or listing said (0 or missing: unknown)
    state: WarmState = "queued"
    read_bytes: int = 0
    data_bytes: int = 0  # what the files opened so far hold on disk (a sparse file's holes: nothing to read)
    stop_reason: str | None = None
    started_at: float | None = None  # wall
    ended_at: float | None = None
    stop_flag: threading.Event = field(default_factory=threading.Event)

    @property
    def active(self) -> bool:
        return self.state in ("queued", "running")

    def summary(self) -> str:
        """One line a person reads right: how much was read against what there was to read. A done
        warm of a sparse file (the demo's stand-ins) read all its data, not a fraction of its size."""
        read, total = _size(self.read_bytes), _size(self.total_bytes)
        if self.state == "done" and self.data_bytes < self.total_bytes:
            return (f"done, read {read}: all the data the files hold ({total} in size, the rest holes in a "
                    "sparse file, nothing to read there)")
        if self.state == "done":
            return f"done, read all {total}"
        pct = f" ({100 * self.read_bytes / self.total_bytes:.0f} %)" if self.total_bytes else ""
        return f"{self.state} after reading {read} of {total}{pct}{f': {self.stop_reason}' if self.stop_reason else ''}"


class Warm(JSONModel):
    """A warm as /api/models shows it: how far it got, how long it took and how fast it read."""

    key: str
    state: WarmState
    reason: str
    total_bytes: int
    read_bytes: int
    stop_reason: str | None
    started_at: float | None
    ended_at: float | None
    duration_s: float | None
    read_gbps: float | None

    @classmethod
    def of(cls, job: WarmJob) -> Warm:
        took = None if job.started_at is None else (job.ended_at or time.time()) - job.started_at
        return cls(key=job.key, state=job.state, reason=job.reason, total_bytes=job.total_bytes,
                   read_bytes=job.read_bytes, stop_reason=job.stop_reason, started_at=job.started_at,
                   ended_at=job.ended_at, duration_s=None if took is None else round(took, 3),
                   read_gbps=round(job.read_bytes / 1e9 / took, 3) if took else None)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def occupies(st: os.stat_result, expected: int = 0) -> int:
    """What reading a file into the page cache should bring in at most: its size now, no more than
    its manifest says (`expected`, 0: unknown), no more than its allocated blocks (a sparse file)."""
    limit = st.st_size
    if expected > 0:
        limit = min(limit, expected)
    return min(limit, st.st_blocks * 512)


def time_bound_s(total_bytes: int) -> float:
    return WARM_MIN_S + total_bytes / WARM_MIN_BPS


def warm_files(job: WarmJob, margin_bytes: int, mem_available: MemAvailable, chunk_bytes: int = CHUNK_BYTES,
               advice: int = os.POSIX_FADV_SEQUENTIAL, now: Callable[[], float] = time.monotonic,
               max_s: float | None = None) -> WarmJob:
    """Blocking: read the job's files into the page cache, within the bounds above. Ends `done`,
    `stopped` (its flag was set), `margin` (memory would fall below the margin), `timeout`,
    `skipped` (a file is not a regular one) or `failed` (a file could not be read)."""
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    job.state = "running"
    bound_s = time_bound_s(job.total_bytes) if max_s is None else max_s
    deadline = now() + bound_s
    for i, path in enumerate(job.files):
        try:
            fd, st = open_regular(path)
        except NotRegular as exc:
            job.state, job.stop_reason = "skipped", f"skipped: {exc.strerror}"
            return job
        except OSError as exc:
            job.state, job.stop_reason = "failed", f"cannot open {path}: {exc.strerror or exc}"
            return job
        left = occupies(st, job.sizes[i] if i < len(job.sizes) else 0)
        job.data_bytes += left
        try:
            os.posix_fadvise(fd, 0, left, advice)  # sequential: twice the readahead window
            while left > 0:
                if job.stop_flag.is_set():
                    job.state, job.stop_reason = "stopped", "stopped on request"
                    return job
                if now() >= deadline:
                    job.state, job.stop_reason = "timeout", f"not done within {bound_s:.0f} s (the warm's time bound)"
                    return job
                want = min(chunk_bytes, left)
                why = may_read(mem_available(), want, margin_bytes)
                if why is not None:
                    job.state, job.stop_reason = "margin", why
                    return job
                n = os.readv(fd, [view[:want]])
                if n <= 0:
                    break
                left -= n
                job.read_bytes += n
        except OSError as exc:
            job.state, job.stop_reason = "failed", f"reading {path} failed: {exc.strerror or exc}"
            return job
        finally:
            os.close(fd)
    job.state = "done"
    return job


class Warmer:
    """The warm jobs: at most one reading at a time, one job per model key (asking again while it
    runs returns the running one). `on_files_changed` hears every file whose residency a job changed,
    when it starts and when it ends."""

    def __init__(self, margin_bytes: Callable[[], int], mem_available: MemAvailable = read_mem_available,
                 on_files_changed: Callable[[Sequence[str]], None] = lambda _paths: None,
                 chunk_bytes: int = CHUNK_BYTES, kept: int = 50, work: FileWork | None = None) -> None:
        self.margin_bytes = margin_bytes
        self.mem_available = mem_available
        self.on_files_changed = on_files_changed
        self.chunk_bytes = chunk_bytes
        self.advice = os.POSIX_FADV_SEQUENTIAL  # the bench sets RANDOM: no readahead past what it paced
        self.kept = kept
        self.jobs: dict[str, WarmJob] = {}  # newest last; finished ones kept for the API, `kept` at most
        self._tasks: dict[str, asyncio.Task[WarmJob]] = {}
        self._disk = asyncio.Lock()
        # One thread of its own: a warm runs for seconds to minutes and must not hold up locating
        # or residency (theirs is `ModelCatalog.work`); one at a time anyway (the disk is shared).
        self.work = work or FileWork("warm", workers=1, max_queued=4)

    def start(self, key: str, files: Sequence[str], total_bytes: int, reason: str,
              sizes: Sequence[int] = ()) -> WarmJob:
        current = self.jobs.get(key)
        if current is not None and current.active:
            return current
        job = WarmJob(key, tuple(files), total_bytes, reason, tuple(sizes))
        self.jobs.pop(key, None)
        self.jobs[key] = job
        while len(self.jobs) > self.kept:
            oldest = next((k for k, j in self.jobs.items() if not j.active), None)
            if oldest is None:
                break
            del self.jobs[oldest]
        self._tasks[key] = asyncio.create_task(self._run(job), name=f"hyperswap:warm:{key}")
        return job

    async def _run(self, job: WarmJob) -> WarmJob:
        try:
            async with self._disk:
                if job.stop_flag.is_set():
                    job.state, job.stop_reason = "stopped", "stopped before it started"
                    return job
                job.started_at = time.time()
                self.on_files_changed(job.files)
                await self.work.run(warm_files, job, self.margin_bytes(), self.mem_available, self.chunk_bytes,
                                    self.advice)
        except FileWorkBusy as exc:
            job.state, job.stop_reason = "stopped", f"not started: {exc}"
        except Exception as exc:  # a broken warm must never break a handoff
            job.state, job.stop_reason = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("warming %s failed", job.key)
        finally:
            job.ended_at = time.time()
            self.on_files_changed(job.files)
            self._tasks.pop(job.key, None)
        log.info("warm %s: %s", job.key, job.summary())
        return job

    def stop(self, key: str) -> WarmJob | None:
        job = self.jobs.get(key)
        if job is not None and job.active:
            job.stop_flag.set()
        return job

    async def wait(self, key: str) -> WarmJob | None:
        task = self._tasks.get(key)
        if task is not None:
            await asyncio.shield(task)
        return self.jobs.get(key)

    async def aclose(self) -> None:
        """Stop every warm and return without waiting on a read: a thread still inside one is
        abandoned (fileio.FileWork), the job ends `stopped` here."""
        for job in self.jobs.values():
            job.stop_flag.set()
        self.work.close()
        tasks = list(self._tasks.values())
        await asyncio.gather(*tasks, return_exceptions=True)
