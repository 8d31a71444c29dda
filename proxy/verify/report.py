"""What `hyperswap verify` found: one result per stage, as text for people and JSON for scripts.

A stage passes, fails (saying what that breaks and how to fix it) or is skipped (saying why): a
stage that could not run is never reported as passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]


class StageFailed(Exception):
    """The stage ran and found a fault: what broke, what that breaks for the user, and the fix."""

    def __init__(self, detail: str, *, impact: str, fix: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.impact = impact
        self.fix = fix


class StageSkipped(Exception):
    """The stage could not run here (nothing to test, no consent, a stage it needs failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class StageResult:
    name: str
    status: Status
    seconds: float
    detail: str
    impact: str | None = None
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3), "detail": self.detail,
                "impact": self.impact, "fix": self.fix}


@dataclass(slots=True)
class Report:
    admin: str
    stages: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """All stages that ran passed (skipped ones neither pass nor fail), and at least one ran."""
        ran = [s for s in self.stages if s.status != "skip"]
        return bool(ran) and all(s.status == "pass" for s in ran)

    def result(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.name == name), None)

    def to_json(self) -> dict[str, Any]:
        counts = {k: sum(1 for s in self.stages if s.status == k) for k in ("pass", "fail", "skip")}
        return {"status": "pass" if self.passed else "fail", "admin": self.admin, "seconds": round(self.seconds, 3),
                "counts": counts, "stages": [s.to_json() for s in self.stages]}

    def text(self) -> str:
        lines = []
        for s in self.stages:
            lines.append(f"{s.status.upper():<5} {s.name:<28} {s.seconds:6.2f} s  {s.detail}")
            if s.status == "fail":
                lines.append(f"{'':<6}breaks: {s.impact}")
                lines.append(f"{'':<6}fix:    {s.fix}")
        j = self.to_json()["counts"]
        lines.append(f"\n{j['pass']} passed, {j['fail']} failed, {j['skip']} skipped in {self.seconds:.1f} s: "
                     + ("verified" if self.passed else "NOT verified"))
        return "\n".join(lines)
