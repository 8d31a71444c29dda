"""Whose server answers on a `process` tenant's port: the rule that tells the app's own from a stranger.

The proxy's child is not always the process that holds the port. `docker run` (or podman, a
launcher that hands off, `systemd-run`) asks a daemon, and the server is the daemon's child, never
in the launcher's process tree: issue 42 found every such start failing "held by pid M, not by the
app the proxy started". A stranger (another program, an earlier copy, another user's server) must
still never be taken for the app: requests would reach it, and a stop would leave it running.

The rule (`tie`): a holder is the app's own when
1. it is in the tree of what the proxy started (the child, its session, its descendants); or
2. the port was free when the start began (a holder present before it fails the start at once,
   naming it), the holder was started at or after the start (its start time in /proc), and
   something ties it to this start:
   - the tenant's `stop_command` (the shape it exists for: `docker run` + `docker stop`: the app is
     run by another program, and the stop asks that program), or
   - the tenant's `pid_file` names it (or one of its ancestors): a file the launcher writes, like
     a daemon's `--pidfile`, or
   - it is in the same cgroup as a process of the tree, and that is not the proxy's own cgroup (a
     `systemd-run --scope`, a container the start made: everything in it was put there by the start).
A holder tied this way is recorded like a descendant: stopped with the app (after its stop command)
and named in the record a restarted proxy reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from proxy.lifecycle import procs


def cgroup(pid: int) -> str | None:
    """The process's cgroup path (the v2 line, else v1's systemd one); None when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    lines = text.splitlines()
    for prefix in ("0::", "1:name=systemd:"):
        for line in lines:
            if line.startswith(prefix):
                return line[len(prefix):] or None
    return None


def read_pid_file(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """`pid` and its parents up to init (a pid file's number may be the daemon's parent of the server)."""
    out: list[int] = []
    while pid > 1 and len(out) < limit:
        out.append(pid)
        p = procs.proc(pid)
        if p is None:
            break
        pid = p.ppid
    return out


@dataclass(frozen=True, slots=True)
class Start:
    """What one start of the app was: when, whether the port was free then, and what ties a holder to it."""

    started: int  # the child's start time (clock ticks since boot)
    port_was_free: bool
    stop_command: bool = False
    pid_file: Path | None = None


def tie(holder: int, start: Start, tree: Mapping[int, int], own_cgroup: str | None = None) -> str | None:
    """Why `holder` is the app's own (a few words, for the log), or None when it is a stranger."""
    if holder in tree:
        return "in the tree of what the proxy started"
    p = procs.proc(holder)
    if p is None or not p.alive or not start.port_was_free or p.start_time < start.started:
        return None  # present before the start, or the port was not free: never the app's
    if start.stop_command:
        return "started after the start, by what the start ran (its stop command stops it)"
    named = read_pid_file(start.pid_file)
    if named is not None and named in ancestors(holder):
        return f"named by its pid file {start.pid_file}"
    mine = cgroup(holder)
    if mine is not None and mine != (own_cgroup if own_cgroup is not None else cgroup(os.getpid())) \
            and any(cgroup(pid) == mine for pid in tree):
        return f"in the cgroup the start made ({mine})"
    return None


def sort_holders(holders: Iterable[int], start: Start, tree: Mapping[int, int]) -> tuple[dict[int, str], list[int]]:
    """The holders split into the app's own (pid -> why) and strangers."""
    own_cg = cgroup(os.getpid())
    ours: dict[int, str] = {}
    strangers: list[int] = []
    for pid in holders:
        why = tie(pid, start, tree, own_cg)
        if why is None:
            strangers.append(pid)
        else:
            ours[pid] = why
    return ours, strangers
