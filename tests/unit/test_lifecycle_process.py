"""ProcessController with real children: started in a group of their own, ready when their port
answers, stopped with SIGTERM (SIGKILL after stop_timeout_s), output kept, orphans named, never killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.clock import SystemClock
from proxy.lifecycle import (
    LifecycleError,
    ProcessController,
    ReadyProbe,
    TenantLifecycle,
    probe_readiness,
    wait_ready,
)
from proxy.lifecycle.ready import probe_once
from proxy.tasks import poll_until

PY = sys.executable
# A tiny HTTP server on a port of its own choosing (0), printing it; SIGTERM ends it (Python's default).
SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ready" else 404); self.end_headers()
        def log_message(self, *a): pass
    s = http.server.HTTPServer(("127.0.0.1", 0), H)
    print("listening", s.server_address[1], flush=True)
    s.serve_forever()
""")
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ignoring', flush=True)\ntime.sleep(600)\n"
WAIT_S = 10.0  # bounds a wait for a child's output; never reached when things work


def alive(pid: int) -> bool:
    """The pid runs (a zombie left for a non-reaping init does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


async def printed(ctl: ProcessController, prefix: str) -> str:
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: any(line.startswith(prefix) for line in ctl.output()))
    return next(line for line in ctl.output() if line.startswith(prefix))


@pytest.fixture
async def controllers() -> AsyncIterator[list[ProcessController]]:
    made: list[ProcessController] = []
    yield made
    for ctl in made:  # whatever a failing test left running
        await ctl.aclose()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port bound but not listening: every connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def make(controllers: list[ProcessController], *argv: str, **kwargs: Any) -> ProcessController:
    ctl = ProcessController("app", [PY, *argv], clock=SystemClock(), **kwargs)
    controllers.append(ctl)
    return ctl


async def test_a_started_server_is_ready_when_it_answers_and_stops_on_sigterm(controllers: list[ProcessController]) -> None:
    ctl = make(controllers, "-c", SERVER, stop_timeout_s=5.0)
    assert await ctl.status() == "stopped"
    await ctl.start()
    assert await ctl.status() == "running" and ctl.pid is not None
    assert os.getpgid(ctl.pid) == ctl.pid, "the child leads a process group of its own"
    port = int((await printed(ctl, "listening")).split()[1])
    took = await wait_ready(ReadyProbe("127.0.0.1", port, f"http://127.0.0.1:{port}/ready"), WAIT_S, SystemClock())
    assert took < WAIT_S
    await ctl.start()  # running: nothing more is started
    pid = ctl.pid
    await ctl.stop()
    assert ctl.describe()["exit_code"] == -signal.SIGTERM, "SIGTERM ended it (no SIGKILL needed)"
    assert await ctl.status() == "stopped" and not alive(pid)
    assert ctl.exited() is None, "a stop the proxy asked for is no crash"


async def test_a_child_that_ignores_sigterm_is_killed_after_stop_timeout(controllers: list[ProcessController]) -> None:
    ctl = make(controllers, "-c", STUBBORN, stop_timeout_s=0.3)
    await ctl.start()
    await printed(ctl, "ignoring")
    clock = SystemClock()
    began = clock.now()
    await ctl.stop()
    took = clock.now() - began
    assert ctl.describe()["exit_code"] == -signal.SIGKILL
    assert took >= 0.3, f"SIGKILL came after {took:.3f} s, before stop_timeout_s"
    assert took < WAIT_S


async def test_a_stop_reaches_what_the_child_spawned(controllers: list[ProcessController]) -> None:
    spawner = ("import subprocess, sys, time\n"
               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
               "print('grandchild', p.pid, flush=True)\ntime.sleep(600)\n")
    ctl = make(controllers, "-c", spawner, stop_timeout_s=5.0)
    await ctl.start()
    grandchild = int((await printed(ctl, "grandchild")).split()[1])
    assert alive(grandchild)
    await ctl.stop()
    async with asyncio.timeout(WAIT_S):  # its new parent reaps it when it gets to it
        await poll_until(lambda: not alive(grandchild))


async def test_a_failing_start_reports_its_last_output_lines(controllers: list[ProcessController], refused_port: int) -> None:
    script = "import sys\nfor i in range(80): print('line', i)\nprint('fatal: no model', file=sys.stderr)\nsys.exit(3)\n"
    ctl = make(controllers, "-c", script)
    clock = SystemClock()
    lc = TenantLifecycle("app", ctl, probe_readiness(ReadyProbe("127.0.0.1", refused_port, None), clock, exited=ctl.exited),
                         start_timeout_s=WAIT_S, clock=clock)
    report = await lc.begin_start()
    assert not report.ok and report.state == "failed"
    assert report.error is not None and "exited with code 3 before it was ready" in report.error
    assert report.output[-1] == "fatal: no model", "stderr is captured with stdout"
    assert len(report.output) == 50 and report.output[0] == "line 31", "the last 50 lines are kept"
    assert report.duration_s < WAIT_S, "a crashed child fails the start at once, not at the timeout"
    with pytest.raises(LifecycleError) as err:
        await lc.ensure_running()  # backing off: refused with the same reason and lines
    output = err.value.body()["output"]
    assert err.value.status == 503 and isinstance(output, list) and output[-1] == "fatal: no model", output


async def test_stdin_is_closed_and_cwd_and_env_are_the_configured_ones(
        controllers: list[ProcessController], tmp_path: Path) -> None:
    script = "import os, sys\nprint('stdin', repr(sys.stdin.read()), os.getcwd(), os.environ['MODEL'], flush=True)\n"
    ctl = make(controllers, "-c", script, cwd=str(tmp_path), env={"MODEL": "q4.gguf"})
    await ctl.start()
    want = f"stdin '' {tmp_path} q4.gguf"
    with contextlib.suppress(TimeoutError):  # the line may be read while it is still being written: wait for it whole
        async with asyncio.timeout(WAIT_S):
            await poll_until(lambda: want in ctl.output())
    assert want in ctl.output(), ctl.output()
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: ctl.exited() is not None)
    assert ctl.exited() == "exited with code 0" and await ctl.status() == "stopped"
    await ctl.stop()  # reaps and reads the rest; nothing to signal


async def test_a_missing_program_is_a_clear_error() -> None:
    ctl = ProcessController("app", ["/nonexistent/llama-server"])
    with pytest.raises(LifecycleError, match="cannot run /nonexistent/llama-server for tenant 'app'"):
        await ctl.start()
    await ctl.stop()  # never started: nothing to stop


async def test_an_orphan_of_an_earlier_run_is_named_and_never_killed(
        controllers: list[ProcessController], tmp_path: Path) -> None:
    first = make(controllers, "-c", STUBBORN, state_dir=tmp_path, stop_timeout_s=0.2)
    await first.start()
    await printed(first, "ignoring")
    pid = first.pid
    assert pid is not None
    # the proxy restarts (the first one crashed, and the kernel let its slot go): a new controller reads the record
    assert first.slot is not None
    first.slot.release()
    second = ProcessController("app", [PY, "-c", STUBBORN], state_dir=tmp_path)
    controllers.append(second)
    assert second.orphan == {"pid": pid, "command": [PY, "-c", STUBBORN]}
    assert await second.status() == "unknown", "it did not start it, so it cannot say it runs"
    problems = await second.check()
    assert len(problems) == 1 and f"process {pid} from an earlier run" in problems[0] and f"kill {pid}" in problems[0]
    await second.stop()
    await second.aclose()
    assert alive(pid), "the proxy never stops a process it did not start"
    await first.stop()
    assert not alive(pid)
    third = ProcessController("app", [PY], state_dir=tmp_path)
    controllers.append(third)
    assert third.orphan is None, "what the record names is gone"


async def test_two_live_instances_with_one_state_folder_never_touch_each_others_app_or_record(
        controllers: list[ProcessController], tmp_path: Path) -> None:
    """Issue 42: a second proxy with the same tenant name ended the first's app at its start as "left
    behind by an earlier run", and its stop deleted the first's record. A slot is held by one live
    controller: the second takes the next."""
    first = make(controllers, "-c", STUBBORN, state_dir=tmp_path, stop_timeout_s=0.2)
    await first.start()
    await printed(first, "ignoring")
    pid = first.pid
    assert pid is not None and (tmp_path / "app.process.json").exists()
    second = make(controllers, "-c", SERVER, state_dir=tmp_path, stop_timeout_s=2.0)
    assert second.orphan is None and await second.clean_up() == [], "a live instance's app is no leftover"
    assert await second.check() == []
    await second.start()
    await printed(second, "listening")
    await second.stop()
    assert alive(pid), "the other instance's app runs on"
    record = json.loads((tmp_path / "app.process.json").read_text())
    assert record["pid"] == pid and record["writer"]["pid"] == os.getpid(), "its record is left, naming its writer"
    assert second.log_path == tmp_path / "app.2.log" and first.log_path == tmp_path / "app.log"
    await first.stop()
    assert not (tmp_path / "app.process.json").exists(), "a clean stop removes its own record"


async def test_aclose_stops_what_it_started(controllers: list[ProcessController]) -> None:
    ctl = make(controllers, "-c", SERVER)
    await ctl.start()
    await printed(ctl, "listening")
    pid = ctl.pid
    assert pid is not None
    await ctl.aclose()
    assert not alive(pid) and await ctl.status() == "stopped"


async def test_a_probe_failure_with_an_empty_message_names_its_kind() -> None:
    """Issue 42: a timeout read "GET .../health: " (an exception whose text is empty)."""
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(hang)) as client:
        why = await probe_once(ReadyProbe("127.0.0.1", 9, "http://127.0.0.1:9/health"), client, 0.1)
    assert why == "GET http://127.0.0.1:9/health: ReadTimeout", why


async def test_a_stop_lets_the_guard_go_without_it_acting(controllers: list[ProcessController]) -> None:
    ctl = make(controllers, "-c", SERVER)
    await ctl.start()
    guard = await ctl.guard.armed()
    assert guard is not None and alive(guard), "a guard runs beside the app"
    await ctl.stop()
    assert not alive(guard) and ctl.guard.proc is None, "told to let go, it exited (and was reaped)"
