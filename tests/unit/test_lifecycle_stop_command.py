"""A `process` tenant's stop command (release.stop_command, llama-swap's cmdStop) with real children:
it stops the app instead of signals, a failing one falls back to the signals, a hanging one is
killed with its process group within stop_timeout_s; and the follower of the app's output file."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.clock import SystemClock
from proxy.lifecycle import ProcessController, procs
from proxy.lifecycle.logs import LogFollower
from proxy.tasks import poll_until

PY = sys.executable
WAIT_S = 10.0  # bounds a wait for a child; never reached when things work


def waiter(fifo: Path) -> str:
    """An app that says it runs, then waits for a word on `fifo` and exits with code 7 when it gets one
    (so an exit code of 7 proves the stop command, not a signal, ended it)."""
    return (f"import os, sys\nprint('waiting', flush=True)\nfd = os.open({str(fifo)!r}, os.O_RDONLY)\n"
            f"os.read(fd, 1)\nprint('told to stop', flush=True)\nsys.exit(7)\n")


def alive(pid: int) -> bool:
    """The pid runs (a zombie does not count): what /proc says, read as the controller reads it."""
    found = procs.proc(pid)
    return found is not None and found.alive


@pytest.fixture
async def controllers() -> AsyncIterator[list[ProcessController]]:
    made: list[ProcessController] = []
    yield made
    for ctl in made:
        await ctl.aclose()


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "stop.fifo"
    os.mkfifo(path)
    return path


async def started(controllers: list[ProcessController], script: str, stop_command: list[str],
                  stop_timeout_s: float = 5.0, **kwargs: Any) -> ProcessController:
    ctl = ProcessController("app", [PY, "-c", script], clock=SystemClock(), stop_timeout_s=stop_timeout_s,
                            stop_command=stop_command, **kwargs)
    controllers.append(ctl)
    await ctl.start()
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: "waiting" in ctl.output())
    return ctl


async def test_a_stop_command_that_works_stops_the_app_without_signals(controllers: list[ProcessController],
                                                                       fifo: Path) -> None:
    ctl = await started(controllers, waiter(fifo), [PY, "-c", f"open({str(fifo)!r}, 'w').write('x')"])
    pid = ctl.pid
    assert pid is not None
    await ctl.stop()
    assert ctl.describe()["exit_code"] == 7, f"the stop command ended it, not a signal: {ctl.describe()}"
    assert not alive(pid) and await ctl.status() == "stopped", "the stop is confirmed by the child being gone"
    assert ctl.stop_error is None and await ctl.check() == []
    stop_command = ctl.describe()["stop_command"]
    assert isinstance(stop_command, list) and stop_command[0] == PY, stop_command


async def test_a_setsid_child_a_stop_command_leaves_is_ended_with_the_stop(controllers: list[ProcessController],
                                                                          fifo: Path, tmp_path: Path) -> None:
    """Issue 42: a stop command that leaves a `setsid` child (out of its process group, its parent gone)
    left it running. It carries the stop's run id in its environment (procs.RUN_VAR): ended too."""
    helper_pid = tmp_path / "helper.pid"
    stop = [PY, "-c", "import subprocess, sys\n"
            f"h = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)\n"
            f"open({str(helper_pid)!r}, 'w').write(str(h.pid))\n"
            f"open({str(fifo)!r}, 'w').write('x')\n"]
    ctl = await started(controllers, waiter(fifo), stop)
    await ctl.stop()
    helper = int(helper_pid.read_text())
    try:
        assert ctl.stop_error is None and ctl.describe()["exit_code"] == 7, ctl.describe()
        assert not alive(helper), "the stop command's setsid child is ended with the stop"
    finally:
        if alive(helper):
            os.kill(helper, signal.SIGKILL)


async def test_a_failing_stop_command_falls_back_to_the_signals_and_says_why(controllers: list[ProcessController],
                                                                           fifo: Path) -> None:
    failing = [PY, "-c", "import sys; print('Error: No such container: tts', file=sys.stderr); sys.exit(1)"]
    ctl = await started(controllers, waiter(fifo), failing)
    pid = ctl.pid
    assert pid is not None
    await ctl.stop()
    assert ctl.describe()["exit_code"] == -signal.SIGTERM, "SIGTERM stopped it once the command failed"
    assert not alive(pid) and await ctl.status() == "stopped"
    assert ctl.stop_error is not None and "exited with code 1" in ctl.stop_error, ctl.stop_error
    assert "No such container: tts" in ctl.stop_error, "the command's own last line says why"
    (problem,) = await ctl.check()
    assert "stopped it with signals" in problem and "(fix: " in problem, problem


async def test_a_stop_command_that_cannot_run_falls_back_to_the_signals(controllers: list[ProcessController],
                                                                       fifo: Path, tmp_path: Path) -> None:
    ctl = await started(controllers, waiter(fifo), [str(tmp_path / "no-such-program")])
    await ctl.stop()
    assert ctl.describe()["exit_code"] == -signal.SIGTERM
    assert ctl.stop_error is not None and "could not run" in ctl.stop_error, ctl.stop_error


async def test_a_hanging_stop_command_is_killed_with_its_group_within_the_stop_timeout(
        controllers: list[ProcessController], fifo: Path, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    hanging = [PY, "-c", "import os, signal, subprocess, sys\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
               f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\nsignal.pause()\n"]
    ctl = await started(controllers, waiter(fifo), hanging, stop_timeout_s=1.0)
    clock = SystemClock()
    began = clock.now()
    await ctl.stop()
    took = clock.now() - began
    assert ctl.stop_error is not None and "did not finish within 1 s" in ctl.stop_error, ctl.stop_error
    assert 1.0 <= took < 1.0 + 3.0, f"the stop took {took:.2f} s: the command's 1 s, then SIGTERM"
    assert ctl.describe()["exit_code"] == -signal.SIGTERM
    command, its_child = (int(p) for p in pids.read_text().split())
    async with asyncio.timeout(WAIT_S):  # killed as a group; the child's new parent reaps it
        await poll_until(lambda: not alive(command) and not alive(its_child))


async def test_the_follower_gives_the_last_lines_then_new_ones_then_a_new_run(
        controllers: list[ProcessController], fifo: Path, tmp_path: Path) -> None:
    script = ("import os, sys\nfor i in range(150): print('line', i)\nprint('waiting', flush=True)\n"
              f"fd = os.open({str(fifo)!r}, os.O_RDONLY)\nprint('got', os.read(fd, 5).decode(), flush=True)\n"
              "sys.exit(0)\n")
    ctl = ProcessController("app", [PY, "-c", script], clock=SystemClock(), state_dir=tmp_path / "state")
    controllers.append(ctl)
    follower = LogFollower(ctl)
    assert (await follower.back(10)).lines == [], "nothing before the first start"
    await ctl.start()
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: "waiting" in ctl.output())
    back = await follower.back(100)
    assert back.lines == [*(f"line {i}" for i in range(51, 150)), "waiting"], back.lines[:3]
    assert (await follower.new()).lines == [], "nothing new yet"
    await asyncio.to_thread(fifo.write_text, "hello")  # opening a FIFO waits for its reader
    lines: list[str] = []
    async with asyncio.timeout(WAIT_S):
        while "got hello" not in lines:
            lines += (await follower.new()).lines
            await asyncio.sleep(0)
    assert lines == ["got hello"], f"each new line once, in order: {lines}"
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: not ctl.alive())
    await ctl.stop()
    await ctl.start()  # a new run: its file starts over
    async with asyncio.timeout(WAIT_S):
        await poll_until(lambda: "waiting" in ctl.output())
    chunk = await follower.new()
    assert chunk.new_run == 2 and chunk.lines[:2] == ["line 0", "line 1"], chunk
