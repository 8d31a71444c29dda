"""How much of a file is in the page cache: measured, never guessed.

`cachestat(2)` (Linux 6.5+) counts the cached pages of a file range in the kernel; older kernels get
`mmap` + `mincore(2)` (one byte per page of the mapping). A file the proxy may not open (Ollama's
blobs belong to the `ollama` user) is unknown with the reason, never 0 %.

The syscalls sit behind `PageCacheProbe`; `ResidencyCache` keeps readings briefly and forgets the
ones a warm or a drop made stale.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import Field

from proxy.encoding import JSONModel
from proxy.engines.model_files import NotRegular, open_regular

Method = Literal["cachestat", "mincore"]
PAGE = mmap.PAGESIZE
CACHESTAT_NR = 451  # the same number on every architecture (asm-generic table, Linux 6.5)
MINCORE_WINDOW = 1 << 30  # map and probe at most 1 GiB at a time (a 256 KiB vector)


@dataclass(frozen=True, slots=True)
class FileResidency:
    path: str
    size_bytes: int | None
    cached_bytes: int | None  # None: unknown, see `unknown_reason`
    method: Method | None = None
    unknown_reason: str | None = None

    @property
    def fraction(self) -> float | None:
        if self.cached_bytes is None or self.size_bytes is None:
            return None
        return 1.0 if self.size_bytes == 0 else min(1.0, self.cached_bytes / self.size_bytes)


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else round(100 * fraction, 1)




class ResidentFile(JSONModel):
    """One file's page-cache residency as /api/models shows it."""

    path: str
    size_bytes: int | None
    cached_bytes: int | None = Field(description="null: unknown, see unknown_reason (never 0)")
    resident_percent: float | None
    method: Method | None
    unknown_reason: str | None

    @classmethod
    def of(cls, r: FileResidency) -> ResidentFile:
        return cls(path=r.path, size_bytes=r.size_bytes, cached_bytes=r.cached_bytes,
                   resident_percent=_percent(r.fraction), method=r.method, unknown_reason=r.unknown_reason)


class PageCacheProbe(Protocol):
    def measure(self, path: str) -> FileResidency: ...

    def drop(self, path: str) -> None:
        """Ask the kernel to drop the file's clean pages (POSIX_FADV_DONTNEED); tests and benches."""


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return lib


def _unreadable(path: str, exc: OSError) -> str:
    if isinstance(exc, NotRegular):
        return f"skipped: {exc.strerror}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied opening {path}: run the proxy as the user that owns the model files "
                "(or add it to their group), or as root")
    if exc.errno == errno.ENOENT:
        return f"{path} does not exist (deleted or moved since it was listed)"
    return f"cannot open {path}: {exc.strerror or exc}"


class SystemPageCache:
    """The real page cache. `use_cachestat=False` forces the mincore path (tests of the fallback)."""

    def __init__(self, use_cachestat: bool = True) -> None:
        self._libc = _libc()
        self._cachestat = use_cachestat and hasattr(os, "posix_fadvise")
        self._lock = threading.Lock()

    @property
    def method(self) -> Method:
        return "cachestat" if self._cachestat else "mincore"

    def measure(self, path: str) -> FileResidency:
        try:
            fd, st = open_regular(path)  # a FIFO, a device or a link is skipped, never waited on or read
        except OSError as exc:
            return FileResidency(path, _size_or_none(path), None, None, _unreadable(path, exc))
        try:
            size = st.st_size
            if self._cachestat:
                cached = self._by_cachestat(fd)
                if cached is not None:
                    return FileResidency(path, size, min(size, cached), "cachestat")
            return FileResidency(path, size, self._by_mincore(fd, size), "mincore")
        except OSError as exc:
            return FileResidency(path, _size_or_none(path), None, None, f"cannot measure {path}: {exc.strerror or exc}")
        finally:
            os.close(fd)

    def _by_cachestat(self, fd: int) -> int | None:
        """Cached bytes, or None when the kernel has no cachestat (then mincore is used from now on)."""
        rng, out = _CachestatRange(0, 0), _Cachestat()  # len 0: to the end of the file
        if self._libc.syscall(CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(out), 0) == 0:
            return int(out.nr_cache) * PAGE
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # old kernel, a seccomp filter, an odd fs
            with self._lock:
                self._cachestat = False
            return None
        raise OSError(err, os.strerror(err))

    def _by_mincore(self, fd: int, size: int) -> int:
        cached = 0
        for offset in range(0, size, MINCORE_WINDOW):
            length = min(MINCORE_WINDOW, size - offset)
            addr = self._libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr in (None, ctypes.c_void_p(-1).value):
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            try:
                pages = (length + PAGE - 1) // PAGE
                vec = (ctypes.c_ubyte * pages)()
                if self._libc.mincore(addr, length, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
                resident = sum(b & 1 for b in bytes(vec))
            finally:
                self._libc.munmap(addr, length)
            cached += min(resident * PAGE, length)
        return cached

    def drop(self, path: str) -> None:
        fd, _st = open_regular(path)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _size_or_none(path: str) -> int | None:
    try:
        st = os.lstat(path)  # a directory entry may be readable when the file is not
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class ResidencyCache:
    """Readings kept `ttl_s` (a dashboard refresh should not re-probe 50 GiB of blobs), and dropped at
    once for files a warm or a drop touched: a residency shown after a warm is the state after it."""

    def __init__(self, probe: PageCacheProbe, now: Callable[[], float], ttl_s: float = 5.0) -> None:
        self.probe = probe
        self.now = now
        self.ttl_s = ttl_s
        self._readings: dict[str, tuple[float, FileResidency]] = {}
        self._lock = threading.Lock()  # measured from worker threads, invalidated from the loop

    def measure(self, path: str) -> FileResidency:
        now = self.now()
        with self._lock:
            hit = self._readings.get(path)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        reading = self.probe.measure(path)
        with self._lock:
            self._readings[path] = (now, reading)
        return reading

    def invalidate(self, paths: Iterable[str] | None = None) -> None:
        with self._lock:
            if paths is None:
                self._readings.clear()
            else:
                for p in paths:
                    self._readings.pop(p, None)


@dataclass(frozen=True, slots=True)
class ModelResidency:
    """The files of one model, summed. Unknown when any file is: a partial sum would read as a figure."""

    size_bytes: int
    cached_bytes: int | None
    unknown_reason: str | None
    files: tuple[FileResidency, ...]

    @property
    def fraction(self) -> float | None:
        if self.cached_bytes is None:
            return None
        return 1.0 if self.size_bytes == 0 else min(1.0, self.cached_bytes / self.size_bytes)


class Residency(JSONModel):
    """A model's files summed, as /api/models shows it; `files` only when asked for."""

    size_bytes: int
    cached_bytes: int | None
    resident_percent: float | None
    unknown_reason: str | None
    files: list[ResidentFile] | None = Field(default=None, exclude_if=lambda v: v is None)

    @classmethod
    def of(cls, r: ModelResidency, files: bool = False) -> Residency:
        return cls(size_bytes=r.size_bytes, cached_bytes=r.cached_bytes, resident_percent=_percent(r.fraction),
                   unknown_reason=r.unknown_reason, files=[ResidentFile.of(f) for f in r.files] if files else None)


def summed(readings: Iterable[FileResidency]) -> ModelResidency:
    files = tuple(readings)
    size = sum(r.size_bytes or 0 for r in files)
    unknown = next((r.unknown_reason for r in files if r.cached_bytes is None), None)
    cached = None if unknown is not None else sum(r.cached_bytes or 0 for r in files)
    return ModelResidency(size, cached, unknown, files)
