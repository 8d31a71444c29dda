"""What the engines said of themselves, the busy rule's evidence besides traffic. Owned by the scheduler.

The watchdog reads each engine's own queue (what it runs, for clients that bypass the proxy and for
jobs whose end the proxy missed) and asks whether it computes on the CPU; it posts what it read
here. `proxy/handoff/busy.py` turns it, with the traffic, into each tenant's busy state.
"""

from __future__ import annotations

from proxy.handoff.busy import QueueRead


class EngineReads:
    def __init__(self) -> None:
        self.queues: dict[str, QueueRead] = {}  # tenant -> the jobs its own queue said run, and when it was read
        self.unreachable_since: dict[str, float] = {}  # tenant -> since when its queue does not answer
        self.cpu: set[str] = set()  # engines that said they compute on the CPU

    def queue_read(self, tenant: str, started_at: float, job_ids: tuple[str, ...] | None) -> None:
        """What the engine's own queue said was running, read from `started_at` (None: it did not
        answer; since when is kept until it answers again)."""
        if job_ids is None:
            self.queues.pop(tenant, None)
            self.unreachable_since.setdefault(tenant, started_at)
        else:
            self.queues[tenant] = QueueRead(started_at, job_ids)
            self.unreachable_since.pop(tenant, None)

    def on_cpu(self, tenant: str, cpu: bool) -> None:
        """An engine on the CPU holds nothing on the card, so neither its busy state nor a release
        can be judged by its VRAM."""
        if cpu:
            self.cpu.add(tenant)
        else:
            self.cpu.discard(tenant)
