"""How the proxy ends what it started (release kind `process`): signals to a child's process group
and to each member of its tree it can prove is the same process (pid and start time), a bounded
wait until they are gone, the leftovers of a stop command (what carries its run's marker), and the
stop command itself, run in a process group of its own and killed with it when it runs over.

Functions of the tree they are given; the controller (`process.py`) decides when to call them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from proxy.clock import Clock
from proxy.lifecycle import procs
from proxy.lifecycle.controller import Exit, within
from proxy.lifecycle.logfile import MAX_LINE

GONE_AFTER_KILL_S = 2.0  # how long a SIGKILLed process may take to disappear before the stop fails
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # looked up here: the child between fork and exec must not load libraries


def die_with(parent: int) -> Callable[[], None]:
    """The child's last step before exec: SIGKILL when the proxy dies, and if it died already, now."""

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the proxy died between fork and prctl
            os._exit(1)

    return preexec


async def kill_group(proc: asyncio.subprocess.Process, clock: Clock) -> None:
    """SIGKILL a command's whole process group (a wrapper script's children too) and reap it, bounded."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await asyncio.shield(within(clock, GONE_AFTER_KILL_S, proc.wait()))


def last_line(out: IO[bytes]) -> str | None:
    """The last non-empty line a command wrote to `out` (a file), cut to MAX_LINE characters."""
    try:
        out.seek(0, os.SEEK_END)
        size = out.tell()
        out.seek(max(0, size - 4096))
        data = out.read()
    except OSError:
        return None
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:MAX_LINE] if lines else None


def exit_of(code: int) -> Exit:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return Exit(code, f"killed by signal {-code} ({name})")
    return Exit(code, f"exited with code {code}")


def signal_all(proc: asyncio.subprocess.Process | None, members: Mapping[int, int], sig: signal.Signals) -> None:
    """`sig` to the child's group (while its leader runs: the group's number is still ours) and to
    every member that is still the process it was (pid -> start time)."""
    if proc is not None and proc.returncode is None:  # the running leader keeps the group's number ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    for pid, started in members.items():
        if procs.same(pid, started):  # never a number someone else has now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


async def gone(clock: Clock, members: Mapping[int, int], deadline: float) -> None:
    """Wait, polling with a short backoff, until none of `members` runs or the deadline passes."""
    delay = 0.005
    while any(procs.same(pid, t) for pid, t in members.items()) and clock.now() < deadline:
        await clock.sleep(min(delay, max(0.0, deadline - clock.now())))
        delay = min(delay * 2, 0.1)


async def end_marked(clock: Clock, marker: str, since: int) -> None:
    """End what carries `marker` (a stop command's leftovers): SIGTERM, SIGKILL after GONE_AFTER_KILL_S."""
    left = await asyncio.to_thread(procs.marked, marker, since)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in left.items():
            if procs.same(pid, started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        await gone(clock, left, clock.now() + GONE_AFTER_KILL_S)
        left = {pid: t for pid, t in left.items() if procs.same(pid, t)}
        if not left:
            return


async def end_tree(proc: asyncio.subprocess.Process, members: Mapping[int, int], clock: Clock,
                   timeout_s: float) -> list[int]:
    """SIGTERM to the child and its tree (SIGCONT too: a stopped app gets its SIGTERM only once it
    runs), SIGKILL to what still runs after `timeout_s`; the pids that outlive even that."""
    deadline = clock.now() + timeout_s
    signal_all(proc, members, signal.SIGTERM)
    signal_all(proc, members, signal.SIGCONT)
    await within(clock, timeout_s, proc.wait())
    await gone(clock, members, deadline)  # what the child spawned had the same SIGTERM
    left = {pid: t for pid, t in members.items() if procs.same(pid, t)}
    if left:
        signal_all(proc, left, signal.SIGKILL)
        await within(clock, GONE_AFTER_KILL_S, proc.wait())  # reap
        await gone(clock, left, clock.now() + GONE_AFTER_KILL_S)
    return [pid for pid, t in left.items() if procs.same(pid, t)]


@dataclass(frozen=True, slots=True)
class StopCommand:
    """A stop command (release.stop_command) and how it runs: the app's cwd and environment, a marker
    of its own in it (what it leaves is ended once it returns)."""
    argv: Sequence[str]
    cwd: str | None
    env: Mapping[str, str]
    marker: str
    timeout_s: float


async def stop_by_command(stop: StopCommand, proc: asyncio.subprocess.Process, members: Mapping[int, int],
                          clock: Clock) -> str | None:
    """Run the stop command; None once the child and what it spawned are gone, within its timeout
    (the command's run and the app's exit after it share it). Else why the signals must follow: it
    could not run, failed, ran over (then killed with its group), or the app still ran at the deadline."""
    shown = " ".join(stop.argv)
    deadline = clock.now() + stop.timeout_s
    with tempfile.TemporaryFile() as out:  # a file, not a pipe: a descendant holding it cannot hang the stop
        try:
            cmd = await asyncio.create_subprocess_exec(
                *stop.argv, cwd=stop.cwd, env={**stop.env, procs.RUN_VAR: stop.marker},
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                preexec_fn=die_with(os.getpid()))
        except OSError as exc:
            return f"its stop command `{shown}` could not run: {exc.strerror or exc}"
        cmd_started = procs.start_time(cmd.pid) or 0
        try:
            finished, code = await within(clock, stop.timeout_s, cmd.wait())
        finally:  # ran over, or the stop was cancelled: nothing of it may stay behind
            if cmd.returncode is None:
                await kill_group(cmd, clock)
            await end_marked(clock, stop.marker, cmd_started)  # what it left (a `setsid` child)
        if not finished:
            return (f"its stop command `{shown}` did not finish within {stop.timeout_s:g} s "
                    f"(stop_timeout_s) and was killed")
        if code != 0:
            last = last_line(out)
            return f"its stop command `{shown}` failed ({exit_of(code or 0).reason})" + (f": {last}" if last else "")
    await within(clock, max(0.0, deadline - clock.now()), proc.wait())
    await gone(clock, members, deadline)
    left = [pid for pid, t in members.items() if procs.same(pid, t)]
    if left:
        return (f"its stop command `{shown}` ended, but {procs.describe(left[0])} still ran "
                f"{stop.timeout_s:g} s (stop_timeout_s) after it was run")
    return None
