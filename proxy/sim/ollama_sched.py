"""The Ollama simulator's scheduler: runners as processes in the SimulatedGpu, loading, keep-alive
timers, eviction (shortest keep_alive then name, not LRU), asynchronous release, NUM_PARALLEL.

Modelled on the classic era (v0.11.5+ fast path): a request for a loaded runner takes it at once;
anything else goes through one pending queue processed one load at a time (head-of-line).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from proxy.clock import Clock
from proxy.sim.gpu import SimulatedCard, SimulatedOutOfMemory
from proxy.sim.ollama_wire import GO_MAX_DURATION_S, blob_digest

RUNNER_NAME = "ollama_llama_server"
RUNNER_PATH = "/usr/local/lib/ollama/runners/cuda_v12/ollama_llama_server"
CONTEXT_LENGTH = 4096
OOM_MESSAGE = "llama runner process has terminated: cudaMalloc failed: out of memory"
MAX_QUEUE_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"
LOAD_STEPS = 4  # memory is allocated in this many steps over the load time (what nvidia-smi shows)

MemoryShort = Literal["spill", "oom"]


class ApiError(Exception):
    """An error answered before anything was written: {"error": message} (or the /v1 shape).
    Raised by request handlers and by the scheduler (load failures, a full queue)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# api.Runner's options as Ollama fills them in before comparing (server/sched.go needsReload): what a
# request does not set is the default; num_gpu below 0 ("auto") compares equal to any.
RUNNER_DEFAULTS: dict[str, object] = {"num_ctx": CONTEXT_LENGTH, "num_batch": 512, "num_gpu": -1, "main_gpu": 0,
                                      "use_mmap": None, "num_thread": 0, "draft_num_predict": 0}


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What a runner is loaded with: the model's content (its manifest digest) and its runner options.
    A request whose spec differs reloads the model (a copy over a name is other content)."""

    digest: str = ""
    options: tuple[tuple[str, object], ...] = tuple(sorted(RUNNER_DEFAULTS.items()))

    @classmethod
    def of(cls, digest: str, options: object) -> LoadSpec:
        opts = dict(RUNNER_DEFAULTS)
        if isinstance(options, dict):
            for name in RUNNER_DEFAULTS.keys() & options.keys():
                v = options[name]
                if v is not None:
                    opts[name] = int(v) if isinstance(v, float) and v.is_integer() else v
        return cls(digest, tuple(sorted(opts.items())))

    @property
    def num_ctx(self) -> int:
        value = dict(self.options)["num_ctx"]
        return value if isinstance(value, int) and value > 0 else CONTEXT_LENGTH

    def serves(self, wanted: LoadSpec) -> bool:
        """needsReload, negated: this runner serves a request of `wanted` without a reload."""
        if self.digest != wanted.digest:
            return False
        mine, theirs = dict(self.options), dict(wanted.options)
        num_gpu = theirs["num_gpu"]
        if isinstance(num_gpu, (int, float)) and num_gpu < 0:
            mine["num_gpu"] = theirs["num_gpu"] = -1
        return mine == theirs


@dataclass(slots=True)
class Runner:
    """One loaded (or loading) model: mutable, owned by the Scheduler."""

    name: str
    size: int
    pid: int
    port: int
    keep_alive_s: float
    sem: asyncio.Semaphore
    state: Literal["loading", "ready", "failed"] = "loading"
    size_vram: int = 0  # Ollama's estimate, fixed when the load starts
    refs: int = 0
    expiring: bool = False
    expires_at_wall: float = 0.0
    load_error: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.Task[None] | None = None
    spec: LoadSpec = field(default_factory=LoadSpec)


@dataclass(frozen=True, slots=True)
class Lease:
    runner: Runner
    load_duration_s: float


class Scheduler:
    def __init__(self, gpu: SimulatedCard, clock: Clock, *, load_gbps: float, unload_delay_s: float,
                 default_keep_alive_s: float, memory_short: MemoryShort, max_loaded: int, num_parallel: int,
                 max_queue: int, notify: Callable[[], None],
                 load_time: Callable[[str, int], float] | None = None) -> None:
        self.gpu = gpu
        self.clock = clock
        self.load_gbps = load_gbps
        self.unload_delay_s = unload_delay_s
        self.default_keep_alive_s = default_keep_alive_s
        self.memory_short: MemoryShort = memory_short
        self.max_loaded = max_loaded
        self.num_parallel = num_parallel
        self.max_queue = max_queue
        self._notify = notify
        self._load_time = load_time  # (model, bytes) -> seconds; None: bytes / load_gbps
        self.runners: dict[str, Runner] = {}
        self.releasing: dict[int, str] = {}  # pid -> model name, killed but memory not yet back
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Runner]] = set()
        self._lock = asyncio.Lock()
        self._pending = 0
        self._ports = iter(range(41234, 65000))
        self.fail_next_load: str | None = None
        self.fail_loads = 0  # how many loads fail with `fail_next_load`
        self.loads = 0

    # -- the request path -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lease(self, name: str, size: int, keep_alive_s: float | None,
                    spec: LoadSpec | None = None) -> AsyncIterator[Lease]:
        """Get a runner (loading if needed; reloading one loaded with another `spec`), hold a reference
        while the body runs, then go idle."""
        started = self.clock.now()
        runner = await self._acquire(name, size, keep_alive_s, spec or LoadSpec())
        try:
            if runner.state == "loading":
                await runner.ready.wait()
            if runner.state == "failed":
                raise ApiError(500, runner.load_error or OOM_MESSAGE)
            yield Lease(runner, self.clock.now() - started)
        finally:
            self._release_ref(runner)

    async def _acquire(self, name: str, size: int, keep_alive_s: float | None, spec: LoadSpec) -> Runner:
        existing = self.runners.get(name)
        if existing is not None and not existing.expiring and existing.state != "failed" and existing.spec.serves(spec):
            return self._take(existing, keep_alive_s)  # fast path: no queue
        if self._pending >= self.max_queue:
            raise ApiError(503, MAX_QUEUE_MESSAGE)
        self._pending += 1
        # The pending loop owns the load: a requester that goes away does not stop it.
        task = asyncio.create_task(self._pending_loop(name, size, keep_alive_s, spec), name=f"schedule:{name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._drop_orphan)
            raise

    def _drop_orphan(self, task: asyncio.Task[Runner]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._release_ref(task.result())

    async def _pending_loop(self, name: str, size: int, keep_alive_s: float | None, spec: LoadSpec) -> Runner:
        try:
            async with self._lock:
                return await self._schedule(name, size, keep_alive_s, spec)
        finally:
            self._pending -= 1

    def _take(self, runner: Runner, keep_alive_s: float | None) -> Runner:
        runner.refs += 1
        runner.idle.clear()
        if runner.timer is not None:
            runner.timer.cancel()
            runner.timer = None
        if keep_alive_s is not None:
            runner.keep_alive_s = keep_alive_s  # sticky
        self._notify()
        return runner

    async def _schedule(self, name: str, size: int, keep_alive_s: float | None, spec: LoadSpec) -> Runner:
        while True:
            existing = self.runners.get(name)
            if existing is not None and not existing.expiring and existing.state != "failed" \
                    and existing.spec.serves(spec):
                return self._take(existing, keep_alive_s)
            if existing is not None:  # needsReload: expire it, wait for its unload, then load anew
                await self._evict(existing)
                continue
            await self.settle()  # memory of earlier unloads must be back before measuring
            if len(self.runners) >= self.max_loaded:
                await self._evict(self._victim())
                continue
            if size > self.gpu.free_bytes() and self.runners:
                await self._evict(self._victim())
                continue
            break
        ka = self.default_keep_alive_s if keep_alive_s is None else keep_alive_s
        port = next(self._ports)
        pid = self.gpu.spawn(RUNNER_NAME, self._cmdline(name, port, spec.num_ctx))
        runner = Runner(name=name, size=size, pid=pid, port=port, keep_alive_s=ka,
                        sem=asyncio.Semaphore(self.num_parallel), size_vram=self._vram_estimate(size), spec=spec)
        runner.refs = 1
        runner.expires_at_wall = self._expiry_wall(ka)  # estimated while loading
        self.runners[name] = runner
        self.loads += 1
        self._notify()
        await self._load(runner)
        return runner

    def _vram_estimate(self, size: int) -> int:
        """The layout decided before the load: all of it on the GPU, or (spill) what fits now. This is
        the size_vram /api/ps reports from the start; the runner then allocates it step by step."""
        return size if self.memory_short == "oom" else max(0, min(size, self.gpu.free_bytes()))

    def _cmdline(self, name: str, port: int, num_ctx: int = CONTEXT_LENGTH) -> str:
        return (f"{RUNNER_PATH} runner --model /root/.ollama/models/blobs/sha256-{blob_digest(name)} "
                f"--ctx-size {num_ctx * self.num_parallel} --batch-size 512 --n-gpu-layers 999 "
                f"--threads 8 --parallel {self.num_parallel} --port {port}")

    async def _load(self, runner: Runner) -> None:
        """Allocate the planned VRAM in LOAD_STEPS steps; memory taken meanwhile by another process makes
        the allocation fail like cudaMalloc (the layout was fixed before the load)."""
        if self._load_time is not None:
            load_s = self._load_time(runner.name, runner.size)
        else:
            load_s = runner.size / (self.load_gbps * 1e9) if self.load_gbps > 0 else 0.0
        plan = runner.size_vram
        step = plan // LOAD_STEPS
        fail = self.fail_next_load
        self.fail_loads = max(0, self.fail_loads - 1)
        if not self.fail_loads:
            self.fail_next_load = None
        try:
            for i in range(LOAD_STEPS):
                await self.clock.sleep(load_s / LOAD_STEPS)
                self.gpu.allocate(runner.pid, step if i < LOAD_STEPS - 1 else plan - step * (LOAD_STEPS - 1))
                if fail is not None:
                    raise ApiError(500, fail)
                self._notify()
        except SimulatedOutOfMemory:
            self._fail(runner, OOM_MESSAGE)
            raise ApiError(500, OOM_MESSAGE) from None
        except ApiError as exc:
            self._fail(runner, exc.message)
            raise
        except BaseException:
            self._fail(runner, "timed out waiting for llama runner to start: context canceled")
            raise
        runner.state = "ready"
        runner.ready.set()
        self._notify()

    def _fail(self, runner: Runner, message: str) -> None:
        """The runner process died during load: it and its memory are gone at once."""
        runner.state = "failed"
        runner.load_error = message
        self.gpu.kill(runner.pid)
        if self.runners.get(runner.name) is runner:
            del self.runners[runner.name]
        runner.ready.set()
        runner.idle.set()
        self._notify()

    def _release_ref(self, runner: Runner) -> None:
        runner.refs -= 1
        if runner.refs > 0 or runner.state == "failed":
            return
        runner.idle.set()
        if self.runners.get(runner.name) is not runner:
            return
        if runner.expiring or runner.keep_alive_s == 0:
            self._unload(runner)
            return
        runner.expires_at_wall = self._expiry_wall(runner.keep_alive_s)
        if math.isfinite(runner.keep_alive_s):
            runner.timer = asyncio.create_task(self._expire_later(runner), name=f"keepalive:{runner.name}")
        self._notify()

    async def _expire_later(self, runner: Runner) -> None:
        await self.clock.sleep(runner.keep_alive_s)
        runner.timer = None
        if runner.refs == 0 and self.runners.get(runner.name) is runner:
            self._unload(runner)

    def _expiry_wall(self, keep_alive_s: float) -> float:
        return self.clock.wall() + (GO_MAX_DURATION_S if not math.isfinite(keep_alive_s) else keep_alive_s)

    # -- unloading --------------------------------------------------------------------------------
    def expire(self, name: str) -> None:
        """expireRunner: unload now if idle, else as soon as in-flight requests finish."""
        runner = self.runners.get(name)
        if runner is None:
            return
        runner.keep_alive_s = 0.0
        runner.expires_at_wall = self.clock.wall()
        if runner.refs == 0 and runner.state == "ready":
            self._unload(runner)
        else:
            runner.expiring = True

    def _unload(self, runner: Runner) -> None:
        """Gone from /api/ps now; the memory comes back unload_delay_s later (asynchronous release)."""
        if runner.timer is not None:
            runner.timer.cancel()
            runner.timer = None
        self.runners.pop(runner.name, None)
        self.releasing[runner.pid] = runner.name
        task = asyncio.create_task(self._finish_release(runner.pid), name=f"release:{runner.name}")
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)
        self._notify()

    async def _finish_release(self, pid: int) -> None:
        try:
            await self.clock.sleep(self.unload_delay_s)
        finally:
            self.gpu.kill(pid)
            self.releasing.pop(pid, None)
            self._notify()

    def _victim(self) -> Runner:
        """findRunnerToUnload: keep_alive ascending (forever last), then name; first idle one, else the first."""
        ordered = sorted(self.runners.values(), key=lambda r: (r.keep_alive_s, r.name))
        return next((r for r in ordered if r.refs == 0), ordered[0])

    async def _evict(self, runner: Runner) -> None:
        if runner.refs > 0 or runner.state == "loading":
            runner.expiring = True
            await runner.idle.wait()
        if self.runners.get(runner.name) is runner:
            self._unload(runner)
        await self.settle()

    async def settle(self) -> None:
        """Wait until every unloaded runner's memory is back."""
        while self._release_tasks:
            await asyncio.gather(*list(self._release_tasks), return_exceptions=True)

    # -- observation and shutdown -----------------------------------------------------------------
    def loaded(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for runner in self.runners.values():
            out[runner.name] = self.gpu.used_by(runner.pid)
        for pid, name in self.releasing.items():
            used = self.gpu.used_by(pid)
            if used:
                out[name] = out.get(name, 0) + used
        return out

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*list(self._background), return_exceptions=True)
        for runner in list(self.runners.values()):
            if runner.timer is not None:
                runner.timer.cancel()
            self.gpu.kill(runner.pid)
            runner.state = "failed"
            runner.load_error = "server shutting down"
            runner.ready.set()
            runner.idle.set()
        self.runners.clear()
        for release in list(self._release_tasks):
            release.cancel()
        await asyncio.gather(*list(self._release_tasks), return_exceptions=True)
        for pid in list(self.releasing):
            self.gpu.kill(pid)
        self.releasing.clear()

