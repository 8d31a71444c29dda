"""A health entry (one dependency: what is wrong, what it breaks, what fixes it) and the entries of a
tenant the proxy starts and stops. `GET /api/health` writes them as `health_report.HealthEntry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.lifecycle.state import TenantLifecycle

# "unknown": the check cannot run (what it looks at cannot be seen); it says why. The overall
# status then is at least degraded: nobody can say all is well.
Status = Literal["ok", "degraded", "failed", "unknown"]
Overall = Literal["ok", "degraded", "failed"]  # the report's: unknown counts as degraded
_RANK: dict[str, int] = {"ok": 0, "degraded": 1, "unknown": 1, "failed": 2}


@dataclass(frozen=True, slots=True)
class HealthEntry:
    name: str
    status: Status
    problem: str | None = None
    impact: str | None = None
    fix: str | None = None


def worst(statuses: Sequence[str]) -> Overall:
    rank = max((_RANK.get(s, 2) for s in statuses), default=0)
    ranked: tuple[Overall, ...] = ("ok", "degraded", "failed")
    return ranked[rank]


def split_fix(problem: str) -> tuple[str, str | None]:
    """A controller's problem line, `what is wrong (fix: what to do)`, as (problem, fix)."""
    text, sep, fix = problem.rpartition(" (fix: ")
    if not sep or not fix.endswith(")"):
        return problem, None
    return text, fix[:-1]


def lifecycle_entries(name: str, machine: TenantLifecycle, problems: list[str] | BaseException) -> list[HealthEntry]:
    """Health of one tenant the proxy starts and stops: its state, and its controller's problems."""
    entry = f"lifecycle {name}"
    view = machine.view()
    what = machine.controller.summary()
    if isinstance(problems, BaseException):
        problems = [f"its check raised {type(problems).__name__}: {problems} (fix: see the proxy's log)"]
    out: list[HealthEntry] = []
    snap = machine.snapshot
    if machine.state in ("failed", "exited") and snap.crashes and not snap.failures and snap.error:
        out.append(_crashed(name, machine, view))
    elif machine.state == "failed":
        out.append(_start_failed(name, machine, view))
    if machine.preload_error is not None and machine.state != "running":
        out.append(HealthEntry(
            entry, "failed", f"its preload (a start once the proxy was up) failed: {machine.preload_error}",
            f"{name} was not started with the proxy: the first request that needs it waits for its start",
            machine.preload_fix or f"see its output (GET /api/tenants/{name}), correct the cause, then start it "
                                   f"(POST /api/tenants/{name}/start)"))
    for problem in problems:
        text, fix = split_fix(problem)
        out.append(HealthEntry(entry, "failed", text,
                               f"the proxy cannot start and stop {name} as tenants.json says ({what})",
                               fix or f"see `hyperswap check` and release of tenants.{name} in tenants.json"))
    if not out:
        out.append(HealthEntry(entry, "ok", f"{machine.state} for {view['for_s']:.0f} s ({what})"))
    return out


def _crashed(name: str, machine: TenantLifecycle, view: Mapping[str, object]) -> HealthEntry:
    """It ended on its own while running (crashed: failed; exited: degraded)."""
    snap = machine.snapshot
    retry = view["retry_in_s"]
    last = snap.output[-1:]
    pending = machine.restart_pending()
    policy = (f"the restart policy starts it again{f' in {retry:.0f} s' if retry else ''}" if pending else
              f"the next request to {name} starts it again" + (f" (in {retry:.0f} s)" if retry else ""))
    if machine.restart == "never":
        then = "or set restart: on-failure in tenants.json to have it started again at once"
    elif pending:
        then = "it is restarted by its policy"
    elif machine.state == "exited":
        then = "a clean exit (code 0) is not restarted by restart: on-failure"
    else:
        then = machine.restart_status or "its restart policy does not start it again"
    return HealthEntry(
        f"lifecycle {name}", "failed" if machine.state == "failed" else "degraded",
        f"{'it crashed' if machine.state == 'failed' else 'it exited'} while running: {snap.error}"
        + (f"; its last output line: {last[0]}" if last else ""),
        f"requests to {name} fail until it runs again: {policy}",
        f"see why in its output (GET /api/tenants/{name}: lifecycle.output, or its log "
        f"{machine.controller.describe().get('log') or ''}".rstrip() + "), correct the cause; "
        + then)


def _start_failed(name: str, machine: TenantLifecycle, view: Mapping[str, object]) -> HealthEntry:
    """Its last start failed."""
    snap = machine.snapshot
    retry = view["retry_in_s"]
    last = snap.output[-1:]
    return HealthEntry(
        f"lifecycle {name}", "failed",
        (f"its last start failed ({view['failures']} in a row): {snap.error}" if snap.failures else f"{snap.error}")
        + (f"; its last output line: {last[0]}" if last else ""),
        f"requests to {name} answer 503 " + (f"until the next try in {retry:.0f} s" if retry else "until a start works")
        + (f"; {machine.restart_status}" if machine.restart_status else ""),
        snap.fix or f"see its output (GET /api/tenants/{name}), correct the cause, then start it "
                    f"(POST /api/tenants/{name}/start, or the dashboard's Start button)")
