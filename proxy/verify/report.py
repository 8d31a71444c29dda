"""What `hyperswap verify` found: one result per stage, as text for people and JSON for scripts.

A stage passes, fails (saying what that breaks and how to fix it), is skipped (saying why; a skipped
stage did nothing), or is incomplete (it changed something, says what, then stopped before it could
prove its point): a stage that could not run is never reported as passed. The verdict says what the
run proved: "verified", "verified without arbitration (no GPU reader)" (every check that ran passed,
but without a GPU reader no release, out of memory or refusal could be confirmed on the card), or
"NOT verified"; each has its own exit status (EXIT_CODES).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.encoding import JSONModel

Status = Literal["pass", "fail", "skip", "incomplete"]
STATUSES: tuple[Status, ...] = ("pass", "fail", "skip", "incomplete")

VERIFIED = "verified"
WITHOUT_ARBITRATION = "verified without arbitration (no GPU reader)"
NOT_VERIFIED = "NOT verified"
# The verdict as the command's exit status and the JSON report's "status" (2 stays the CLI's own
# usage and configuration errors).
EXIT_CODES = {VERIFIED: 0, NOT_VERIFIED: 1, WITHOUT_ARBITRATION: 3}
JSON_STATUS = {VERIFIED: "pass", NOT_VERIFIED: "fail", WITHOUT_ARBITRATION: "pass-without-arbitration"}


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


@dataclass(slots=True)
class Report:
    admin: str
    stages: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0
    # Whether the proxy reads the card (None: not known, the proxy never answered). Without a reader
    # no release, out of memory or refusal can be confirmed, so the run cannot say "verified".
    gpu_reader: bool | None = None

    @property
    def passed(self) -> bool:
        """No stage failed and at least one passed (skipped and incomplete ones neither pass nor fail)."""
        return any(s.status == "pass" for s in self.stages) and not any(s.status == "fail" for s in self.stages)

    @property
    def verdict(self) -> str:
        if not self.passed:
            return NOT_VERIFIED
        return WITHOUT_ARBITRATION if self.gpu_reader is False else VERIFIED

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def summary(self) -> str:
        """The verdict with what it rests on: the stages that proved something, and those skipped
        ("partly verified: 2 stage(s) skipped: reclaim, out of memory; proved: ..."), so a run that
        skipped the reclaim never reads as if it had verified one. The exit status is the verdict's."""
        named = {k: [s.name for s in self.stages if s.status == k] for k in STATUSES}
        if self.verdict == NOT_VERIFIED:
            failed = named["fail"]
            return NOT_VERIFIED + (f": failed: {', '.join(failed)}" if failed else ": no stage passed")
        skipped = named["skip"] + named["incomplete"]
        if not skipped:
            return f"{self.verdict}: {', '.join(named['pass'])}"
        return (f"partly {self.verdict}: {len(skipped)} stage(s) skipped or incomplete: {', '.join(skipped)}; "
                f"proved: {', '.join(named['pass'])}")

    def result(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.name == name), None)

    def counts(self) -> dict[str, int]:
        """How many stages ended each way: pass, fail, skip, incomplete."""
        return {k: sum(1 for s in self.stages if s.status == k) for k in STATUSES}

    def text(self) -> str:
        lines = []
        for s in self.stages:
            lines.append(f"{s.status.upper():<5} {s.name:<28} {s.seconds:6.2f} s  {s.detail}")
            if s.status == "fail":
                lines.append(f"{'':<6}breaks: {s.impact}")
                lines.append(f"{'':<6}fix:    {s.fix}")
        j = self.counts()
        incomplete = f", {j['incomplete']} incomplete" if j["incomplete"] else ""
        lines.append(f"\n{j['pass']} passed, {j['fail']} failed, {j['skip']} skipped{incomplete} in {self.seconds:.1f} s: "
                     + self.summary)
        return "\n".join(lines)


class Stage(JSONModel):
    """One stage's result as the JSON report lists it."""
    name: str
    status: Status
    seconds: float
    detail: str
    impact: str | None
    fix: str | None

    @classmethod
    def of(cls, r: StageResult) -> Stage:
        return cls(name=r.name, status=r.status, seconds=round(r.seconds, 3), detail=r.detail, impact=r.impact,
                   fix=r.fix)


class VerifyReport(JSONModel):
    """`hyperswap verify --json`: the verdict, what it rests on, and each stage."""
    status: str
    verdict: str
    summary: str
    gpu_reader: bool | None
    admin: str
    seconds: float
    counts: dict[str, int]
    stages: list[Stage]

    @classmethod
    def of(cls, r: Report) -> VerifyReport:
        return cls(status=JSON_STATUS[r.verdict], verdict=r.verdict, summary=r.summary, gpu_reader=r.gpu_reader,
                   admin=r.admin, seconds=round(r.seconds, 3), counts=r.counts(), stages=[Stage.of(s) for s in r.stages])
