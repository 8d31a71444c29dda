"""A guard beside each running `process` app: when the proxy dies, it ends what the app spawned.

The kernel ends the app's own process when the proxy dies (PR_SET_PDEATHSIG), but not what the app
spawned: issue 42 found an app behind a shell (`sh -c "server & wait"`) keeping its port after
`kill -9` of the proxy until the proxy was started again, whose record then ended it. The guard
closes that gap: a small process of its own (its own session, so a terminal's Ctrl-C reaches it
no more than the app; no run id in its environment, so it is never one of the app's), started with
the app, reading a pipe whose other end only the proxy holds.

- The proxy stops the app (or the app ended and its leftovers were stopped): the proxy writes one
  byte and closes the pipe, and the guard exits, doing nothing.
- The proxy dies, however (kill -9 included): the kernel closes the proxy's end, the guard reads
  end-of-file and ends every process of the run: started at or after the app, and in its process
  group or session, or carrying its run id (`HYPERSWAP_RUN`): SIGTERM, then SIGKILL after the
  tenant's stop_timeout_s. Then it exits.

Its rule is the record's (`leftovers.leftovers`), so a restarted proxy that finds the
guard's work done finds nothing left; should the guard itself be killed with the proxy, the record
still ends what is left at the next start. The guard is a few lines of Python run with `-S`
(about 10 MB while the app runs). It waits with real sleeps: it is a process of its own, with no
event loop and no injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from proxy.clock import Clock
from proxy.lifecycle.controller import within

GUARD = r"""
import os, signal, sys, time
marker, group, since, grace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if os.read(0, 1):
    sys.exit(0)  # the proxy let go: it stopped the app itself
want = ("HYPERSWAP_RUN=" + marker).encode()
def stat(pid):
    with open("/proc/%d/stat" % pid, "rb") as f:
        fields = f.read().decode("utf-8", "replace").rpartition(")")[2].split()
    return fields[0], int(fields[2]), int(fields[3]), int(fields[19])
def members():
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            state, pgid, sid, started = stat(int(entry))
            if state in ("Z", "X") or started < since:
                continue
            if pgid == group or sid == group:
                out[int(entry)] = started
                continue
            with open("/proc/%s/environ" % entry, "rb") as f:
                if want in f.read().split(b"\0"):
                    out[int(entry)] = started
        except (OSError, ValueError, IndexError):
            continue
    return out
def alive(pid, started):
    try:
        state, _, _, now = stat(pid)
    except (OSError, ValueError, IndexError):
        return False
    return state not in ("Z", "X") and now == started
for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
    found = members()
    for pid, started in found.items():
        if alive(pid, started):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    end = time.monotonic() + wait
    while any(alive(p, s) for p, s in found.items()) and time.monotonic() < end:
        time.sleep(0.05)
"""

QUIT_WITHIN_S = 2.0  # a guard told to let go exits at once; past this it is killed


class Guard:
    """The guard of one run: `arm` it once the app runs, `release` it once the app is stopped."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.proc: asyncio.subprocess.Process | None = None
        self._arming: asyncio.Task[None] | None = None

    async def arm(self, marker: str, group: int, since: int, grace_s: float) -> None:
        """Start the guard beside the app's start, not before it: its fork and exec (5 to 13 ms on
        2 busy cores) overlap the app's readiness instead of adding to a cold start."""
        await self.release()
        self._arming = asyncio.create_task(self._spawn(marker, group, since, grace_s), name="lifecycle-guard")

    async def _spawn(self, marker: str, group: int, since: int, grace_s: float) -> None:
        """Best effort: an app runs without its guard when it cannot start (its record still serves)."""
        with contextlib.suppress(OSError):
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-S", "-c", GUARD, marker, str(group), str(since), f"{grace_s:g}",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True, env={})

    async def release(self) -> None:
        """The proxy ended the app itself: tell the guard to exit without acting, and reap it."""
        arming, self._arming = self._arming, None
        if arming is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(arming)  # a guard being started is let go once it runs
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                proc.stdin.write(b"q")
                proc.stdin.close()
        finished, _ = await within(self.clock, QUIT_WITHIN_S, proc.wait())
        if not finished:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await within(self.clock, QUIT_WITHIN_S, proc.wait())

    async def armed(self) -> int | None:
        """The guard's pid once it runs (None: it could not start, or none was armed)."""
        if self._arming is not None:
            await asyncio.shield(self._arming)
        return self.proc.pid if self.proc is not None else None
