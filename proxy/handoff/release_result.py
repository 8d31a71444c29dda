"""How one release went (`ReleaseResult`), and its JSON (`ReleaseOutcome`): the one shape a decision's
outcome lists, the admin API's `/release` answers and the document describes.

A release is done when the card shows the memory back, never on the engine's 200 (invariant 6): only
then is it `confirmed`. Without a GPU reader it is judged from the engine's own report (`estimated`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from proxy.encoding import JSONModel
from proxy.handoff.plan import gib

ReleaseVerdict = Literal["confirmed", "estimated", "timeout", "error"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step of a release that escalates (tenants.json `release` as a list): what it freed."""

    step: int  # its index in the tenant's release list
    kind: str  # its release kind
    freed_bytes: int
    duration_s: float
    result: ReleaseVerdict
    error: str | None


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    tenant: str
    expected_bytes: int
    freed_bytes: int
    duration_s: float
    confirmed: bool  # the card showed the memory back (invariant 6)
    error: str | None = None
    asked: Mapping[str, object] = field(default_factory=dict)  # what the engine was asked and answered (JSON)
    # Judged from the engines' own reports (no GPU reader): never `confirmed`, and `freed_bytes` is
    # what the engine says, not what the card shows. Ollama drops a model from /api/ps before its
    # memory is back.
    estimated: bool = False
    timed_out: bool = False  # asked, but the memory was not back within the tenant's release_timeout_s
    busy: bool = False  # not asked: the tenant had work again when its turn came (a busy tenant is never released)
    steps: tuple[StepResult, ...] = ()  # each release step tried, for a release that escalates

    @property
    def result(self) -> ReleaseVerdict:
        """How it ended, for those that count releases (metrics, telemetry, the admin API's status)."""
        if self.confirmed:
            return "confirmed"
        if self.estimated and self.error is None:
            return "estimated"  # the engine's own report said so; the card was not read
        return "timeout" if self.timed_out else "error"


class ReleaseStep(JSONModel):
    """One step of a release that escalates (tenants.json `release` as a list): what it freed."""
    step: int = Field(description="its index in the tenant's release list")
    kind: str = Field(description="its release kind (http, comfyui, process, systemd, docker, ...)")
    freed_bytes: int = Field(description="what the card (or, estimated, the engine) showed back after it")
    duration_s: float
    result: ReleaseVerdict
    error: str | None = None

    @classmethod
    def of(cls, s: StepResult) -> ReleaseStep:
        return cls(step=s.step, kind=s.kind, freed_bytes=s.freed_bytes, duration_s=round(s.duration_s, 3),
                   result=s.result, error=s.error)


class ReleaseOutcome(JSONModel):
    """One executed release as a decision's outcome lists it (`ReleaseOutcome.of(result)`)."""
    tenant: str = ""
    expected_bytes: int = 0
    freed_bytes: int = Field(default=0, description="as measured on the GPU; when estimated, as the engine's own "
                                                    "report says")
    expected_gb: float | None = None
    freed_gb: float | None = None
    duration_s: float = 0.0
    confirmed: bool = Field(default=False, description="the card showed the memory back")
    estimated: bool = Field(default=False, description="no GPU reader: judged from the engine's own report (Ollama's "
                                                       "/api/ps, ComfyUI's /system_stats), which may say so before "
                                                       "the memory is back; never confirmed")
    error: str | None = None
    asked: Mapping[str, object] | None = Field(default=None, description="what the engine was asked and answered")
    result: ReleaseVerdict | Literal["not_on_gpu"] | None = Field(default=None, description=(
        "confirmed (the card showed the memory back), estimated (the engine's own report said so), timeout "
        "(not back within release_timeout_s), error (the engine refused or was down), or not_on_gpu (the admin's "
        "release of an engine that computes on the CPU and holds nothing on the card: nothing was asked)"))
    steps: list[ReleaseStep] | None = Field(default=None, description="each step tried, in order, until one freed "
                                                                       "the memory")

    @classmethod
    def of(cls, r: ReleaseResult) -> ReleaseOutcome:
        out = cls(tenant=r.tenant, expected_bytes=r.expected_bytes, freed_bytes=r.freed_bytes,
                  expected_gb=gib(r.expected_bytes), freed_gb=gib(r.freed_bytes), duration_s=round(r.duration_s, 3),
                  confirmed=r.confirmed, estimated=r.estimated, error=r.error, asked=r.asked, result=r.result)
        if r.steps:  # only a release that escalates lists its steps
            out.steps = [ReleaseStep.of(s) for s in r.steps]
        return out
