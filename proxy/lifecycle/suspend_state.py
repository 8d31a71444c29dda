"""One tenant's CUDA suspension as data: running, suspending, suspended, resuming or failed.

The pure part of the `cuda_suspend` release kind (`proxy/lifecycle/cuda_suspend.py`): a frozen
record and its transitions, each returning a new record, tested without a loop or a driver. The
owner that drives the driver and keeps one record per tenant is `Suspensions`
(`proxy/lifecycle/suspender.py`).

    running --suspend--> suspending --parked--> suspended --restore--> resuming --back--> running
                             |                                            |
                             +--fail (rolled back: running again) --------+--fail--> failed

`failed` is where a restore that did not work, or a process that exited while suspended, leaves
the tenant: its parked memory is gone (the driver frees it with the process), the next step of its
release list (a stop, then a start) takes over. A suspend that fails half way is rolled back (the
processes already suspended are restored), so it ends in `running` with the error kept: the next
step of the release list runs, and nothing is left parked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

SuspendState = Literal["running", "suspending", "suspended", "resuming", "failed"]

# state -> the states it may go to (every other transition is a bug, raised as one)
MOVES: Mapping[SuspendState, frozenset[SuspendState]] = {
    "running": frozenset({"suspending"}),
    "suspending": frozenset({"suspended", "running", "failed"}),
    "suspended": frozenset({"resuming", "failed"}),
    "resuming": frozenset({"running", "failed"}),
    "failed": frozenset({"suspending", "running"}),
}


class IllegalMove(RuntimeError):
    """A transition the state machine does not have (a bug in the caller, never a user's error)."""


@dataclass(frozen=True, slots=True)
class Suspension:
    """What is known of one tenant's suspension at one moment."""

    tenant: str
    state: SuspendState = "running"
    since: float = 0.0
    pids: tuple[int, ...] = ()  # the CUDA processes suspended (attribution's), empty while running
    parked_bytes: int = 0  # device memory the driver holds in host RAM for them (0 unless suspended)
    via: str | None = None  # "driver API", "cuda-checkpoint", "simulated"
    error: str | None = None  # the last failure, kept until the next success
    fix: str | None = None
    suspends: int = 0  # how many suspends and restores went through, for the views
    restores: int = 0
    last_restore_s: float | None = None  # how long the last restore took (bytes back on the card)

    @property
    def dormant(self) -> bool:
        """A request must wait for it (a restore, or the suspend under way and then a restore)."""
        return self.state in ("suspending", "suspended", "resuming")

    def _to(self, state: SuspendState, now: float, **changes: object) -> Suspension:
        if state not in MOVES[self.state]:
            raise IllegalMove(f"{self.tenant}: no move from {self.state} to {state}")
        return replace(self, state=state, since=now, **changes)  # type: ignore[arg-type]

    def suspending(self, pids: tuple[int, ...], nbytes: int, via: str, now: float) -> Suspension:
        return self._to("suspending", now, pids=pids, parked_bytes=nbytes, via=via)

    def parked(self, now: float) -> Suspension:
        return self._to("suspended", now, error=None, fix=None, suspends=self.suspends + 1)

    def rolled_back(self, error: str, fix: str | None, now: float) -> Suspension:
        """The suspend failed and what it had suspended was restored: running, the error kept."""
        return self._to("running", now, pids=(), parked_bytes=0, error=error, fix=fix)

    def resuming(self, now: float) -> Suspension:
        return self._to("resuming", now)

    def back(self, now: float) -> Suspension:
        took = now - self.since
        return self._to("running", now, pids=(), parked_bytes=0, error=None, fix=None, restores=self.restores + 1,
                        last_restore_s=took)

    def failed(self, error: str, fix: str | None, now: float) -> Suspension:
        """A restore failed, or the process exited while suspended: nothing is parked any more."""
        return self._to("failed", now, pids=(), parked_bytes=0, error=error, fix=fix)

    def recovered(self, now: float) -> Suspension:
        """After `failed`, the app runs again (the fallback started it anew)."""
        return self._to("running", now)
