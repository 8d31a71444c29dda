"""A systemd unit the proxy stops and starts (release kind `systemd`), through `systemctl`.

Why `systemctl` rather than systemd's D-Bus API: it needs no extra dependency (a D-Bus client
library, or a hand-written one over the bus socket), it is what the operator types, so an error
reads the same and its fix can be pasted into a shell, and it goes through the same polkit rules
as the admin's own commands (a rule that lets the proxy's user manage `comfyui.service` is one
the admin can read and test with `systemctl`). The cost, a process per call, is milliseconds next
to a unit's own start and stop. `--user` reaches the user's manager (scope `user`).

The unit name comes from tenants.json only (validated: it cannot start with '-'), and `--` ends the
options before it, so nothing from a request ever reaches the command line. A unit that runs when
the proxy starts is adopted (`status` says running); at shutdown it is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Literal

from proxy.clock import Clock, SystemClock
from proxy.lifecycle.controller import JSON, Exit, LifecycleError, Status, within
from proxy.tenants import ReleaseSpec

COMMAND_TIMEOUT_S = 120.0  # systemctl waits for the unit's job; the unit's own TimeoutStartSec/TimeoutStopSec bound it
RUNNING = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})  # holds its memory still
STOPPED = frozenset({"inactive", "failed"})


class SystemdController:
    kind = "systemd"

    def __init__(self, unit: str, scope: Literal["system", "user"] = "system", *,
                 systemctl: str | Sequence[str] = "systemctl", command_timeout_s: float = COMMAND_TIMEOUT_S,
                 clock: Clock | None = None) -> None:
        self.unit = unit
        self.scope = scope
        self.systemctl = (systemctl,) if isinstance(systemctl, str) else tuple(systemctl)
        self.command_timeout_s = command_timeout_s
        self.clock: Clock = clock or SystemClock()
        self._last: tuple[str, ...] = ()  # the last failing command's output

    @classmethod
    def from_spec(cls, spec: ReleaseSpec, *, systemctl: str | Sequence[str] = "systemctl",
                  clock: Clock | None = None) -> SystemdController:
        if spec.unit is None:
            raise ValueError(f"release kind {spec.kind!r} has no unit")
        return cls(spec.unit, spec.effective_scope, systemctl=systemctl, clock=clock)

    def _shell(self, *args: str) -> str:
        return " ".join(["systemctl", *(["--user"] if self.scope == "user" else []), *args, self.unit])

    @property
    def _journal(self) -> str:
        return f"journalctl {'--user ' if self.scope == 'user' else ''}-u {self.unit} -n 50"

    async def _run(self, *args: str) -> tuple[int, str]:
        argv = [*self.systemctl, *(["--user"] if self.scope == "user" else []), *args, "--", self.unit]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            raise LifecycleError(f"cannot run {self.systemctl[0]}: {exc.strerror or exc}",
                                 fix="this host does not seem to run systemd: use release kind process or docker") from None
        finished, result = await within(self.clock, self.command_timeout_s, proc.communicate())
        if not finished or result is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise LifecycleError(f"`{self._shell(*args)}` did not finish within {self.command_timeout_s:g} s",
                                 fix=f"see why with `{self._journal}`")
        out = result[0].decode("utf-8", "replace")
        return proc.returncode or 0, out

    async def _act(self, verb: str) -> None:
        code, out = await self._run(verb)
        if code != 0:
            self._last = tuple(line for line in out.splitlines() if line.strip())[-20:]
            why = f": {self._last[-1]}" if self._last else ""
            raise LifecycleError(
                f"`{self._shell(verb)}` failed (exit {code}){why}", output=self._last,
                fix=f"see why with `{self._journal}`; the proxy's user needs a polkit rule (or sudoers entry) "
                    f"allowing it to {verb} {self.unit}" if self.scope == "system" else f"see why with `{self._journal}`")
        self._last = ()

    async def start(self) -> None:
        await self._act("start")

    async def stop(self) -> None:
        await self._act("stop")

    async def status(self) -> Status:
        try:
            _, out = await self._run("is-active")
        except LifecycleError:
            return "unknown"
        words = out.split()
        state = words[-1] if words else ""
        return "running" if state in RUNNING else "stopped" if state in STOPPED else "unknown"

    def describe(self) -> JSON:
        return {"kind": self.kind, "unit": self.unit, "scope": self.scope, "output": list(self._last)}

    def output(self) -> tuple[str, ...]:
        return self._last

    def exited(self) -> str | None:
        return None

    async def wait_exit(self) -> Exit | None:
        return None  # no child to wait for: the liveness probe finds a unit or container that ended

    async def clean_up(self) -> list[str]:
        return []  # adopted as it is, never ended

    async def check(self) -> list[str]:
        try:
            _, out = await self._run("show", "--property=LoadState", "--value")
        except LifecycleError as exc:
            return [exc.one_line().removeprefix("error: ")]
        load = out.strip()
        if load == "not-found":
            return [f"unit {self.unit} is not known to systemd ({self.scope} scope) (fix: check the name with "
                    f"`systemctl {'--user ' if self.scope == 'user' else ''}list-unit-files`, or the scope)"]
        if load == "masked":
            return [f"unit {self.unit} is masked, so it cannot be started (fix: `systemctl unmask {self.unit}`)"]
        return []

    async def aclose(self) -> None:
        """Leaves the unit as it is: a unit is the system's, and the next proxy adopts it."""
