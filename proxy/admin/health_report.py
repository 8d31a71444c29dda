"""The health report as JSON: the one shape `GET /api/health` writes, `hyperswap check` reads and the
admin API's document describes. An entry is written as it is (`HealthEntry.of(entry)`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.admin import health_entry
from proxy.encoding import JSONModel
from proxy.gpu.visibility import Capability


class HealthEntry(JSONModel):
    name: str
    status: Literal["ok", "degraded", "failed", "unknown"] = Field(
        description="unknown: the check cannot run (what it looks at cannot be seen); problem says why")
    problem: str | None
    impact: str | None
    fix: str | None

    @classmethod
    def of(cls, e: health_entry.HealthEntry) -> HealthEntry:
        return cls(name=e.name, status=e.status, problem=e.problem, impact=e.impact, fix=e.fix)


class HealthReport(JSONModel):
    status: Literal["ok", "degraded", "failed"] = Field(description="the worst entry's (unknown counts as degraded)")
    entries: list[HealthEntry]
    capabilities: list[Capability] = Field(default_factory=list, description=(
        "what works now: without a GPU reader, forwarding and in-flight tracking do; arbitration is estimated or "
        "off; releases are not confirmed (absent when no GPU snapshot could be taken at all)"))
    checked_at: float | None = Field(default=None, description="unix seconds")


def format_report(report: HealthReport) -> str:
    """The report as `hyperswap check` prints it: an entry a line, with its impact and fix when not ok."""
    lines = []
    for e in report.entries:
        lines.append(f"{e.status:<9} {e.name}: {e.problem or 'ok'}")
        if e.status != "ok":
            if e.impact:
                lines.append(f"          impact: {e.impact}")
            if e.fix:
                lines.append(f"          fix:    {e.fix}")
    lines.append(f"overall: {report.status}")
    return "\n".join(lines)
