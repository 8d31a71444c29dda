"""What every lifecycle controller offers: start, stop and status of one app tenants.json names.

Each release kind that stops the app (`StoppingRelease`: process, systemd, docker) builds its own
controller. A controller is the edge where the effect happens (a child process, `systemctl`, the Docker Engine
API); it knows nothing of requests, memory or busy state. The state machine (`state.py`) decides
when to call it, and the scheduler starts those calls as tasks that report back, never awaiting one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import httpx
from pydantic import Field

from proxy.clock import Clock
from proxy.config.schema import ReleaseFailed, ReleaseSpec, Tenant
from proxy.encoding import JSONModel
from proxy.errors import HyperSwapError

Status = Literal["running", "stopped", "unknown"]
JSON = dict[str, object]
T = TypeVar("T")



class LifecycleController(JSONModel):
    """What a lifecycle tenant's controller runs or reaches (the fields of its kind only)."""
    kind: Literal["process", "systemd", "docker"]
    command: list[str] | None = Field(default=None, description="process: the command the proxy runs, argv style")
    cwd: str | None = Field(default=None, description="process: its working directory (null: the proxy's)")
    holders: dict[str, str] | None = Field(default=None, description="process: port holders outside its process tree "
                                                                     "taken as the app's own (a daemon's child), pid -> "
                                                                     "why; null: none")
    pid: int | None = Field(default=None, description="process: the child's pid while it runs")
    running: bool | None = Field(default=None, description="process: the child the proxy started runs now")
    exit_code: int | None = Field(default=None, description="process: how the last child ended (null: runs, or none)")
    orphan: dict[str, object] | None = Field(default=None, description="process: a child of an earlier run of the proxy "
                                             "that still runs (pid, pgid); named in health, never killed")
    unit: str | None = Field(default=None, description="systemd: the unit")
    scope: Literal["system", "user"] | None = Field(default=None, description="systemd: the manager it is reached in")
    container: str | None = Field(default=None, description="docker: container name or id")
    socket: str | None = Field(default=None, description="docker: the Engine API's Unix socket")
    error: str | None = Field(default=None, description="docker: the last call's error (null: it worked)")
    stop_command: list[str] | None = Field(default=None, description="process: the command run to stop it instead "
                                                                    "of signals (null: signals)")
    stop_error: str | None = Field(default=None, description="process: why the last stop command did not stop it "
                                                             "(the signals did); null: it worked, or none ran")
    output: list[str] | None = Field(default=None, description="process: its last output lines; systemd: the last "
                                                               "systemctl call's")
    log: str | None = Field(default=None, description="process: the file its output goes to (in the state directory; "
                                                      "null: a temporary file); started afresh with each start")


def shown(view: LifecycleController) -> JSON:
    """A controller's `describe()`: the fields its kind set, as JSON."""
    return view.model_dump(mode="json", exclude_unset=True)


class LifecycleError(HyperSwapError):
    """A start, stop or status that failed: the message, a fix, and the app's last output lines."""

    status = 503

    def __init__(self, message: str, *, fix: str | None = None, output: Sequence[str] = ()) -> None:
        super().__init__(message, fix=fix, details={"output": list(output)} if output else None)
        self.output = tuple(output)


@dataclass(frozen=True, slots=True)
class Exit:
    """How an app the proxy started ended on its own (not by the proxy's stop)."""

    code: int | None  # its exit status; negative: the signal that killed it; None: not known
    reason: str  # "exited with code 3", "killed by signal 9 (SIGKILL)"

    @property
    def failed(self) -> bool:
        """Anything but a clean exit (code 0) is a failure: what a restart policy `on-failure` restarts."""
        return self.code != 0


class Controller(Protocol):
    """Starts and stops one app. Every method is safe to call in any state (start when running and
    stop when stopped do nothing); the caller serialises start against stop (`TenantLifecycle`)."""

    kind: str

    async def start(self) -> None:
        """Start the app (returns once it is launched, not once it is ready). Raises LifecycleError."""

    async def stop(self) -> None:
        """Stop the app and return once it is gone. Raises LifecycleError."""

    async def status(self) -> Status:
        """Whether the app runs now; `unknown` when it cannot be told (never raises)."""

    def describe(self) -> JSON:
        """What it controls and its state, JSON-ready, for the admin API and health: a
        `LifecycleController` with the fields of its kind set, dumped (`shown`)."""

    def summary(self) -> str:
        """What it controls in a few words, for health: `process: llama-server -m q.gguf`."""

    def output_elsewhere(self) -> tuple[str, str] | None:
        """Where the app's output is kept when it is not the proxy's to stream: (what runs it, like
        "systemd unit", and how to follow it, like "`journalctl -f -u <unit>`"); None: the proxy's own."""

    def output(self) -> tuple[str, ...]:
        """The app's last output lines, oldest first (only a process the proxy runs has them)."""

    def exited(self) -> str | None:
        """Why the app ended, when the controller knows without any I/O (a child that exited); else None."""

    async def wait_exit(self) -> Exit | None:
        """Return when the app this controller started ends on its own (a crash, an OOM kill, an exit),
        with how; None when it was stopped by the proxy, nothing runs, or the controller cannot tell
        (units and containers: their end is found by the liveness probe instead)."""

    async def clean_up(self) -> list[str]:
        """At the proxy's start: end what an earlier run of the proxy started and left behind, where it
        is provably that run's (pid, start time and command line match its record). Returns what was
        ended, for the log; units and containers are adopted instead (empty)."""

    async def check(self) -> list[str]:
        """Problems found without changing anything (an unknown unit, no such container, an unreachable
        socket, an orphan of an earlier run), each with its fix; empty when all is well."""

    async def aclose(self) -> None:
        """At the proxy's shutdown: stop what this controller itself started (a child process);
        units and containers keep running and are adopted by the next proxy."""


async def within(clock: Clock, timeout_s: float, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
    """Await `awaitable` for at most `timeout_s` on the injected clock: (finished, its result).
    When the time runs out first the awaitable is cancelled."""
    task = asyncio.ensure_future(awaitable)
    sleeper = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        await asyncio.wait({task, sleeper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


# ---------------------------------------------------------------------------------------------
# The release kinds that stop the app (process, systemd, docker): each builds its own controller.

DEFAULT_STOP_TIMEOUT_S = 10.0  # process: SIGTERM, then SIGKILL after this; docker: `stop?t=`


def stop_timeout_field() -> Any:
    """`stop_timeout_s` of the kinds that stop an app by signals (process, docker): one meaning."""
    return Field(default=None, description=f"kinds process and docker: SIGTERM, then SIGKILL after this long "
                                           f"(default {DEFAULT_STOP_TIMEOUT_S:g})")


@dataclass(frozen=True, slots=True)
class ControllerTools:
    """What the proxy hands a kind to build its controller with (tests swap the edges)."""

    clock: Clock
    state_dir: Path | None = None  # where a process tenant's pidfile lives (build.default_state_dir)
    systemctl: str | Sequence[str] = "systemctl"
    docker_transport: httpx.AsyncBaseTransport | None = None
    withheld_env: Iterable[str] = ()  # variables a started process never inherits besides HYPERSWAP_*


class StoppingRelease(ReleaseSpec):
    """A release kind that gives the memory back by stopping the app, and starts it again when a
    request arrives for it: it builds the controller that does both."""

    stops: ClassVar[bool] = True

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        raise ReleaseFailed(f"tenant {tenant.name!r} is released by stopping it (kind {self.kind!r}): its lifecycle "
                            "controller (proxy/lifecycle/) does that, not an HTTP call")

    def controller(self, tenant: Tenant, tools: ControllerTools) -> Controller:
        raise NotImplementedError(f"release kind {self.kind!r} stops the app but builds no controller")
