"""`hyperswap install` / `uninstall`: the proxy on the engines' own ports, the engines moved behind it.

Clients change nothing: HyperSwap takes each engine's port (Ollama's 11434, ComfyUI's 8188) and the
engine moves to the port the proxy used to listen on (11435, 8189): the two swap. What moves an
engine is its adapter's (`EngineAdapter.relocation`): a systemd drop-in for a service the engine
ships (ollama.service: `OLLAMA_HOST`), else a line to start it by hand (ComfyUI's `--port`).

Decisions first, as data: `plan_install` and `plan_uninstall` return every file to write and every
command to run; `--dry-run` prints the plan, `apply` carries it out through two small interfaces
(`Files`, rooted at a prefix the tests point at a temp dir, and `Runner`, systemctl). What install
wrote is recorded (each file's previous text and the hash of what was written), so uninstall puts
back exactly what was there, and refuses a file someone changed since (unless `--force`).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TextIO
from urllib.parse import urlsplit

from pydantic import BaseModel

from proxy.config.registry import Registry
from proxy.deploy.ports import Holders, PortHolder
from proxy.deploy.units import DROP_IN_NAME, UNIT_NAME, Mode, render_drop_in, render_unit
from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.engines.ports import Relocation
from proxy.errors import HyperSwapError
from proxy.gpu.attribution import Attributor
from proxy.gpu.snapshot import GpuProcess
from proxy.hosts import is_loopback_host

RECORD_VERSION = 1


class RecordedFile(BaseModel):
    path: str
    previous: str | None  # its text before install; None: install created it
    written_sha256: str


class RecordedMove(BaseModel):
    tenant: str
    proxy_listen: str | None = None
    engine_port: int | None = None
    previous_listen: str | None = None
    previous_upstream: str | None = None
    by_hand: str | None = None  # how the engine was moved by hand (uninstall says to undo it)


class InstallRecord(BaseModel):
    """What install keeps for uninstall (the record file): each file it wrote with what was there
    before, the services it restarted, the engines it moved. Read back leniently: an older record
    may lack what later versions add."""

    version: int = RECORD_VERSION
    mode: str = ""
    unit: str = UNIT_NAME
    services: list[str] = []
    files: list[RecordedFile]
    moves: list[RecordedMove] = []
    created_dirs: list[str] = []


# -- where things go ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Layout:
    mode: Mode
    unit: str  # absolute paths on the target system (the root prefix is the Files' business)
    config: str
    config_in_unit: str  # the same file as the unit names it (%h for a user unit)
    record: str
    systemctl: tuple[str, ...]
    drop_ins: bool  # whether engines' services get a drop-in written (a system install: root's to write)

    def drop_in(self, service: str) -> str:
        return f"/etc/systemd/system/{service}.d/{DROP_IN_NAME}"


def layout(mode: Mode, home: str) -> Layout:
    if mode == "system":
        return Layout("system", f"/etc/systemd/system/{UNIT_NAME}", "/etc/hyperswap/tenants.json",
                      "/etc/hyperswap/tenants.json", "/var/lib/hyperswap/install.json", ("systemctl",), True)
    return Layout("user", f"{home}/.config/systemd/user/{UNIT_NAME}", f"{home}/.config/hyperswap/tenants.json",
                  "%h/.config/hyperswap/tenants.json", f"{home}/.local/state/hyperswap/install.json",
                  ("systemctl", "--user"), False)


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Move:
    """A tenant whose proxy takes the engine's port, and where the engine goes."""

    tenant: str
    proxy_listen: str  # host:port the proxy will listen on (the engine's port)
    engine_port: int  # where the engine will listen, on 127.0.0.1
    previous_listen: str
    previous_upstream: str
    relocation: Relocation

    @property
    def proxy_port(self) -> int:
        return int(self.proxy_listen.rpartition(":")[2])

    @property
    def upstream(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"


@dataclass(frozen=True, slots=True)
class FileChange:
    path: str
    content: str | None  # None: remove the file
    why: str


@dataclass(frozen=True, slots=True)
class Command:
    argv: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Plan:
    action: str  # "install" | "uninstall"
    layout: Layout
    moves: tuple[Move, ...] = ()
    before: tuple[Command, ...] = ()  # run before the files change (uninstall: stop the proxy first)
    files: tuple[FileChange, ...] = ()
    after: tuple[Command, ...] = ()
    notes: tuple[str, ...] = ()  # what a person does by hand (ComfyUI's flag, a root-only drop-in)
    record: InstallRecord | None = field(default=None, hash=False)  # install: what to keep for uninstall
    remove_dirs: tuple[str, ...] = ()  # uninstall: folders install created, removed when empty


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host, int(port)


def plan_moves(registry: Registry, engine_ports: Mapping[str, int], skip: Iterable[str]) -> tuple[list[Move], list[str]]:
    """Which tenants move and where (pure). Notes say why a tenant with a listener does not."""
    skipped = set(skip)
    moves: list[Move] = []
    notes: list[str] = []
    for tenant in registry:
        if not tenant.listen or not tenant.upstream or tenant.name in skipped:
            continue
        up = urlsplit(tenant.upstream)
        if not is_loopback_host(up.hostname or ""):
            notes.append(f"{tenant.name}: its engine is not on this machine's loopback ({tenant.upstream}): left as it is")
            continue
        listen_host, listen_port = _host_port(tenant.listen)
        engine_port = engine_ports.get(tenant.name, listen_port)
        engine_own = up.port or (443 if up.scheme == "https" else 80)
        if engine_port == engine_own:
            raise HyperSwapError(f"{tenant.name}: the engine cannot move to port {engine_port}, the port it has now",
                                 fix=f"pick another: --port {tenant.name}=PORT")
        relocation = adapter_for(tenant).relocation(engine_port)
        if relocation is None:
            notes.append(f"{tenant.name}: HyperSwap knows no way to move a {tenant.engine} engine: left as it is "
                         "(move it yourself and set listen/upstream in tenants.json)")
            continue
        moves.append(Move(tenant.name, f"{listen_host}:{engine_own}", engine_port, tenant.listen, tenant.upstream,
                          relocation))
    return moves, notes


def port_conflicts(moves: Sequence[Move], registry: Registry, holders: Holders) -> list[str]:
    """Every port a move would take that someone else holds, naming the holder (empty: all clear).

    The proxy's new port may be held by the engine that moves off it (by the tenant's match rules;
    one whose process cannot be seen is taken for the engine, as its own port it serves today). The
    engine's new port must be free."""
    rules = Attributor(registry)
    problems: list[str] = []

    def engine_of(h: PortHolder, tenant: str) -> bool:
        return h.pid is not None and rules.match(GpuProcess(h.pid, h.name, h.cmdline, None)) == tenant

    for m in moves:
        for h in holders(m.proxy_port):
            if h.pid is None or engine_of(h, m.tenant):
                continue  # the engine itself: it moves off before the proxy binds
            problems.append(f"port {m.proxy_port} (for {m.tenant}'s proxy): {h.describe()}; if that is {m.tenant} "
                            f"itself (its match rules do not name it), stop it, install, then start it with "
                            f"`{m.relocation.instruction}`")
        for h in holders(m.engine_port):
            problems.append(f"port {m.engine_port} (for {m.tenant}'s engine): {h.describe()}")
    return problems


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _updated_config(base: Mapping[str, object], moves: Sequence[Move]) -> dict[str, object]:
    new = copy.deepcopy(dict(base))
    tenants = new.get("tenants")
    if not isinstance(tenants, dict):
        tenants = new["tenants"] = {}
    for m in moves:
        body = tenants.get(m.tenant)
        if not isinstance(body, dict):
            body = tenants[m.tenant] = {}
        body["listen"], body["upstream"] = m.proxy_listen, m.upstream
    return new


def plan_install(lay: Layout, base_config: Mapping[str, object], exec_argv: list[str], holders: Holders, *,
                 engine_ports: Mapping[str, int] | None = None, skip: Iterable[str] = (), start: bool = True,
                 read: Callable[[str], str | None]) -> Plan:
    """Everything install would do, decided before anything is written.

    `base_config`: the tenants.json the service will use, as it is now ({} when absent); `read`:
    a file's current text on the target (None when absent), to record what uninstall restores."""
    if read(lay.record) is not None:
        raise HyperSwapError(f"HyperSwap is already installed here (record {lay.record})",
                             fix="run `hyperswap uninstall` first" + (" --user" if lay.mode == "user" else ""))
    registry = registry_from_dict(base_config)
    moves, notes = plan_moves(registry, engine_ports or {}, skip)
    problems = port_conflicts(moves, registry, holders)
    if problems:
        raise HyperSwapError("cannot take the ports: " + "; ".join(problems),
                             fix="stop the programs named (or pick other engine ports with --port TENANT=PORT), "
                             "then run install again")
    config = _updated_config(base_config, moves)
    registry_from_dict(config)  # the file we write must load: refuse here, not at the service's start
    files = [FileChange(lay.unit, render_unit(lay.mode, exec_argv, lay.config_in_unit), "the HyperSwap service"),
             FileChange(lay.config, json.dumps(config, indent=2) + "\n",
                        "tenants.json: the proxy on the engines' ports, the engines behind it")]
    drop_ins, services, by_hand = _engine_relocations(lay, moves)
    files += drop_ins
    notes += by_hand
    after = _after_install(lay, services, start)
    record = _install_record(lay, files, moves, services, read)
    return Plan("install", lay, tuple(moves), (), tuple(files), tuple(after), tuple(notes), record)


def _engine_relocations(lay: Layout, moves: Sequence[Move]) -> tuple[list[FileChange], list[str], list[str]]:
    """How each engine moves to its new port: a drop-in for a service install may write (its files,
    the services to restart), else a note of what to do by hand."""
    files: list[FileChange] = []
    services: list[str] = []
    notes: list[str] = []
    for m in moves:
        r = m.relocation
        if r.service and r.environment and lay.drop_ins:
            files.append(FileChange(lay.drop_in(r.service), render_drop_in(r.environment),
                                    f"moves {m.tenant} to 127.0.0.1:{m.engine_port}"))
            services.append(r.service)
        elif r.service and r.environment:
            notes.append(f"{m.tenant}: its {r.service} is a system service; as root, add a drop-in "
                         f"{lay.drop_in(r.service)} with:\n" + render_drop_in(r.environment)
                         + f"  then `systemctl daemon-reload && systemctl restart {r.service}`"
                         + f" (or, started by hand: `{r.instruction}`)")
        else:
            notes.append(f"{m.tenant}: start it on its new port: `{r.instruction}` (the proxy now takes "
                         f"{m.proxy_listen}; until the engine moves, the proxy cannot bind it)")
    return files, services, notes


def _after_install(lay: Layout, services: list[str], start: bool) -> list[Command]:
    """The commands after the files: reload, restart the moved services, enable (and start) HyperSwap."""
    sc = lay.systemctl
    after = [Command((*sc, "daemon-reload"), "read the new unit files")]
    after += [Command(("systemctl", "try-restart", s), f"{s} picks up its new port") for s in services]
    enable = (*sc, "enable", "--now", UNIT_NAME) if start else (*sc, "enable", UNIT_NAME)
    after.append(Command(enable, "start HyperSwap now and at every boot" if start else "start HyperSwap at every boot"))
    return after


def _install_record(lay: Layout, files: list[FileChange], moves: Sequence[Move], services: list[str],
                    read: Callable[[str], str | None]) -> InstallRecord:
    """What uninstall needs: each file's text before and hash after, each move, what was moved by hand."""
    return InstallRecord(
        mode=lay.mode, services=services,
        files=[RecordedFile(path=f.path, previous=read(f.path), written_sha256=_sha(f.content or "")) for f in files],
        moves=[RecordedMove(tenant=m.tenant, proxy_listen=m.proxy_listen, engine_port=m.engine_port,
                            previous_listen=m.previous_listen, previous_upstream=m.previous_upstream,
                            by_hand=None if (m.relocation.service and lay.drop_ins) else m.relocation.instruction)
               for m in moves])


def plan_uninstall(lay: Layout, read: Callable[[str], str | None], *, force: bool = False) -> Plan:
    """Everything uninstall would do: from the install record, each file back to what it was."""
    text = read(lay.record)
    if text is None:
        raise HyperSwapError(f"no HyperSwap install recorded at {lay.record}",
                             fix="nothing to undo" + ("" if lay.mode == "user" else " (for a user install: --user)"))
    try:
        record = InstallRecord.model_validate_json(text)
    except ValueError as exc:  # not JSON, or not a record (pydantic's ValidationError is a ValueError)
        raise HyperSwapError(f"the install record {lay.record} is unreadable ({exc})",
                             fix="undo by hand: remove the files install printed, then delete the record") from None
    files: list[FileChange] = []
    changed: list[str] = []
    for f in reversed(record.files):
        path, previous = f.path, f.previous
        now = read(path)
        if now is not None and _sha(now) != f.written_sha256:
            changed.append(path)
        files.append(FileChange(path, previous, "put back as it was" if previous is not None else "remove (install created it)"))
    if changed and not force:
        raise HyperSwapError("changed since install: " + ", ".join(changed),
                             fix="keep your changes elsewhere, then run `hyperswap uninstall --force` "
                             "to put back what was there before")
    files.append(FileChange(lay.record, None, "the install record"))
    sc = lay.systemctl
    before = (Command((*sc, "disable", "--now", record.unit), "stop HyperSwap, off its ports"),)
    after = [Command((*sc, "daemon-reload"), "forget the removed units")]
    after += [Command(("systemctl", "try-restart", s), f"{s} back on its own port") for s in record.services]
    notes = [f"{m.tenant}: start it on its own port again (it was moved with `{m.by_hand}`)"
             for m in record.moves if m.by_hand]
    return Plan("uninstall", lay, (), before, tuple(files), tuple(after), tuple(notes),
                remove_dirs=tuple(record.created_dirs))


# -- effects -----------------------------------------------------------------------------------
class Runner(Protocol):
    def run(self, argv: Sequence[str]) -> tuple[int, str]: ...


class SystemRunner:
    def run(self, argv: Sequence[str]) -> tuple[int, str]:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return 127, str(exc)
        return done.returncode, (done.stdout + done.stderr).strip()


class Files:
    """The target system's files under `root` ("/" for real; a temp dir in tests)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def read(self, path: str) -> str | None:
        try:
            return self.at(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def write(self, path: str, text: str) -> None:
        target = self.at(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".hyperswap-tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)  # never a half-written unit or config

    def remove(self, path: str) -> None:
        self.at(path).unlink(missing_ok=True)

    def missing_dirs(self, paths: Iterable[str]) -> list[str]:
        """The folders that writing these files would create (as target paths), deepest first."""
        out: set[str] = set()
        for path in paths:
            parent = Path(path).parent
            while parent != parent.parent and not self.at(str(parent)).exists():
                out.add(str(parent))
                parent = parent.parent
        return sorted(out, key=lambda d: (-d.count("/"), d))

    def remove_dir_if_empty(self, path: str) -> None:
        try:
            self.at(path).rmdir()
        except OSError:
            pass  # something else lives there now (or it is gone): leave it


def describe(plan: Plan, out: TextIO, *, dry_run: bool) -> None:
    head = f"hyperswap {plan.action} ({plan.layout.mode})"
    print(head + (": dry run, nothing written and nothing run" if dry_run else ""), file=out)
    for m in plan.moves:
        print(f"  {m.tenant}: clients keep {m.proxy_listen} (HyperSwap now); the engine moves to 127.0.0.1:{m.engine_port}",
              file=out)
    verb = "would" if dry_run else "will"
    for c in plan.before:
        print(f"\n{verb} run: {' '.join(c.argv)}    # {c.why}", file=out)
    for f in plan.files:
        if f.content is None:
            print(f"\n{verb} remove {f.path}    # {f.why}", file=out)
        else:
            print(f"\n{verb} write {f.path}    # {f.why}", file=out)
            print("".join("    " + line for line in f.content.splitlines(keepends=True)).rstrip("\n"), file=out)
    if plan.record is not None:
        print(f"\n{verb} write {plan.layout.record}    # what was there before, for `hyperswap uninstall`", file=out)
    if plan.remove_dirs:
        print(f"\n{verb} remove, when empty, the folders install created: {', '.join(plan.remove_dirs)}", file=out)
    for c in plan.after:
        print(f"\n{verb} run: {' '.join(c.argv)}    # {c.why}", file=out)
    for n in plan.notes:
        print(f"\nby hand: {n}", file=out)


def apply(plan: Plan, files: Files, runner: Runner, err: TextIO) -> int:
    """Carry out a plan: commands before, files, the record, commands after. Stops at the first failed command."""
    def run_all(commands: Iterable[Command]) -> bool:
        for c in commands:
            rc, output = runner.run(c.argv)
            if rc != 0:
                print(f"error: `{' '.join(c.argv)}` failed ({rc}): {output}", file=err)
                return False
        return True

    if not run_all(plan.before):
        return 1
    if plan.record is not None:  # the record first: an install cut short can still be undone
        created = files.missing_dirs([plan.layout.record, *(f.path for f in plan.files)])
        written = plan.record.model_copy(update={"created_dirs": created})
        files.write(plan.layout.record, json.dumps(written.model_dump(mode="json"), indent=2) + "\n")
    for f in plan.files:
        if f.content is None:
            files.remove(f.path)
        else:
            files.write(f.path, f.content)
    for d in plan.remove_dirs:
        files.remove_dir_if_empty(d)
    return 0 if run_all(plan.after) else 1


# -- the command line --------------------------------------------------------------------------
def exec_argv() -> list[str]:
    """How the service starts this HyperSwap: the `hyperswap` beside this Python (venv, pipx), else on PATH."""
    beside = Path(sys.executable).with_name("hyperswap")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("hyperswap")
    return [found] if found else [sys.executable, "-m", "proxy.cli"]


HIDDEN_FROM_THE_SERVICE = ("/tmp", "/var/tmp")  # the system unit's PrivateTmp=yes gives it empty ones


def _under_tmp(argv: Sequence[str]) -> tuple[str, str] | None:
    """The first word of the command that lies under /tmp or /var/tmp, and which of them."""
    for word in argv:
        for folder in HIDDEN_FROM_THE_SERVICE:
            if word.startswith(folder + "/"):
                return word, folder
    return None


def exec_refusal(mode: Mode, argv: Sequence[str]) -> HyperSwapError | None:
    """Why the service could not start this command: the system unit runs with PrivateTmp=yes, so
    a HyperSwap installed under /tmp or /var/tmp (a virtual environment made there) is not there
    for it, and every start would fail with "No such file or directory". None: nothing in the way."""
    found = _under_tmp(argv)
    if found is None or mode == "user":  # a user unit sees /tmp (emptied at boot: tmp_note says so)
        return None
    path, folder = found
    return HyperSwapError(
        f"the service would run {path}, under {folder}: the system unit has PrivateTmp=yes, so the service "
        "sees an empty /tmp and /var/tmp and could never start",
        fix=f"install HyperSwap outside /tmp: {install_command()}, then run `/opt/hyperswap/bin/hyperswap install`")


def install_command(checkout: Path | None = None) -> str:
    """A command that installs HyperSwap into /opt/hyperswap and works (HyperSwap is installed from its
    checkout or a wheel built from it, docs/guides/service.md; no package index has it): this
    installation's own checkout when it runs from one."""
    from proxy import __version__

    if checkout is None:
        here = Path(__file__).resolve().parents[2]
        checkout = here if (here / "pyproject.toml").is_file() else None
    source = str(checkout) if checkout is not None else "."
    where = "" if checkout is not None else " from the checkout"
    return (f"`python3 -m venv /opt/hyperswap && /opt/hyperswap/bin/pip install {source}`{where} (or a wheel built "
            f"with `pip wheel --no-deps .`: `/opt/hyperswap/bin/pip install hyperswap-{__version__}-py3-none-any.whl`)")


def tmp_note(argv: Sequence[str]) -> str | None:
    """A user service may run a program under /tmp, but /tmp is emptied at boot."""
    found = _under_tmp(argv)
    return None if found is None else (
        f"the service runs {found[0]}, under {found[1]}, a folder that is emptied at boot: after a reboot it cannot "
        "start; install HyperSwap elsewhere (a virtual environment in your home, or pipx) for a lasting service")


def add_arguments(p: argparse.ArgumentParser, action: str) -> None:
    p.add_argument("--user", action="store_true", help="a user service (systemctl --user) instead of a system one")
    p.add_argument("--dry-run", action="store_true", help="print every file and command, change nothing")
    p.add_argument("--root", metavar="DIR", default="/", help="write under this folder instead of / (packaging, tests)")
    if action == "install":
        p.add_argument("--port", action="append", default=[], metavar="TENANT=PORT",
                       help="where an engine moves (default: the port the proxy listened on, e.g. ollama=11435)")
        p.add_argument("--skip", action="append", default=[], metavar="TENANT", help="leave this tenant as it is")
        p.add_argument("--no-start", action="store_true", help="enable the service without starting it now")
    else:
        p.add_argument("--force", action="store_true", help="put files back even where they changed since install")


def _engine_ports(specs: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for spec in specs:
        name, sep, port = spec.partition("=")
        if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise HyperSwapError(f"--port {spec}: expected TENANT=PORT with a port from 1 to 65535",
                                 fix="e.g. --port ollama=11435")
        out[name] = int(port)
    return out


def main(args: argparse.Namespace, action: str, *, runner: Runner | None = None, holders: Holders | None = None,
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    mode: Mode = "user" if args.user else "system"
    root = Path(args.root)
    if mode == "system" and str(root) == "/" and not args.dry_run and os.geteuid() != 0:
        raise HyperSwapError(f"a system {action} writes /etc and runs systemctl: it needs root",
                             fix=f"sudo hyperswap {action}, or `hyperswap {action} --user`, or --dry-run to see it")
    files = Files(root)
    lay = layout(mode, str(Path.home()))
    if action == "install":
        plan, refusal = _install_plan(args, mode, root, files, lay, holders)
    else:
        refusal = None
        plan = plan_uninstall(lay, files.read, force=args.force)
    describe(plan, out, dry_run=args.dry_run)
    if refusal is not None:  # a dry run shows the plan, and that install refuses it
        print(f"\n{refusal.one_line()}\n(the real install refuses this and changes nothing)", file=err)
        return refusal.exit_code
    if args.dry_run:
        return 0
    return apply(plan, files, runner or SystemRunner(), err)


def _install_plan(args: argparse.Namespace, mode: Mode, root: Path, files: Files, lay: Layout,
                  holders: Holders | None) -> tuple[Plan, HyperSwapError | None]:
    """The install's plan over the tenants.json already there, and the refusal a dry run shows (a real
    install raises it)."""
    from proxy.deploy.ports import holders_here

    current = files.read(lay.config)
    try:
        base = json.loads(current) if current else {}
    except ValueError as exc:
        raise HyperSwapError(f"{lay.config} is not JSON ({exc})", fix="correct it, or move it away") from None
    if not isinstance(base, dict):
        raise HyperSwapError(f"{lay.config} is not a JSON object", fix="correct it, or move it away")
    argv = exec_argv()
    # Installing onto this machine: a program its service cannot see is refused. Into another
    # root (an image being packaged, a test) this machine's /tmp says nothing of that system's:
    # a note says where the unit's program lies instead.
    here = str(root) == "/"
    refusal = exec_refusal(mode, argv) if here else None
    if refusal is not None and not args.dry_run:
        raise refusal
    plan = plan_install(lay, base, argv, holders or holders_here, engine_ports=_engine_ports(args.port),
                        skip=args.skip, start=not args.no_start, read=files.read)
    note = tmp_note(argv) if mode == "user" or not here else None
    if note:
        plan = replace(plan, notes=(*plan.notes, note))
    return plan, refusal
