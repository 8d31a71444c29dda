"""`hyperswap demo`: the self-test passes on every shipped scenario; `hyperswap plan` reads a running proxy."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from proxy.cli import main
from proxy.demo import DecisionPrinter, Demo, describe, start_demo
from proxy.demo_check import self_test
from proxy.sim.box import fast_scenario, scenario_names
from tests.integration.boxes import DemoFactory, chat, fast, proxy_of, render


def test_the_three_required_scenarios_ship() -> None:
    assert {"default", "tight", "third-app", "lifecycle"} <= set(scenario_names())


@pytest.mark.parametrize("name", ["default", "tight", "third-app", "lifecycle", "suspend"])
async def test_demo_self_test_passes(box: DemoFactory, name: str) -> None:
    demo = await box(name)
    results = await self_test(demo)
    failed = [(n, d) for n, ok, d in results if not ok]
    assert not failed, failed
    assert len(results) >= 20
    text = describe(demo, name)
    assert demo.proxy is not None and proxy_of(demo).url("admin") in text and "Try:" in text


async def test_tight_demo_handoff_names_the_speech_relay(box: DemoFactory) -> None:
    demo = await box("tight")
    results = dict((n, d) for n, ok, d in await self_test(demo))
    assert "loaded after releasing comfyui" in results["proxy: handoff ComfyUI -> Ollama"]
    rejection = results["proxy: 507 names the blockers"]
    assert rejection.startswith("507 for mistral-small:22b"), rejection
    assert "python stt_relay.py --model large-v3 (pid 4242, 0.84 GiB, unmanaged)" in rejection, rejection


async def test_lifecycle_demo_stops_the_speech_relay_for_a_render_and_starts_it_again(box: DemoFactory) -> None:
    demo = await box("lifecycle")
    results = {n: (ok, d) for n, ok, d in await self_test(demo)}
    ok, detail = results["proxy: relay stopped for a render"]
    assert ok and "stopped for flux1-dev-fp8.safetensors" in detail and "started again" in detail, detail
    machine = proxy_of(demo).broker.lifecycles.machine("stt")
    assert machine is not None and machine.state == "running", "the last request started it again"
    kinds = [d.kind for d in proxy_of(demo).decisions.recent(500) if d.tenant == "stt" and d.kind in ("start", "stop")]
    assert kinds == ["start", "stop", "start"], kinds
    assert "stt via proxy" in describe(demo, "lifecycle")


async def test_plan_command_prints_a_dry_run_from_the_running_proxy(box: DemoFactory, capsys: pytest.CaptureFixture[str]) -> None:
    demo = await box("tight")
    admin = proxy_of(demo).url("admin")
    rc = await asyncio.to_thread(main, ["plan", "--tenant", "ollama", "--need-gb", "15", "--admin", admin, "--json"])
    body = json.loads(capsys.readouterr().out)
    assert rc == 1 and body["plan"]["feasible"] is False, "15 GiB cannot fit a 16 GiB card with the relay and desktop"
    rc = await asyncio.to_thread(main, ["plan", "--tenant", "ollama", "--need-gb", "2", "--admin", admin])
    assert rc == 0 and "ollama" in capsys.readouterr().out


def test_plan_command_without_a_proxy_says_how_to_start_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tenant", "ollama", "--admin", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "no proxy answering" in err and "hyperswap serve" in err and "Traceback" not in err


async def test_a_second_demo_run_shows_nothing_of_the_first(http: httpx.AsyncClient) -> None:
    """Each demo run keeps its own history: what the dashboard reads (decisions, the VRAM chart's rows,
    decision ids) starts empty on the next run, whatever the first did (the same state folder)."""
    async def start() -> Demo:
        return await start_demo(fast_scenario("default"), sim_ports={"ollama": 0, "comfyui": 0},
                                proxy_ports={"ollama": 0, "comfyui": 0, "admin": 0}, watchdog=False)

    first = await start()
    try:
        await chat(first, "gemma3:27b")
        await render(first)
        admin = proxy_of(first).url("admin")
        before = (await http.get(admin + "/api/history?kind=decisions")).json()["rows"]
        assert before["decisions"], "the first run recorded no decision: the test proves nothing"
        assert "this run's own" in describe(first, "default")
    finally:
        await first.stop()
    second = await start()
    try:
        admin = proxy_of(second).url("admin")
        rows = (await http.get(admin + "/api/history?kind=vram,decisions")).json()["rows"]
        assert rows["decisions"] == [], f"the second run shows the first one's decisions: {rows['decisions'][:3]}"
        spikes = [r for r in rows["vram"] if r["tenant"] == "comfyui" and r["max_bytes"] >= 2**30]
        assert not spikes, f"the second run's chart draws the first one's ComfyUI render: {spikes[:3]}"
        await render(second)
        await chat(second, "gemma3:27b")
        ids = [d["id"] for d in (await http.get(admin + "/api/decisions")).json()["decisions"]]
        assert ids and min(ids) == 1, f"decision ids continue from the first run: {ids}"
    finally:
        await second.stop()
    assert first.workdir is not None and not first.workdir.exists(), "the first run's history was left on disk"


async def test_the_demo_terminal_gets_one_readable_line_per_decision_and_the_banner_names_the_dashboard(
        box: DemoFactory) -> None:
    demo = await box("default")
    out = io.StringIO()
    printer = DecisionPrinter(proxy_of(demo), out)
    try:
        await render(demo)
        await chat(demo, "gemma3:27b")
    finally:
        printer.close()
    lines = out.getvalue().splitlines()
    assert lines and not [x for x in lines if "{" in x], f"JSON on the demo's terminal: {lines}"
    plans = [x for x in lines if " plan " in x]
    assert len(plans) == 1 and "ollama: comfyui released (" in plans[0] and "GiB back in" in plans[0], lines
    made = [d for d in proxy_of(demo).decisions.recent() if d.kind in ("plan", "model_load", "queued", "rejection")]
    assert len(lines) == len(made), f"one line per decision: {lines} for {[(d.id, d.kind) for d in made]}"
    banner = describe(demo, "default").splitlines()
    first_url = next(x for x in banner if "http://" in x)
    assert first_url.split()[0] == "dashboard" and proxy_of(demo).url("admin") in first_url, banner


async def test_the_chat_try_line_streams_each_step_before_the_answer(box: DemoFactory) -> None:
    """The banner's chat line, run as printed (issue 41): a newcomer sees the handoff happen as
    "thinking" lines, not seconds of empty terminal then one JSON object."""
    demo = await box(fast("default", ollama={"load_gbps": 10.0}))
    line = next(x for x in describe(demo, "default").splitlines() if "/api/generate" in x)
    command = line.split("#", 1)[0].strip()
    assert "stream" not in command and command.startswith("curl -sN "), command
    run = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(run.communicate(), 60)
    parts = [json.loads(x) for x in out.splitlines()]
    thinking = [p["thinking"] for p in parts if p.get("thinking")]
    assert thinking and thinking[0].startswith("loading "), thinking
    assert parts[-1]["done"] and "".join(p.get("response", "") for p in parts), parts[-1]
