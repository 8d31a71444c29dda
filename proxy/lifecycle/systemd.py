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

Every `systemctl` is bounded: a start by the tenant's `start_timeout_s`, a stop by its release
timeout, a status or check by STATUS_TIMEOUT_S. It runs in a process group of its own, killed
whole (SIGKILL) when it runs over or its caller gives up (a health check's timeout), so none is left
behind; the error says which command hung and for how long.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from proxy.clock import Clock, SystemClock
from proxy.config.schema import Tenant
from proxy.lifecycle.controller import (
    JSON,
    ControllerTools,
    Exit,
    LifecycleController,
    LifecycleError,
    Status,
    StoppingRelease,
    shown,
    within,
)

COMMAND_TIMEOUT_S = 120.0  # systemctl waits for the unit's job; the unit's own TimeoutStartSec/TimeoutStopSec bound it
STATUS_TIMEOUT_S = 10.0  # is-active, show: systemd answers these at once
REAP_TIMEOUT_S = 2.0  # after SIGKILL to its group: a systemctl that still is not gone is not waited for
RUNNING = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})  # holds its memory still
STOPPED = frozenset({"inactive", "failed"})


class SystemdController:
    kind = "systemd"

    def __init__(self, unit: str, scope: Literal["system", "user"] = "system", *,
                 systemctl: str | Sequence[str] = "systemctl", command_timeout_s: float = COMMAND_TIMEOUT_S,
                 start_timeout_s: float | None = None, stop_timeout_s: float | None = None,
                 status_timeout_s: float | None = None, clock: Clock | None = None) -> None:
        self.unit = unit
        self.scope = scope
        self.systemctl = (systemctl,) if isinstance(systemctl, str) else tuple(systemctl)
        self.command_timeout_s = command_timeout_s
        self.timeouts = {"start": start_timeout_s or command_timeout_s, "stop": stop_timeout_s or command_timeout_s}
        self.status_timeout_s = min(status_timeout_s or STATUS_TIMEOUT_S, command_timeout_s)
        self.clock: Clock = clock or SystemClock()
        self._last: tuple[str, ...] = ()  # the last failing command's output
        self._error: str | None = None  # the last failed command, in words

    @classmethod
    def from_spec(cls, spec: SystemdRelease, *, systemctl: str | Sequence[str] = "systemctl", clock: Clock | None = None,
                  start_timeout_s: float | None = None, stop_timeout_s: float | None = None) -> SystemdController:
        """`start_timeout_s`: the tenant's (a start is never waited for longer); `stop_timeout_s`: the
        release step's timeout (the card must show the memory back within it anyway)."""
        if spec.unit is None:
            raise ValueError(f"release kind {spec.kind!r} has no unit")
        return cls(spec.unit, spec.effective_scope, systemctl=systemctl, clock=clock, start_timeout_s=start_timeout_s,
                   stop_timeout_s=stop_timeout_s)

    def _shell(self, *args: str) -> str:
        return " ".join(["systemctl", *(["--user"] if self.scope == "user" else []), *args, self.unit])

    @property
    def _journal(self) -> str:
        return f"journalctl {'--user ' if self.scope == 'user' else ''}-u {self.unit} -n 50"

    async def _run(self, *args: str, timeout_s: float | None = None) -> tuple[int, str]:
        """Run one systemctl for at most `timeout_s`: (exit code, output). Raises LifecycleError when it
        cannot run or runs over; whatever happens, its whole process group is gone when this returns."""
        timeout_s = self.command_timeout_s if timeout_s is None else timeout_s
        argv = [*self.systemctl, *(["--user"] if self.scope == "user" else []), *args, "--", self.unit]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                        start_new_session=True)
        except OSError as exc:
            raise LifecycleError(f"cannot run {self.systemctl[0]}: {exc.strerror or exc}",
                                 fix="this host does not seem to run systemd: use release kind process or docker") from None
        try:
            finished, result = await within(self.clock, timeout_s, proc.communicate())
        finally:  # ran over, or the caller gave up (cancelled): nothing of it may stay behind
            if proc.returncode is None:
                await self._kill(proc)
        if not finished or result is None:
            self._error = f"`{self._shell(*args)}` did not finish within {timeout_s:g} s and was killed"
            raise LifecycleError(self._error, fix=f"see why with `{self._journal}` and `systemctl "
                                                  f"{'--user ' if self.scope == 'user' else ''}list-jobs`")
        out = result[0].decode("utf-8", "replace")
        return proc.returncode or 0, out

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its group: a wrapper script's children too
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(within(self.clock, REAP_TIMEOUT_S, proc.wait()))

    async def _act(self, verb: str) -> None:
        code, out = await self._run(verb, timeout_s=self.timeouts[verb])
        if code != 0:
            self._last = tuple(line for line in out.splitlines() if line.strip())[-20:]
            why = f": {self._last[-1]}" if self._last else ""
            self._error = f"`{self._shell(verb)}` failed (exit {code}){why}"
            raise LifecycleError(
                self._error, output=self._last,
                fix=f"see why with `{self._journal}`; the proxy's user needs a polkit rule (or sudoers entry) "
                    f"allowing it to {verb} {self.unit}" if self.scope == "system" else f"see why with `{self._journal}`")
        self._last = ()
        self._error = None

    async def start(self) -> None:
        await self._act("start")

    async def stop(self) -> None:
        await self._act("stop")

    async def status(self) -> Status:
        try:
            _, out = await self._run("is-active", timeout_s=self.status_timeout_s)
        except LifecycleError:
            return "unknown"
        words = out.split()
        state = words[-1] if words else ""
        return "running" if state in RUNNING else "stopped" if state in STOPPED else "unknown"

    def describe(self) -> JSON:
        return shown(LifecycleController(kind="systemd", unit=self.unit, scope=self.scope, output=list(self._last),
                                         error=self._error))

    def summary(self) -> str:
        return f"systemd {self.scope} unit {self.unit}"

    def output_elsewhere(self) -> tuple[str, str] | None:
        return "systemd unit", "`journalctl -f -u <unit>`"

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
            _, out = await self._run("show", "--property=LoadState", "--value", timeout_s=self.status_timeout_s)
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


# systemd unit names (systemd.unit(5)): no leading '-', so a name can never read as an option.
UNIT_NAME = re.compile(r"[A-Za-z0-9_:.\\@][A-Za-z0-9_:.\\@-]{0,254}")


class SystemdRelease(StoppingRelease):
    """Release kind `systemd`: a unit stopped and started through `systemctl`."""

    kind: Literal["systemd"] = "systemd"
    unit: str | None = Field(default=None, validate_default=True, description="kind systemd: the unit, like comfyui.service")
    scope: Literal["system", "user"] | None = Field(
        default=None, description="kind systemd: the system manager (default) or the user's (`systemctl --user`)")

    @field_validator("unit")
    @classmethod
    def _unit(cls, value: str | None) -> str | None:
        if value is None:
            raise ValueError("release kind 'systemd' needs 'unit'")
        if not UNIT_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a systemd unit name (like comfyui.service)")
        return value

    @property
    def effective_scope(self) -> Literal["system", "user"]:
        return self.scope or "system"

    def controller(self, tenant: Tenant, tools: ControllerTools) -> SystemdController:
        return SystemdController.from_spec(self, systemctl=tools.systemctl, clock=tools.clock,
                                           start_timeout_s=tenant.start_timeout_s,
                                           stop_timeout_s=self.timeout_s or tenant.release_timeout_s)
