"""The demo's CUDA checkpointing: the `Checkpointer` of proxy/lifecycle/cuda_driver.py on the
simulated card, following the driver's facts (docs/guides/cuda-suspend.md):

- a suspend takes what the process holds on the card / `copy_gbps` (the copy into host RAM), then
  the card shows its memory free; a restore takes the same time and needs the memory free on the
  card again (else it fails and the process stays suspended);
- while suspended the simulated engines' GPU work blocks (`SimulatedGpu.cuda_ready`), as the driver
  blocks a suspended process's CUDA calls, and their HTTP side goes on answering;
- host RAM is finite: `host_ram_bytes`, less what is parked (what `MemAvailable` would say);
- a process the card does not know is gone; one in `not_cuda` has no CUDA state.

Hooks for tests: `fail_next_restore(message)`, `not_cuda`, `suspends`, `restores`.
"""

from __future__ import annotations

from proxy.clock import Clock
from proxy.lifecycle.cuda_driver import CheckpointError, ProcessState
from proxy.sim.gpu import GIB, SimulatedGpu, SimulatedOutOfMemory


class SimulatedCheckpointer:
    via = "simulated"

    def __init__(self, gpu: SimulatedGpu, clock: Clock, *, host_ram_bytes: int = 64 * GIB,
                 copy_gbps: float = 12.0) -> None:
        self.gpu = gpu
        self.clock = clock
        self.host_ram_bytes = host_ram_bytes
        self.copy_gbps = copy_gbps  # host <-> device copy rate, GB/s (10**9 bytes)
        self.not_cuda: set[int] = set()
        self.suspends = 0
        self.restores = 0
        self._fail_restore: str | None = None

    def fail_next_restore(self, message: str) -> None:
        self._fail_restore = message

    def copy_s(self, nbytes: int) -> float:
        return nbytes / (self.copy_gbps * 1e9)

    async def state(self, pid: int) -> ProcessState:
        if not self.gpu.alive(pid):
            return "gone"
        if pid in self.not_cuda:
            return "not_cuda"
        return "checkpointed" if pid in self.gpu.parked() else "running"

    async def suspend(self, pid: int, lock_timeout_s: float) -> None:
        state = await self.state(pid)
        if state != "running":
            raise CheckpointError(f"process {pid} is {state.replace('_', ' ')}, not a running CUDA process",
                                  not_cuda=state == "not_cuda", gone=state == "gone")
        await self.clock.sleep(self.copy_s(self.gpu.used_by(pid)))
        if not self.gpu.alive(pid):
            raise CheckpointError(f"process {pid} exited during its suspend", gone=True)
        self.gpu.park(pid)
        self.suspends += 1

    async def restore(self, pid: int) -> None:
        state = await self.state(pid)
        if state != "checkpointed":
            raise CheckpointError(f"process {pid} is {state.replace('_', ' ')}: nothing to restore", gone=state == "gone")
        fail, self._fail_restore = self._fail_restore, None
        if fail is not None:
            raise CheckpointError(fail)
        await self.clock.sleep(self.copy_s(self.gpu.parked().get(pid, 0)))
        try:
            self.gpu.unpark(pid)
        except SimulatedOutOfMemory as exc:
            raise CheckpointError(f"restore of process {pid} needs {exc.requested} bytes on the card, {exc.free} free",
                                  fix="the card must have the memory free again before a restore") from None
        except KeyError:
            raise CheckpointError(f"process {pid} exited while suspended", gone=True) from None
        self.restores += 1

    def host_available_bytes(self) -> int | None:
        return max(0, self.host_ram_bytes - sum(self.gpu.parked().values()))
