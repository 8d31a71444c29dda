"""`hyperswap verify` against simulated boxes: it passes on the demo, and each stage's failure is
driven for real (engine down, a release that never shows on the card, out of memory, a model
larger than the card)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.demo import Demo
from proxy.encoding import JSONObject
from proxy.gpu.snapshot import GpuReadError
from proxy.tasks import poll_until
from proxy.verify import Options, Report, Verify, load_graph, runner, stages
from proxy.verify.report import VerifyReport
from tests.integration.boxes import DemoFactory, comfyui_of, fast, ollama_of, proxy_of

EXAMPLE_GRAPH = Path(__file__).resolve().parents[2] / "examples" / "comfy_prompt.json"

# A box where an out-of-memory can be staged safely: the proxy plans 4 GiB for a ComfyUI graph whose
# checkpoint takes 6.5, and an 18 GiB model leaves 5.15 GiB free, between the two.
OOM_BOX: dict[str, Any] = dict(comfyui={"checkpoints": {"sd_xl_base_1.0.safetensors": 6.5}},
               tenants={"comfyui": {"needs_vram_gb": 4.0}},
               ollama={"models": [{"name": "llama3.2:3b", "size_gb": 2.0}, {"name": "filler:18b", "size_gb": 18.0}]})
POLL_S = 0.02  # verify's waits look again this often (0.1 s by default): the simulated box answers in milliseconds


async def verify(demo: Demo, http: httpx.AsyncClient, *, yes: bool = True) -> Report:
    assert demo.proxy is not None
    return await Verify(Options(admin=proxy_of(demo).url("admin"), yes=yes, stage_timeout_s=60, poll_s=POLL_S), http).run()


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
    # The demo plans 10 GiB for its flux graph, which takes 12.3 with ComfyUI's floor: only a model of 11.35 to
    # 13.65 GiB would leave free memory between the two, and the demo installs none: skipped, saying so.
    assert s["out of memory"] == "skip", report.text()
    oom = stage(report, "out of memory")
    assert "between 9.50 GiB and 11.80 GiB" in oom and "a model of more than 11.35 GiB and at most 13.65 GiB would" in oom
    assert "installed: llama3.2:3b 2.00 GiB, llama3.1:8b 4.90 GiB, qwen2.5:14b 9.00 GiB, gemma3:27b 16.20 GiB" in oom, oom
    # What verify loaded is unloaded again: nothing of Ollama's stays on the card.
    assert "unloaded what verify loaded (gemma3:27b, llama3.2:3b)" in stage(report, "restore")
    assert demo.box.ollama is not None
    await ollama_of(demo).wait_until(lambda: not ollama_of(demo).loaded(), timeout_s=10)


async def test_without_consent_nothing_is_released(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    report = await verify(demo, http, yes=False)
    s = statuses(report)
    assert s["reclaim"] == "skip" and "--yes" in stage(report, "reclaim")
    assert s["out of memory"] == "skip" and "--yes" in stage(report, "out of memory")
    assert s["ollama generation"] == "pass" and s["comfyui graph"] == "pass"
    assert demo.proxy is not None
    assert not [d for d in proxy_of(demo).decisions.recent(500) if d.kind in ("release", "idle_release")
                or d.outcome.get("releases")], "verify released a tenant without consent"


async def test_an_engine_that_is_down_fails_its_stage_and_skips_what_needs_it(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.box.ollama is not None
    await ollama_of(demo).stop()
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
    # the retry released what verify had loaded: Ollama holds what it held before, checked, so no stage is left out
    assert statuses(report)["restore"] == "pass" and stage(report, "restore").startswith("nothing to restore")
    assert report.summary.startswith("verified: "), report.summary
    assert report.passed, report.text()


async def test_an_out_of_memory_the_proxy_cannot_recover_fails_the_stage(box: DemoFactory, http: httpx.AsyncClient,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    demo = await box(fast("default", **OOM_BOX))
    assert demo.box.comfyui is not None
    comfy = demo.box.comfyui

    async def staged(v: Verify) -> str:
        comfy.fail_next_prompt_with_oom(times=1_000)  # every prompt of the stage runs out of memory, its retry too
        try:
            return await stages.check_out_of_memory(v)
        finally:
            comfy.fail_next_prompt_with_oom(times=0)

    monkeypatch.setattr(runner, "STAGES", tuple((n, staged if n == "out of memory" else f) for n, f in runner.STAGES))
    report = await verify(demo, http)
    result = report.result("out of memory")
    assert result is not None and result.status == "fail", report.text()
    assert "ran out of memory again" in result.detail, result.detail
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
        sys.executable, "-m", "proxy.cli", "verify", "--admin", proxy_of(demo).url("admin"), "--yes", "--json",
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
    assert statuses(report)["restore"] == "pass", report.text()
    assert "loaded again what ollama held before verify: llama3.2:3b" in stage(report, "restore")
    assert set(ollama_of(demo).loaded()) == {"llama3.2:3b"}, "filler:18b (verify's own load) should be gone"


async def test_without_a_gpu_reader_nothing_is_claimed_that_the_card_did_not_confirm(box: DemoFactory,
                                                                                   http: httpx.AsyncClient) -> None:
    demo = await box("default")
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")
    report = await verify(demo, http)
    s = statuses(report)
    assert s["reclaim"] == "skip" and "cannot confirm the release" in stage(report, "reclaim"), report.text()
    assert s["out of memory"] == "skip" and "not staged on a guess" in stage(report, "out of memory")
    assert "Driver/library version mismatch" in stage(report, "proxy")
    # Nothing arbitrated was proven: the verdict says so, with its own exit status, never a plain "verified".
    assert report.verdict == "verified without arbitration (no GPU reader)", report.text()
    assert report.exit_code == 3 and VerifyReport.of(report).dump()["status"] == "pass-without-arbitration"
    assert "partly verified without arbitration (no GPU reader): " in report.text().splitlines()[-1], report.text()
    # The reclaim decided to skip before it did anything: no release, no large model loaded.
    assert demo.proxy is not None
    assert not [d for d in proxy_of(demo).decisions.recent(500) if d.kind == "release"], report.text()
    assert "gemma3:27b" not in report.text(), report.text()


async def test_a_reclaim_that_cannot_be_staged_is_skipped_before_it_releases_or_loads_anything(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    # Every installed model fits beside ComfyUI's checkpoint, and beside a graph: no handoff either way.
    demo = await box(fast("default", ollama={"models": [{"name": "llama3.2:3b", "size_gb": 2.0},
                                                        {"name": "llama3.1:8b", "size_gb": 4.9}]}))
    assert demo.box.ollama is not None and demo.proxy is not None
    report = await verify(demo, http)
    assert statuses(report)["reclaim"] == "skip", report.text()
    released = [d for d in proxy_of(demo).decisions.recent(500) if d.kind == "release"]
    assert not released, f"the reclaim was reported skipped but released {[d.tenant for d in released]}: {report.text()}"
    assert "llama3.1:8b" not in stage(report, "restore"), f"a skipped reclaim loaded llama3.1:8b: {report.text()}"
    assert "fits beside" in stage(report, "reclaim")
    assert report.verdict == "verified" and report.exit_code == 0, report.text()


NO_CHECKPOINT_GRAPH: JSONObject = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
    "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}


async def test_a_graph_without_a_checkpoint_is_never_called_the_none_graph_and_restore_claims_no_checkpoint(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    report = await Verify(Options(admin=proxy_of(demo).url("admin"), yes=True, comfy_graph=NO_CHECKPOINT_GRAPH,
                                  stage_timeout_s=60, poll_s=POLL_S), http).run()
    assert statuses(report)["reclaim"] == "pass", report.text()
    assert "None" not in report.text(), report.text()
    assert "graph without a checkpoint" in stage(report, "out of memory"), report.text()
    restored = stage(report, "restore")
    assert "checkpoint again" not in restored, f"restore claims a checkpoint the graph never had: {restored}"
    # comfyui held only its floor when verify started and holds only its floor now: nothing to say about it.
    assert "comfyui" not in restored, restored


async def test_restore_says_what_it_restores_and_what_it_does_not(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    report = await verify(demo, http)
    restored = stage(report, "restore")
    # comfyui held nothing before verify and holds nothing after: restore claims nothing about it.
    assert restored == "unloaded what verify loaded (gemma3:27b, llama3.2:3b)", restored

    # The user's checkpoint on the card before verify: the reclaim releases it, and restore says it stays off.
    demo = await box("default")
    assert demo.proxy is not None
    comfy_url = next(t.url for t in (await Verify(Options(admin=proxy_of(demo).url("admin")), http).admin.tenants())
                     if t.name == "comfyui")
    r = await http.post(f"{comfy_url}/prompt", json={"prompt": load_graph(str(EXAMPLE_GRAPH)), "client_id": "user"})
    assert r.status_code == 200 and demo.box.comfyui is not None
    async with asyncio.timeout(20):  # verify itself waits for the prompt to end
        await poll_until(lambda: "sd_xl_base_1.0.safetensors" in comfyui_of(demo).loaded(), 0.01)
    report = await verify(demo, http)
    restored = stage(report, "restore")
    assert re.search(r"not restored: comfyui held \d+\.\d\d GiB when verify started and holds 0\.40 GiB now", restored), restored
    assert "checkpoint again" not in restored, restored


async def test_verify_refuses_to_load_anything_while_a_prompt_runs(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.proxy is not None and demo.box.ollama is not None and demo.box.comfyui is not None
    comfy_url = next(t.url for t in (await Verify(Options(admin=proxy_of(demo).url("admin")), http).admin.tenants())
                     if t.name == "comfyui")
    assert comfy_url
    graph: dict[str, Any] = load_graph(str(EXAMPLE_GRAPH))
    sampler = next(n for n in graph.values() if n["class_type"] == "KSampler")
    sampler["inputs"]["steps"] = 3000  # 60 s at the simulator's 0.02 s a step: it runs for the whole test
    r = await http.post(comfy_url + "/prompt", json={"prompt": graph, "client_id": "user"})
    assert r.status_code == 200, r.text
    async with asyncio.timeout(20):
        await poll_until(lambda: "sd_xl_base_1.0.safetensors" in comfyui_of(demo).loaded(), 0.01)
    loads_before = ollama_of(demo).loads
    try:
        report = await Verify(Options(admin=proxy_of(demo).url("admin"), yes=True, stage_timeout_s=60, poll_s=POLL_S,
                                      busy_wait_s=0.3), http).run()
        queue = (await http.get(comfy_url + "/queue")).json()
    finally:
        await http.post(comfy_url + "/interrupt")
    s = statuses(report)
    for name in ("ollama generation", "comfyui graph", "reclaim", "out of memory"):
        assert s[name] == "skip" and "comfyui" in stage(report, name) and "busy" in stage(report, name), report.text()
    assert ollama_of(demo).loads == loads_before, f"verify loaded an Ollama model while comfyui was busy: {report.text()}"
    assert len(queue["queue_running"]) + len(queue["queue_pending"]) == 1, f"verify queued a graph: {queue}"


async def test_verify_waits_for_a_short_prompt_then_runs(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    comfy_url = next(t.url for t in (await Verify(Options(admin=proxy_of(demo).url("admin")), http).admin.tenants())
                     if t.name == "comfyui")
    assert comfy_url
    graph: dict[str, Any] = load_graph(str(EXAMPLE_GRAPH))
    next(n for n in graph.values() if n["class_type"] == "KSampler")["inputs"]["steps"] = 25  # about 0.5 s
    r = await http.post(comfy_url + "/prompt", json={"prompt": graph, "client_id": "user"})
    assert r.status_code == 200, r.text
    report = await Verify(Options(admin=proxy_of(demo).url("admin"), yes=True, stage_timeout_s=60, poll_s=POLL_S,
                                  busy_wait_s=20), http).run()
    assert statuses(report)["ollama generation"] == "pass", report.text()


async def test_restore_loads_an_embedding_model_with_an_embed_call_and_only_what_was_loaded_before(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    embedder = {"name": "nomic-embed-text:latest", "size_gb": 0.26, "capabilities": ["embedding"]}
    demo = await box(fast("default", **(OOM_BOX | {"ollama": {"models": [*OOM_BOX["ollama"]["models"], embedder]}})))
    assert demo.box.ollama is not None
    engine = demo.box.servers["ollama"].url
    r = await http.post(engine + "/api/embed", json={"model": "nomic-embed-text:latest", "input": "hello"})
    assert r.status_code == 200, r.text
    r = await http.post(engine + "/api/generate", json={"model": "llama3.2:3b"})
    assert r.status_code == 200, r.text
    report = await verify(demo, http)
    assert statuses(report)["out of memory"] == "pass", report.text()  # it unloads every Ollama model
    assert statuses(report)["restore"] == "pass", report.text()
    assert "nomic-embed-text:latest" in stage(report, "restore")
    assert set(ollama_of(demo).loaded()) == {"llama3.2:3b", "nomic-embed-text:latest"}, report.text()


async def test_the_users_own_graph_is_what_runs(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    assert demo.proxy is not None
    graph = load_graph(str(EXAMPLE_GRAPH))
    report = await Verify(Options(admin=proxy_of(demo).url("admin"), yes=False, comfy_graph=graph, stage_timeout_s=60,
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
