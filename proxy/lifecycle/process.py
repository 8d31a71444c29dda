"""A command the proxy runs and owns (release kind `process`), like llama-swap's model servers.

The child runs in a process group of its own (`start_new_session`), so a stop reaches whatever it
spawned (a shell script's server, a worker pool): SIGTERM to the group, SIGKILL after
`stop_timeout_s`, and the child is reaped. stdin is closed; stdout and stderr are read into a ring
of the last lines, shown where a start fails and in the admin API.

The child's environment is the proxy's without its secrets: no `HYPERSWAP_*` variable (the admin
token, the config path), not the variable admin.token_env names, not systemd's CREDENTIALS_DIRECTORY
(where a service's token file would be); the tenant's `env` is applied last and wins (`child_env`).

Only what this controller started is ever signalled. With a state directory it writes a pidfile
(pid, process group, the kernel's start time of the pid) so a proxy restarted after a crash can
name the orphan of its previous run in health; it never kills it (the pid may be someone else's by
then, and a person decides).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from proxy.clock import Clock, SystemClock
from proxy.lifecycle.controller import JSON, LifecycleError, Status, within
from proxy.tenants import DEFAULT_STOP_TIMEOUT_S, ReleaseSpec

SECRET_PREFIX = "HYPERSWAP_"
WITHHELD = frozenset({"CREDENTIALS_DIRECTORY"})  # systemd's folder of the proxy's own credentials
KEEP_LINES = 50
MAX_LINE = 1000  # characters kept of one line (a progress bar can write megabytes without a newline)
READ_CHUNK = 4096


def child_env(base: Mapping[str, str], extra: Mapping[str, str], withheld: Iterable[str] = ()) -> dict[str, str]:
    """A started app's environment: `base` (the proxy's) less the proxy's secrets (every HYPERSWAP_*
    variable, WITHHELD, and `withheld`: the admin token's variable), then `extra` (tenants.json's
    `env`, which wins, even for a name withheld here)."""
    drop = WITHHELD | frozenset(withheld)
    return {**{k: v for k, v in base.items() if not k.startswith(SECRET_PREFIX) and k not in drop}, **extra}


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot; /proc/PID/stat field 22): with the pid
    it names one process for good, whatever later reuses the number. None off Linux or when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def _live_member(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. A zombie (dead, waiting for its new parent to
    reap it) still answers kill(0) but holds no memory: it does not count. True off Linux."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


class ProcessController:
    kind = "process"

    def __init__(self, name: str, command: Sequence[str], *, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
                 clock: Clock | None = None, state_dir: Path | None = None, keep_lines: int = KEEP_LINES,
                 withheld_env: Iterable[str] = ()) -> None:
        if not command:
            raise ValueError("a process needs a command")
        self.name = name
        self.command = tuple(command)
        self.cwd = os.path.expanduser(cwd) if cwd else None
        self.env = dict(env or {})
        self.withheld_env = frozenset(withheld_env)  # besides HYPERSWAP_*: the admin token's variable
        self.stop_timeout_s = stop_timeout_s
        self.clock: Clock = clock or SystemClock()
        self.pidfile = state_dir / f"{name}.process.json" if state_dir else None
        self._lines: deque[str] = deque(maxlen=keep_lines)
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._stopped_by_us = False
        self.orphan: JSON | None = self._find_orphan()

    @classmethod
    def from_spec(cls, name: str, spec: ReleaseSpec, *, clock: Clock | None = None,
                  state_dir: Path | None = None, withheld_env: Iterable[str] = ()) -> ProcessController:
        if spec.command is None:
            raise ValueError(f"tenant {name!r}: release kind {spec.kind!r} has no command")
        return cls(name, spec.command, cwd=spec.cwd, env=spec.env, stop_timeout_s=spec.effective_stop_timeout_s,
                   clock=clock, state_dir=state_dir, withheld_env=withheld_env)

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self._running():
            return
        await self._finish_pump()
        self._lines.clear()
        self._stopped_by_us = False
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, cwd=self.cwd, env=child_env(os.environ, self.env, self.withheld_env),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)
        except OSError as exc:
            raise LifecycleError(f"cannot run {self.command[0]} for tenant {self.name!r}: {exc.strerror or exc}",
                                 fix="check the command in tenants.json (release.command, cwd) and that the "
                                     "proxy's user may run it") from None
        self._proc = proc
        assert proc.stdout is not None
        self._pump = asyncio.create_task(self._read(proc.stdout), name=f"lifecycle-output-{self.name}")
        self._write_pidfile(proc.pid)

    async def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._stopped_by_us = True
        if proc.returncode is None or self._group_alive(proc.pid):
            self._signal(proc.pid, signal.SIGTERM)
            deadline = self.clock.now() + self.stop_timeout_s
            await within(self.clock, self.stop_timeout_s, proc.wait())
            await self._group_gone(proc.pid, deadline)  # what the child spawned had the same SIGTERM
            if proc.returncode is None or self._group_alive(proc.pid):
                self._signal(proc.pid, signal.SIGKILL)
            await proc.wait()  # reap
        await self._finish_pump()
        self._remove_pidfile()

    async def status(self) -> Status:
        if self._running():
            return "running"
        return "unknown" if self.orphan is not None else "stopped"

    def output(self) -> tuple[str, ...]:
        return tuple(self._lines)

    def exited(self) -> str | None:
        proc = self._proc
        if proc is None or proc.returncode is None or self._stopped_by_us:
            return None
        code = proc.returncode
        return f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"

    def describe(self) -> JSON:
        proc = self._proc
        return {"kind": self.kind, "command": list(self.command), "cwd": self.cwd, "pid": self.pid,
                "running": self._running(), "exit_code": None if proc is None else proc.returncode,
                "output": list(self._lines), "orphan": self.orphan}

    async def check(self) -> list[str]:
        self.orphan = self._find_orphan() if not self._running() else self.orphan
        if self.orphan is None:
            return []
        return [f"tenant {self.name!r}: process {self.orphan['pid']} from an earlier run of the proxy still runs "
                f"({' '.join(self.command)}); the proxy did not start it in this run and leaves it alone (fix: "
                f"stop it yourself, `kill {self.orphan['pid']}`, so the proxy can start its own)"]

    async def aclose(self) -> None:
        if self._proc is not None:
            await self.stop()

    # -- the child's group ------------------------------------------------------------------------
    @staticmethod
    def _signal(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or the number is someone else's now
            return False
        return _live_member(pgid)

    async def _group_gone(self, pgid: int, deadline: float) -> None:
        """Wait, polling with a short backoff, until no process of the group is left or the deadline passes."""
        delay = 0.01
        while self._group_alive(pgid) and self.clock.now() < deadline:
            await self.clock.sleep(min(delay, max(0.0, deadline - self.clock.now())))
            delay = min(delay * 2, 0.2)

    # -- output -------------------------------------------------------------------------------------
    def _add(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        text = text.rsplit("\r", 1)[-1] or text  # a progress bar's last state
        self._lines.append(text[:MAX_LINE])

    async def _read(self, stream: asyncio.StreamReader) -> None:
        buf = b""
        while chunk := await stream.read(READ_CHUNK):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self._add(line)
            if len(buf) > READ_CHUNK:
                self._add(buf)
                buf = b""
        if buf:
            self._add(buf)

    async def _finish_pump(self) -> None:
        """Read what is left of the output; a grandchild that keeps the pipe open does not hold us up."""
        pump, self._pump = self._pump, None
        if pump is not None:
            finished, _ = await within(self.clock, 1.0, asyncio.shield(pump))
            if not finished:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    # -- the pidfile: naming an orphan of an earlier run --------------------------------------------
    def _write_pidfile(self, pid: int) -> None:
        if self.pidfile is None:
            return
        with contextlib.suppress(OSError):
            self.pidfile.parent.mkdir(parents=True, exist_ok=True)
            self.pidfile.write_text(json.dumps({"pid": pid, "start_time": _start_time(pid),
                                                "command": list(self.command)}))

    def _remove_pidfile(self) -> None:
        if self.pidfile is not None:
            with contextlib.suppress(OSError):
                self.pidfile.unlink()

    def _find_orphan(self) -> JSON | None:
        """The process an earlier run started and did not stop, if it still runs (same pid, same start time)."""
        if self.pidfile is None:
            return None
        try:
            data = json.loads(self.pidfile.read_text())
            pid, started = int(data["pid"]), data.get("start_time")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if started is None or _start_time(pid) != started:
            return None  # gone, or its number belongs to another process now
        return {"pid": pid, "command": data.get("command")}
