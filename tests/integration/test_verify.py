"""`hyperswap verify` against simulated boxes: it passes on the demo, and each stage's failure is
driven for real (engine down, a release that never shows on the card, out of memory, a model
larger than the card)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from boxes import DemoFactory, fast

from proxy.demo import Demo
from proxy.gpu.snapshot import GpuReadError
from proxy.verify import Options, Report, Verify, load_graph, runner, stages

EXAMPLE_GRAPH = Path(__file__).resolve().parents[2] / "examples" / "comfy_prompt.json"

# A box where an out-of-memory can be staged safely: the proxy plans 4 GiB for a ComfyUI graph whose
# checkpoint takes 6.5, and an 18 GiB model leaves 5.15 GiB free, between the two.
OOM_BOX = dict(comfyui={"checkpoints": {"sd_xl_base_1.0.safetensors": 6.5}},
               tenants={"comfyui": {"needs_vram_gb": 4.0}},
               ollama={"models": [{"name": "llama3.2:3b", "size_gb": 2.0}, {"name": "filler:18b", "size_gb": 18.0}]})
POLL_S = 0.02  # verify's waits look again this often (0.1 s by default): the simulated box answers in milliseconds


async def verify(demo: Demo, http: httpx.AsyncClient, *, yes: bool = True) -> Report:
    assert demo.proxy is not None
    return await Verify(Options(admin=demo.proxy.url("admin"), yes=yes, stage_timeout_s=60, poll_s=POLL_S), http).run()


def statuses(report: Report) -> dict[str, str]:
    return {s.name: s.status for s in report.stages}


def stage(report: Report, name: str) -> str:
    result = report.result(name)
    assert result is not None, f"no stage {name!r} in {statuses(report)}"
    return result.detail


async def test_verify_passes_on_the_demo_box_and_proves_a_reclaim(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    report = await verify(demo, http)
    assert report.passed, report.text()
    s = statuses(report)
    for name in ("proxy", "upstream ollama", "upstream comfyui", "ollama generation", "comfyui graph", "reclaim",
                 "507 too large"):
        assert s[name] == "pass", report.text()
    assert "the proxy released comfyui" in stage(report, "reclaim") and "on the GPU" in stage(report, "reclaim")
    # The demo's ComfyUI need (10 GiB) covers every graph it has: no OOM can be staged, and it says why.
    assert s["out of memory"] == "skip" and "between" in stage(report, "out of memory")
    # What verify loaded is unloaded again: nothing of Ollama's stays on the card.
    assert "unloaded what verify loaded (gemma3:27b, llama3.2:3b)" in stage(report, "restore")
    assert demo.box.ollama is not None
    await demo.box.ollama.wait_until(lambda: not demo.box.ollama.loaded(), timeout_s=10)  # type: ignore[union-attr]


async def test_without_consent_nothing_is_released(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    report = await verify(demo, http, yes=False)
    s = statuses(report)
    assert s["reclaim"] == "skip" and "--yes" in stage(report, "reclaim")
    assert s["out of memory"] == "skip" and "--yes" in stage(report, "out of memory")
    assert s["ollama generation"] == "pass" and s["comfyui graph"] == "pass"
    assert demo.proxy is not None
    assert not [d for d in demo.proxy.decisions.recent(500) if d.kind in ("release", "idle_release")
                or d.outcome.get("releases")], "verify released a tenant without consent"


async def test_an_engine_that_is_down_fails_its_stage_and_skips_what_needs_it(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.box.ollama is not None
    await demo.box.ollama.stop()
    report = await verify(demo, http)
    assert not report.passed
    down = report.result("upstream ollama")
    assert down is not None and down.status == "fail", report.text()
    assert "not answering through the proxy" in down.detail and down.fix and down.impact
    assert statuses(report)["ollama generation"] == "skip" and "not reachable" in stage(report, "ollama generation")
    assert statuses(report)["comfyui graph"] == "pass"


async def test_a_release_that_never_shows_on_the_card_fails_the_reclaim(box: DemoFactory, http: httpx.AsyncClient) -> None:
    # ComfyUI answers /free but its memory comes back only after 10 minutes; the proxy waits 0.2 s.
    demo = await box(fast("default", comfyui={"free_delay_s": 600}, tenants={"comfyui": {"release_timeout_s": 0.2}}))
    report = await verify(demo, http)
    result = report.result("reclaim")
    assert result is not None and result.status == "fail", report.text()
    assert "never showed on the card" in result.detail and "release_timeout_s" in (result.fix or "")
    assert not report.passed


async def test_an_out_of_memory_is_staged_and_the_proxy_retry_is_confirmed(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", **OOM_BOX))
    report = await verify(demo, http)
    assert statuses(report)["out of memory"] == "pass", report.text()
    detail = stage(report, "out of memory")
    assert "ran out of memory" in detail and "released ollama" in detail and "succeeded" in detail
    assert report.passed, report.text()


async def test_an_out_of_memory_the_proxy_cannot_recover_fails_the_stage(box: DemoFactory, http: httpx.AsyncClient,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    demo = await box(fast("default", **OOM_BOX))
    assert demo.box.comfyui is not None
    comfy = demo.box.comfyui
    check = comfy._check_oom

    def out_of_memory_every_time() -> None:  # every prompt after the staged one runs out of memory as well
        comfy.fail_next_prompt_with_oom()
        check()

    async def staged(v: Verify) -> str:
        with monkeypatch.context() as during_the_stage:
            during_the_stage.setattr(comfy, "_check_oom", out_of_memory_every_time)
            return await stages.check_out_of_memory(v)

    monkeypatch.setattr(runner, "STAGES", tuple((n, staged if n == "out of memory" else f) for n, f in runner.STAGES))
    report = await verify(demo, http)
    result = report.result("out of memory")
    assert result is not None and result.status == "fail", report.text()
    assert "failed too" in result.detail and "OutOfMemoryError" in result.detail, result.detail
    assert "needs_vram_gb" in (result.fix or "") and result.impact


async def test_a_model_larger_than_the_card_fails_the_generation_and_is_refused_with_507(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", ollama={"models": [{"name": "huge:70b", "size_gb": 40.0}]}))
    report = await verify(demo, http)
    gen = report.result("ollama generation")
    assert gen is not None and gen.status == "fail" and "cannot be loaded on this card" in gen.detail, report.text()
    assert "smaller model" in (gen.fix or "")
    assert statuses(report)["507 too large"] == "pass"
    assert "huge:70b (40.00 GiB)" in stage(report, "507 too large") and ": 507" in stage(report, "507 too large")
    assert not report.passed


async def test_the_cli_verifies_a_demo_box_as_a_subprocess(box: DemoFactory) -> None:
    """What CI runs: the real command line, `hyperswap verify --yes --json`, against a demo with its watchdog on."""
    demo = await box("default", watchdog=True)
    assert demo.proxy is not None
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "verify", "--admin", demo.proxy.url("admin"), "--yes", "--json",
        "--stage-timeout", "60", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, (out.decode(), err.decode())
    body = json.loads(out)
    assert body["status"] == "pass" and body["counts"]["fail"] == 0
    assert {s["name"] for s in body["stages"] if s["status"] == "pass"} >= {"proxy", "ollama generation", "comfyui graph",
                                                                              "reclaim", "507 too large"}
    assert all({"name", "status", "seconds", "detail", "impact", "fix"} <= set(s) for s in body["stages"])


async def test_the_cli_without_a_proxy_fails_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    rc = await asyncio.to_thread(main, ["verify", "--admin", "http://127.0.0.1:9", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert rc == 1 and body["status"] == "fail"
    assert [s["name"] for s in body["stages"]] == ["proxy"]
    assert "hyperswap serve" in body["stages"][0]["fix"]


async def test_what_verify_unloads_is_loaded_again_and_what_it_loads_is_unloaded(box: DemoFactory,
                                                                                 http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", **OOM_BOX))
    assert demo.box.ollama is not None
    # The user's model, loaded before verify; the out-of-memory stage has to unload it to stage the fill.
    r = await http.post(demo.box.servers["ollama"].url + "/api/generate", json={"model": "llama3.2:3b"})
    assert r.status_code == 200
    report = await verify(demo, http)
    assert statuses(report)["out of memory"] == "pass", report.text()
    assert statuses(report)["restore"] == "pass" and "loaded again llama3.2:3b" in stage(report, "restore")
    assert set(demo.box.ollama.loaded()) == {"llama3.2:3b"}, "filler:18b (verify's own load) should be gone"


async def test_without_a_gpu_reader_nothing_is_claimed_that_the_card_did_not_confirm(box: DemoFactory,
                                                                                   http: httpx.AsyncClient) -> None:
    demo = await box("default")
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")
    report = await verify(demo, http)
    s = statuses(report)
    assert s["reclaim"] == "skip" and "cannot confirm the release" in stage(report, "reclaim"), report.text()
    assert s["out of memory"] == "skip" and "not staged on a guess" in stage(report, "out of memory")
    assert "Driver/library version mismatch" in stage(report, "proxy")


async def test_the_users_own_graph_is_what_runs(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    graph = load_graph(str(EXAMPLE_GRAPH))
    report = await Verify(Options(admin=demo.proxy.url("admin"), yes=False, comfy_graph=graph, stage_timeout_s=60,
                                 poll_s=POLL_S), http).run()
    assert statuses(report)["comfyui graph"] == "pass", report.text()
    assert stage(report, "comfyui graph").startswith("your graph (sd_xl_base_1.0.safetensors) ran through")


async def test_when_no_model_needs_comfyuis_memory_the_reclaim_runs_the_other_way(box: DemoFactory,
                                                                                  http: httpx.AsyncClient) -> None:
    # third-app: every Ollama model fits beside ComfyUI's checkpoint, but the largest leaves a graph too little.
    demo = await box("third-app")
    report = await verify(demo, http)
    assert statuses(report)["reclaim"] == "pass", report.text()
    detail = stage(report, "reclaim")
    assert "a comfyui graph needed 10.00 GiB while qwen2.5:14b held the card" in detail
    assert "the proxy released ollama" in detail and "graph ran" in detail
    assert report.passed, report.text()


async def test_a_holder_whose_idle_timer_would_fire_mid_stage_is_not_used_for_the_reclaim(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    # ComfyUI's idle release fires 20 s after its last prompt: within the stage's 60 s, so a release
    # seen during the stage could be the timer's, not the handoff's.
    demo = await box(fast("default", tenants={"comfyui": {"idle_release_after_s": 20}}), watchdog=True)
    report = await verify(demo, http)
    result = report.result("reclaim")
    assert result is not None and result.status == "skip", report.text()
    assert "idle timer frees it in" in result.detail and "idle_release_after_s above 60 s" in result.detail
