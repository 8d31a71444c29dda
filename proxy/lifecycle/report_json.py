"""A lifecycle tenant's start or stop, and a CUDA suspension, as JSON: the shapes the admin API, the
events stream and the decision log write and the admin API's document describes (`X.of(value)`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.encoding import JSONModel
from proxy.lifecycle import state as lifecycle_state
from proxy.lifecycle.suspend_state import Suspension


class LifecycleReport(JSONModel):
    """How one start or stop ended, or why it never began (refused)."""
    tenant: str
    action: Literal["start", "stop", "exit"] = Field(description="exit: it ended on its own while running")
    ok: bool
    state: Literal["running", "stopped", "starting", "stopping", "failed", "exited"] = Field(
        description="the state after it")
    duration_s: float
    error: str | None
    fix: str | None
    output: list[str]
    retry_in_s: float | None
    refused: bool = Field(description="it never began (busy, starting, backing off)")
    exit_code: int | None = Field(default=None, description="exit: its code (negative: the signal), when known")
    restart_in_s: float | None = Field(default=None, description="exit: the restart policy starts it again in this "
                                                                 "long; null: the next request will")

    @classmethod
    def of(cls, r: lifecycle_state.LifecycleReport) -> LifecycleReport:
        return cls(tenant=r.tenant, action=r.action, ok=r.ok, state=r.state, duration_s=round(r.duration_s, 3),
                   error=r.error, fix=r.fix, output=list(r.output), retry_in_s=r.retry_in_s, refused=r.refused,
                   exit_code=r.exit_code, restart_in_s=r.restart_in_s)


class Suspended(JSONModel):
    """A tenant with a cuda_suspend release step: its processes parked in host RAM or not (lifecycle/suspend_state.py)."""
    state: Literal["running", "suspending", "suspended", "resuming", "failed"]
    pids: list[int]
    parked_bytes: int = Field(description="its device memory the driver holds in host RAM now (0 unless suspended)")
    via: str | None = Field(description="driver API, cuda-checkpoint or simulated; null before the first suspend")
    error: str | None = Field(description="why the last suspend or restore failed; null: it worked, or none ran")
    fix: str | None
    since: float = Field(default=0.0, description="unix seconds, when it entered this state")
    suspends: int = Field(default=0, description="suspends that went through")
    restores: int = Field(default=0, description="restores that went through")
    last_restore_s: float | None = Field(default=None, description="how long the last restore took")

    @classmethod
    def of(cls, s: Suspension) -> Suspended:
        return cls(state=s.state, since=s.since, pids=list(s.pids), parked_bytes=s.parked_bytes, via=s.via,
                   error=s.error, fix=s.fix, suspends=s.suspends, restores=s.restores, last_restore_s=s.last_restore_s)
