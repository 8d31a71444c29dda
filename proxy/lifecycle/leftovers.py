"""What an earlier run of the proxy left behind, read from its record (`record.py`): the processes
that are provably that run's (same boot, the leader's pid with its start time and command line, or
a member of its session, its process group, its recorded descendants or its marker, started after
it), or an orphan that matches the record only in part (named in health, never signalled).
Pure reads of /proc (`procs.py`); the controller (`process.py`) ends what they find.
"""

from __future__ import annotations

from proxy.lifecycle import procs
from proxy.lifecycle.controller import JSON


def leftovers(record: JSON) -> dict[int, int] | None:
    """What the recorded run left that still runs and is provably its own (pid -> start time); None
    when something runs that matches the record only in part (named as an orphan instead)."""
    boot = record.get("boot_id")
    if boot is not None and boot != procs.boot_id():
        return {}  # another boot: every number in it names nothing now
    pid, started = record.get("pid"), record.get("start_time")
    if not isinstance(pid, int) or not isinstance(started, int):
        return {}
    leader = procs.proc(pid)
    leader_same = leader is not None and leader.alive and leader.start_time == started
    if leader_same and (not record.get("cmdline") or tuple(record["cmdline"]) != procs.cmdline(pid)):  # type: ignore[arg-type]
        return None
    found: dict[int, int] = {pid: started} if leader_same else {}
    found.update(_members(record, pid, started))
    marker = record.get("marker")
    if isinstance(marker, str) and marker:
        found.update(procs.marked(marker, started))
    return found


def _members(record: JSON, pid: int, started: int) -> dict[int, int]:
    """The live processes of the recorded leader's session or group, or among its recorded
    descendants, started after it."""
    known = record.get("descendants") or []
    found: dict[int, int] = {}
    for p in procs.processes():
        if not p.alive or p.start_time < started:
            continue
        if p.session == pid or p.pgid == pid or [p.pid, p.start_time] in known:  # type: ignore[operator]
            found[p.pid] = p.start_time
    return found


def orphan(record: JSON | None) -> JSON | None:
    """The process an earlier run started and did not stop, if it still runs (same pid, same start time)."""
    if record is None:
        return None
    pid, started = record["pid"], record.get("start_time")
    if not isinstance(pid, int) or started is None or procs.start_time(pid) != started:
        return None  # gone, or its number belongs to another process now
    return {"pid": pid, "command": record.get("command")}
