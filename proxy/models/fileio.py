"""The threads model-file work runs on (locating, residency, warming): never asyncio's default pool.

asyncio's default executor also runs the GPU snapshot and the release path; model files are read
on behalf of anyone who can reach `/api/models` or name a model, so a read that stalls (a file
system that hangs, a file that is slow to read) must cost that work only. `FileWork` is a few
threads of its own with a bounded queue: past `max_queued` waiting jobs a new one is refused at
once (`FileWorkBusy`) instead of piling up, and `run(..., timeout_s=)` lets a caller on the request
path stop waiting (the job still finishes on its thread; its result is dropped).

Daemon threads, cancel-and-abandon on close: `concurrent.futures.ThreadPoolExecutor` joins its
workers at interpreter exit (and asyncio.run() joins the default pool), so one thread blocked in a
read kept the process alive after SIGTERM (issue 25: still running 63 s later). Here `close()`
fails every queued job and returns at once; a thread still inside a read is abandoned: it is a
daemon, so the process exits without it. Opening files non-blocking and only regular ones
(`engines.model_files.open_regular`) means a read should not stall in the first place; this is
the second line.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# A queued job: run it (it settles its awaiter), or fail its awaiter without running it.
_Job = tuple[Callable[[], None], Callable[[BaseException], None]]


class FileWorkBusy(RuntimeError):
    """The model-file threads are all busy and the queue is full: nothing was started."""


class FileWork:
    def __init__(self, name: str, workers: int = 2, max_queued: int = 32) -> None:
        self.name = name
        self.workers = workers
        self.max_queued = max_queued
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._running: dict[int, _Job] = {}  # thread id -> job
        self._closed = False

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def busy(self) -> int:
        with self._cond:
            return self._busy

    async def run(self, fn: Callable[..., T], *args: object, timeout_s: float | None = None) -> T:
        """`fn(*args)` on a model-file thread. Raises FileWorkBusy when the queue is full or the work
        is closed, TimeoutError past `timeout_s` (the job is abandoned, not interrupted)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def fail(exc: BaseException) -> None:
            def settle() -> None:
                if not future.done():
                    future.set_exception(exc)
            _on_loop(loop, settle)

        def job() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting side
                fail(exc)
            else:
                def settle() -> None:
                    if not future.done():
                        future.set_result(result)
                _on_loop(loop, settle)
        with self._cond:
            if self._closed:
                raise FileWorkBusy(f"{self.name}: closed")
            if len(self._queue) >= self.max_queued:
                raise FileWorkBusy(f"{self.name}: {self._busy} running and {len(self._queue)} waiting")
            self._queue.append((job, fail))
            if len(self._threads) < self.workers and self._busy + len(self._queue) > len(self._threads):
                t = threading.Thread(target=self._work, name=f"hyperswap-{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify()
        if timeout_s is None:
            return await future
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                queued = self._queue.popleft()
                self._busy += 1
                self._running[threading.get_ident()] = queued
            try:
                queued[0]()
            finally:
                with self._cond:
                    self._busy -= 1
                    self._running.pop(threading.get_ident(), None)

    def close(self) -> None:
        """Fail what waits, wake idle threads so they end, abandon any still reading (daemons)."""
        with self._cond:
            self._closed = True
            pending = [fail for _run, fail in self._queue]
            pending += [fail for _run, fail in self._running.values()]  # their awaiters stop waiting; the threads are left
            self._queue.clear()
            self._running.clear()
            self._cond.notify_all()
        for fail in pending:
            fail(FileWorkBusy(f"{self.name}: closed"))


def _on_loop(loop: asyncio.AbstractEventLoop, settle: Callable[[], None]) -> None:
    """From any thread: settle a future on its own loop (a closed loop: nobody waits any more)."""
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
