"""A command the proxy runs and owns (release kind `process`), like llama-swap's model servers.

Supervised (design invariant 12):
- The child runs in a session and process group of its own (`start_new_session`), so a stop reaches
  whatever it spawned (a shell script's server, a worker pool): SIGTERM to the group and to every
  descendant found outside it (a `setsid` child, by parent links), SIGKILL after `stop_timeout_s`,
  and a stop is done only once they are gone (and the port is free, else the holder is named).
- Its exit is awaited (`wait_exit`), never inferred from its port: the state machine hears of a crash
  at once, with the exit code.
- It dies with the proxy: the kernel sends it SIGKILL when the proxy dies (PR_SET_PDEATHSIG, set
  between fork and exec), so a proxy killed -9 leaves no app holding the port and the GPU; and what
  it spawned (a shell's server) is ended then by its guard (`guard.py`), a small process started
  beside it that acts when the proxy's end of its pipe closes.
- Its output goes to a file (the state directory's `<tenant>.log`, truncated at each start and
  rotated past `log_max_mib`: `logfile.py`; an unlinked temporary file without a state directory),
  never a pipe: nothing it writes can block or fail because the proxy stopped reading. The last lines
  are read back from the file's tail.
- Ownership: a start fails at once, naming the holder (pid and command), when the port is already
  held; readiness counts only while this child lives and (where /proc tells) the port's holder is
  the app's own: in its tree, or a daemon's child tied to this start (`ownership.py`: started after
  it, and its stop command, pid file or cgroup says so), then recorded and stopped like a descendant.
- A record in this instance's slot of the state directory (pid, start time, command line, boot,
  session and descendants seen; `record.py`: a slot is held by one live proxy, so no other instance
  reads or removes it) lets a restarted proxy end what a crashed run left behind (a grandchild that
  outlived the child) when it is provably that run's: same boot, and pid with start time and command
  line matching, or a member of the recorded session started after it. Anything that matches only in
  part is named in health and never signalled.

A stop command (`stop_command`, llama-swap's cmdStop: `docker stop NAME` for an app run in the
foreground by `docker run`) replaces the signals while the child runs: it runs with the app's cwd and
environment, in a process group of its own, and it and the child's exit share `stop_timeout_s`; a
command that runs over is killed with its whole group. The stop is done only once the child and
what it spawned are gone; when the command cannot run, fails, runs over, or the app outlives it,
the signals follow (SIGTERM, SIGKILL after `stop_timeout_s`) and `stop_error` says why (health
names it until a stop command works).

The child's environment is the proxy's without its secrets: no `HYPERSWAP_*` variable (the admin
token, the config path), not the variable admin.token_env names, not systemd's CREDENTIALS_DIRECTORY
(where a service's token file would be); the tenant's `env` is applied last and wins (`child_env`).
One variable is added, `HYPERSWAP_RUN` (procs.RUN_VAR): a random id of the run, inherited by what it
spawns, so a stop and a restarted proxy find a `setsid` descendant whose parent died (a stop
command gets one of its own: what it leaves is ended once it returns).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from proxy.clock import Clock, SystemClock
from proxy.config.schema import Tenant
from proxy.lifecycle import procs
from proxy.lifecycle.controller import (
    DEFAULT_STOP_TIMEOUT_S,
    JSON,
    ControllerTools,
    Exit,
    LifecycleController,
    LifecycleError,
    Status,
    StoppingRelease,
    shown,
    stop_timeout_field,
)
from proxy.lifecycle.ending import (
    GONE_AFTER_KILL_S,
    StopCommand,
    die_with,
    end_tree,
    exit_of,
    gone,
    signal_all,
    stop_by_command,
)
from proxy.lifecycle.guard import Guard
from proxy.lifecycle.leftovers import leftovers as leftovers_of
from proxy.lifecycle.leftovers import orphan
from proxy.lifecycle.logfile import DEFAULT_MAX_MIB, LogFile
from proxy.lifecycle.ownership import Start, sort_holders
from proxy.lifecycle.ready import probe_for
from proxy.lifecycle.record import Slot

SECRET_PREFIX = "HYPERSWAP_"
WITHHELD = frozenset({"CREDENTIALS_DIRECTORY"})  # systemd's folder of the proxy's own credentials
KEEP_LINES = 50

log = logging.getLogger("hyperswap.lifecycle")


def child_env(base: Mapping[str, str], extra: Mapping[str, str], withheld: Iterable[str] = ()) -> dict[str, str]:
    """A started app's environment: `base` (the proxy's) less the proxy's secrets (every HYPERSWAP_*
    variable, WITHHELD, and `withheld`: the admin token's variable), then `extra` (tenants.json's
    `env`, which wins, even for a name withheld here)."""
    drop = WITHHELD | frozenset(withheld)
    return {**{k: v for k, v in base.items() if not k.startswith(SECRET_PREFIX) and k not in drop}, **extra}


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot; /proc/PID/stat field 22): with the pid
    it names one process for good, whatever later reuses the number. None off Linux or when gone."""
    return procs.start_time(pid)


class ProcessController:
    kind = "process"

    def __init__(self, name: str, command: Sequence[str], *, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
                 clock: Clock | None = None, state_dir: Path | None = None, keep_lines: int = KEEP_LINES,
                 host: str | None = None, port: int | None = None, withheld_env: Iterable[str] = (),
                 stop_command: Sequence[str] | None = None, pid_file: str | None = None,
                 log_max_mib: float = DEFAULT_MAX_MIB) -> None:
        if not command:
            raise ValueError("a process needs a command")
        self.name = name
        self.command = tuple(command)
        self.stop_command = tuple(stop_command) if stop_command else None
        self.stop_error: str | None = None  # why the last stop command did not stop the app (the signals did)
        self.pid_file = Path(os.path.expanduser(pid_file)) if pid_file else None
        self._this_start: Start | None = None  # what ties a port's holder to the last start (ownership.py)
        self.holders: dict[int, str] = {}  # port holders outside the tree taken as the app's, and why
        self.cwd = os.path.expanduser(cwd) if cwd else None
        self.env = dict(env or {})
        self.withheld_env = frozenset(withheld_env)  # besides HYPERSWAP_*: the admin token's variable
        self.stop_timeout_s = stop_timeout_s
        self.clock: Clock = clock or SystemClock()
        self.keep_lines = keep_lines
        self.host, self.port = host, port  # the upstream it serves on: checked before a start and after ready
        self.hide: str | None = None  # output lines holding this (the ready probe's requests) are left out
        self.slot = Slot(state_dir, name) if state_dir else None  # this instance's record and log (record.py)
        self.followers = 0  # log streams following its output now (logs.py bounds them)
        self.guard = Guard(self.clock)  # ends what the run spawned should the proxy die (guard.py)
        self.logfile = LogFile(name, lambda: self.log_path, int(log_max_mib * 2**20), self.clock)  # logfile.py
        self._proc: asyncio.subprocess.Process | None = None
        self._started: int | None = None  # the child's start time
        self._seen: dict[int, int] = {}  # descendants seen (pid -> start time): stopped with the child
        self._marker = ""  # the run's id in its environment (procs.RUN_VAR): what it spawned carries it
        self._stopped_by_us = False
        self.orphan: JSON | None = self._find_orphan()

    @classmethod
    def from_spec(cls, name: str, spec: ProcessRelease, *, clock: Clock | None = None,
                  state_dir: Path | None = None, host: str | None = None,
                  port: int | None = None, withheld_env: Iterable[str] = ()) -> ProcessController:
        if spec.command is None:
            raise ValueError(f"tenant {name!r}: release kind {spec.kind!r} has no command")
        return cls(name, spec.command, cwd=spec.cwd, env=spec.env, stop_timeout_s=spec.effective_stop_timeout_s,
                   clock=clock, state_dir=state_dir, host=host, port=port, withheld_env=withheld_env,
                   stop_command=spec.stop_command, pid_file=spec.pid_file, log_max_mib=spec.log_max_mib)

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def pidfile(self) -> Path | None:
        """The record of this instance's run (None: no state directory, or no slot in it)."""
        return self.slot.record_path if self.slot is not None else None

    @property
    def log_path(self) -> Path | None:
        return self.slot.log_path if self.slot is not None else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self._running():
            return
        await self.clean_up()
        if self.orphan is not None:
            raise LifecycleError(
                f"process {self.orphan['pid']} from an earlier run of the proxy still runs, and the proxy cannot "
                f"prove it is its own app (its record does not match in full): it does not start a second copy",
                fix=f"stop it yourself (`kill {self.orphan['pid']}`), then start {self.name} again")
        port_free = True
        if self.port is not None and self.host is not None:
            use = await asyncio.to_thread(procs.port_use, self.host, self.port)
            port_free = not use.listening
            stranger = use.stranger() or ("a process the proxy cannot see (another user's)" if use.listening else None)
            if stranger is not None:
                raise LifecycleError(
                    f"port {self.port} is already in use by {stranger}, before {self.name} was started: requests "
                    f"would reach it instead of the app",
                    fix=f"stop what holds port {self.port}"
                        + (f" (`kill {use.others[0]}`)" if use.others else " (`ss -ltnp`)")
                        + f", or give tenant {self.name!r} a free port (its upstream and its command)")
        self._stopped_by_us = False
        self._seen.clear()
        self._marker = marker = secrets.token_hex(8)
        log = self.logfile.open_run()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, cwd=self.cwd, env={**child_env(os.environ, self.env, self.withheld_env),
                                                  procs.RUN_VAR: marker},
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                preexec_fn=die_with(os.getpid()))
        except OSError as exc:
            raise LifecycleError(f"cannot run {self.command[0]} for tenant {self.name!r}: {exc.strerror or exc}",
                                 fix="check the command in tenants.json (release.command, cwd) and that the "
                                     "proxy's user may run it") from None
        self._proc = proc
        self._started = procs.start_time(proc.pid)
        self.holders = {}
        self._this_start = Start(self._started or 0, port_free, self.stop_command is not None, self.pid_file)
        self._write_record()
        if self._started is not None:  # where /proc tells who is whose (guard.py)
            await self.guard.arm(marker, proc.pid, self._started, self.stop_timeout_s)

    async def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._stopped_by_us = True
        members = await asyncio.to_thread(self._tree)
        if members and self.stop_command is not None and proc.returncode is None:
            if await self._stop_by_command(proc, members):
                members = {}  # gone: confirmed by the child's exit and its tree's
            else:
                log.warning("%s: %s; stopping it with signals", self.name, self.stop_error)
                members = await asyncio.to_thread(self._tree)
        if members and (still := await end_tree(proc, members, self.clock, self.stop_timeout_s)):
            raise LifecycleError(f"{', '.join(procs.describe(p) for p in still)} still runs after SIGKILL",
                                 fix="it may be stuck in the kernel (a GPU driver call): see `ps -o stat,wchan "
                                     f"-p {still[0]}`; a reboot frees it if nothing else does")
        if proc.returncode is None:  # off Linux, where no tree is read
            proc.kill()
            await proc.wait()
        self._remove_pidfile()
        await self.guard.release()  # all of it is gone: nothing for the guard to end should the proxy die
        if self.port is not None and self.host is not None:
            use = await asyncio.to_thread(procs.port_use, self.host, self.port)
            if use.others:
                raise LifecycleError(
                    f"{self.name} stopped, but port {self.port} is still held by {use.stranger()}: a process it "
                    f"started that left its session, or another program",
                    fix=f"stop it (`kill {use.others[0]}`); the proxy signals only what it can prove is the app's")

    async def _stop_by_command(self, proc: asyncio.subprocess.Process, members: Mapping[int, int]) -> bool:
        """Run the stop command (`ending.stop_by_command`); True once the child and what it spawned are
        gone within stop_timeout_s, else False with `stop_error` saying why the signals must follow."""
        assert self.stop_command is not None
        stop = StopCommand(self.stop_command, self.cwd, child_env(os.environ, self.env, self.withheld_env),
                           f"{self._marker}-stop", self.stop_timeout_s)
        self.stop_error = await stop_by_command(stop, proc, members, self.clock)
        return self.stop_error is None

    async def status(self) -> Status:
        if self._running():
            return "running"
        return "unknown" if self.orphan is not None else "stopped"

    def output(self) -> tuple[str, ...]:
        return self.logfile.lines(self.keep_lines, self.hide)

    def exited(self) -> str | None:
        proc = self._proc
        if proc is None or proc.returncode is None or self._stopped_by_us:
            return None
        return exit_of(proc.returncode).reason

    async def wait_exit(self) -> Exit | None:
        proc = self._proc
        if proc is None:
            return None
        code = await proc.wait()
        return None if self._stopped_by_us or proc is not self._proc else exit_of(code)

    def alive(self) -> bool:
        """The child the proxy started runs now."""
        return self._running()

    async def owns_port(self) -> str | None:
        """Why the ready port is not this app's (the child ended, or another process holds the port),
        else None. Reads the child's own sockets first (a few reads); the whole tree only when needed."""
        if not self._running():
            return f"the app the proxy started has ended ({self.exited() or 'stopped'})"
        if self.port is None or self.host is None:
            return None
        use = await asyncio.to_thread(procs.port_use, self.host, self.port, [self.pid] if self.pid else [])
        if use.others:
            tree = await asyncio.to_thread(self._tree)
            use = await asyncio.to_thread(procs.port_use, self.host, self.port, tree)
            if use.others and self._this_start is not None:
                ours, strangers = await asyncio.to_thread(sort_holders, use.others, self._this_start, tree)
                self._take(ours)
                use = procs.PortUse(True, tuple(ours), tuple(strangers))
        if use.ours or not use.listening or not use.others:
            return None  # ours, or nothing this reader can see (another network namespace, another host)
        return (f"port {self.port} answers, but it is held by {use.stranger()}, not by the app the proxy "
                f"started (pid {self.pid})")

    def describe(self) -> JSON:
        proc = self._proc
        return shown(LifecycleController(
            kind="process", command=list(self.command), cwd=self.cwd, pid=self.pid,
            stop_command=list(self.stop_command) if self.stop_command else None, stop_error=self.stop_error,
            running=self._running(), exit_code=None if proc is None else proc.returncode,
            output=list(self.output()), orphan=self.orphan,
            holders={str(pid): why for pid, why in self.holders.items()} or None,
            log=str(self.log_path) if self.log_path is not None else None))

    def summary(self) -> str:
        return "process: " + " ".join(self.command)[:120]

    def output_elsewhere(self) -> tuple[str, str] | None:
        return None

    async def check(self) -> list[str]:
        self.orphan = self._find_orphan() if not self._running() else self.orphan
        problems = []
        if self.stop_error is not None:
            problems.append(f"tenant {self.name!r}: {self.stop_error}, so the proxy stopped it with signals (fix: run "
                            f"`{' '.join(self.stop_command or ())}` by hand while it runs and see why; release."
                            f"stop_command in tenants.json, or stop_timeout_s if it only needs longer)")
        if self.orphan is None:
            return problems
        return [*problems, f"tenant {self.name!r}: process {self.orphan['pid']} from an earlier run of the proxy still runs "
                f"({' '.join(self.command)}); its record does not match it in full, so the proxy leaves it alone "
                f"and does not start a second copy (fix: stop it yourself, `kill {self.orphan['pid']}`, so the "
                f"proxy can start its own)"]

    async def clean_up(self) -> list[str]:
        """End what an earlier run left behind when the record proves it is that run's; see the module doc."""
        if self._proc is not None or self.pidfile is None:
            return []
        record = self._read_record()
        if record is None:
            return []
        leftovers = await asyncio.to_thread(leftovers_of, record)
        if leftovers is None:  # something runs that matches only in part: named, never signalled
            self.orphan = self._find_orphan()
            return []
        if leftovers:
            signal_all(self._proc, leftovers, signal.SIGTERM)
            await gone(self.clock, leftovers, self.clock.now() + self.stop_timeout_s)
            left = {pid: t for pid, t in leftovers.items() if procs.same(pid, t)}
            signal_all(self._proc, left, signal.SIGKILL)
            await gone(self.clock, left, self.clock.now() + GONE_AFTER_KILL_S)
        self._remove_pidfile()
        self.orphan = None
        return [procs.describe(pid) for pid in leftovers]  # described after: the numbers, for the log

    async def aclose(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(LifecycleError):
                await self.stop()
        await self.guard.release()  # an orderly shutdown: what a failed stop left is in the record
        self.logfile.close()
        if self.slot is not None:
            self.slot.release()

    # -- the child's tree -------------------------------------------------------------------------
    def _tree(self) -> dict[int, int]:
        """The child (while it runs), its session and its descendants now, plus those seen before that
        still run: pid -> start time. Notes the new ones in the record, so a stop and a restarted proxy
        find them even after they left the session."""
        proc = self._proc
        if proc is None or self._started is None:
            return {}
        known = [*self._seen.items(), *procs.marked(self._marker, self._started).items()]
        members = procs.tree(proc.pid if proc.returncode is None else None, proc.pid, known, since=self._started)
        new = {pid: t for pid, t in members.items() if pid != proc.pid and self._seen.get(pid) != t}
        if new:
            self._seen.update(new)
            self._write_record()
        return members

    def _take(self, holders: Mapping[int, str]) -> None:
        """Port holders tied to this start (ownership.py): the app's own from now on, stopped with it and
        named in the record like a descendant."""
        new = {pid: t for pid in holders if pid not in self._seen and (t := procs.start_time(pid)) is not None}
        for pid in new:
            log.info("%s: port %s is held by %s, the app's own: %s", self.name, self.port, procs.describe(pid),
                     holders[pid])
        self.holders.update(holders)
        if new:
            self._seen.update(new)
            self._write_record()

    # -- output ---------------------------------------------------------------------------------------
    @property
    def log_run(self) -> int:
        """Counts the output files opened (one per start): a follower sees a new run by it."""
        return self.logfile.run

    def open_log(self) -> tuple[int, int] | None:
        """A descriptor of its own onto the current run's output file, and the run's number (`log_run`),
        for a follower (GET /api/tenants/{name}/logs) to read and close; None before the first start."""
        return self.logfile.dup()

    # -- the record: what a restarted proxy finds again -------------------------------------------
    def _write_record(self) -> None:
        proc = self._proc
        if self.pidfile is None or proc is None:
            return
        assert self.slot is not None
        self.slot.write({"pid": proc.pid, "start_time": self._started, "command": list(self.command),
                         "cmdline": list(procs.cmdline(proc.pid) or ()), "boot_id": procs.boot_id(),
                         "marker": self._marker,
                         "descendants": [[pid, t] for pid, t in self._seen.items()]})

    def _read_record(self) -> JSON | None:
        return self.slot.read() if self.slot is not None else None

    def _remove_pidfile(self) -> None:
        if self.slot is not None:
            self.slot.remove()

    def _find_orphan(self) -> JSON | None:
        """The process an earlier run started and did not stop, if it still runs (`leftovers.orphan`)."""
        return orphan(self._read_record())


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ProcessRelease(StoppingRelease):
    """Release kind `process`: a command the proxy runs and owns, stopped by signals (or its stop command)."""

    kind: Literal["process"] = "process"
    command: list[str] | None = Field(default=None, validate_default=True,
                                      description="kind process: the command the proxy runs and owns, argv style")
    stop_command: list[str] | None = Field(
        default=None, description="kind process: a command run to stop the app instead of signals, argv style (like "
        "llama-swap's cmdStop: [\"docker\", \"stop\", \"tts\"]); it and the app's exit share stop_timeout_s, it "
        "is killed with its process group when it runs over, and SIGTERM then SIGKILL follow when it fails or the "
        "app still runs")
    pid_file: str | None = Field(
        default=None, description="kind process: a file the launcher writes the server's pid to, for an app a "
        "daemon runs (its server is not the command's child): a port holder it names, started after the start, "
        "is the app's own (see the lifecycle guide's ownership rule)")
    log_max_mib: float = Field(
        default=DEFAULT_MAX_MIB, gt=0, le=1024 * 1024, description="kind process: its log file (`<tenant>.log` in the "
        "state directory) is rotated past this many MiB: its content moves to `<tenant>.log.1` (the one before is "
        "dropped), so at most twice this is on disk, plus what the app writes in a quarter second")
    cwd: str | None = Field(default=None, description="kind process: its working directory (absolute)")
    env: dict[str, str] | None = Field(default=None, description="kind process: added to the proxy's environment")
    stop_timeout_s: float | None = stop_timeout_field()

    @field_validator("command")
    @classmethod
    def _needs_command(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            raise ValueError("release kind 'process' needs 'command'")
        return value

    @field_validator("command", "stop_command")
    @classmethod
    def _argv(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value or not value[0]:
            raise ValueError("expected the program and its arguments, like [\"llama-server\", \"--port\", \"8081\"]")
        if any("\0" in arg for arg in value):
            raise ValueError("an argument contains a NUL character")
        if "/" in value[0] and not value[0].startswith("/"):
            raise ValueError(f"{value[0]!r}: give the program as an absolute path or a bare name found on PATH")
        return value

    @field_validator("cwd", "pid_file")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith(("/", "~")) or "\0" in value):
            raise ValueError(f"expected an absolute path, got {value!r}")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, inner in (value or {}).items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not an environment variable name (letters, digits, '_')")
            if "\0" in inner:
                raise ValueError(f"{key!r}: the value contains a NUL character")
        return value

    @property
    def effective_stop_timeout_s(self) -> float:
        return DEFAULT_STOP_TIMEOUT_S if self.stop_timeout_s is None else self.stop_timeout_s

    def controller(self, tenant: Tenant, tools: ControllerTools) -> ProcessController:
        probe = probe_for(tenant, None)
        return ProcessController.from_spec(tenant.name, self, clock=tools.clock, state_dir=tools.state_dir,
                                           host=probe.host, port=probe.port, withheld_env=tools.withheld_env)

    def load_problems(self, where: str, env: Mapping[str, str]) -> list[str]:
        """The programs exist and are executable (an absolute path, or a bare name on the PATH the
        child gets: its `env`'s PATH, else the proxy's), and the working directory exists, so a start
        never fails for it later."""
        problems: list[str] = []
        search = (self.env or {}).get("PATH", env.get("PATH", os.defpath))
        for field, argv in (("command", self.command), ("stop_command", self.stop_command)):
            if not argv:
                continue
            program = argv[0]
            if program.startswith("/"):
                if not os.path.isfile(program):
                    problems.append(f"{where}.{field}.0: {program} does not exist (or is not a file)")
                elif not os.access(program, os.X_OK):
                    problems.append(f"{where}.{field}.0: {program} is not executable (chmod +x, or run it "
                                    "through its interpreter)")
            elif shutil.which(program, path=search) is None:
                problems.append(f"{where}.{field}.0: {program!r} is not found on PATH ({search}): install it, "
                                "give its absolute path, or set PATH in release.env")
        if self.cwd is not None and not os.path.isdir(os.path.expanduser(self.cwd)):
            problems.append(f"{where}.cwd: {self.cwd} is not a directory")
        return problems
