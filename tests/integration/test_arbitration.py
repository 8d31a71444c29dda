"""Arbitration end to end: the proxy in front of the simulated box, real sockets, real wire formats."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from proxy.clock import ManualClock
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.demo import Demo, comfy_prompt, run_prompt
from proxy.engines import Need
from proxy.gpu.snapshot import GpuReadError
from proxy.handoff.inflight import Token
from proxy.handoff.plan import Plan
from proxy.handoff.scheduler import Admitted, Handoff
from proxy.tasks import poll_until
from tests.integration.boxes import DemoFactory, comfyui_of, decisions, fast, ollama_of, proxy_of
from tests.json_reads import DecisionRead

OOM = "llama runner process has terminated: cudaMalloc failed: out of memory"


async def generate(http: httpx.AsyncClient, demo: Demo, model: str) -> httpx.Response:
    return await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                           json={"model": model, "prompt": "hi", "stream": False})


def comfy_held(demo: Demo) -> int:
    return demo.box.gpu.used_by(comfyui_of(demo).pid or 0)


async def test_ollama_load_reclaims_an_idle_comfyui_first(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
    assert comfy_held(demo) > 11 * GIB, "ComfyUI should keep its checkpoint after the prompt (smart memory)"

    r = await generate(http, demo, "gemma3:27b")

    assert r.status_code == 200, r.text
    plan = decisions(demo, "plan", tenant="ollama")[-1]
    assert [x["tenant"] for x in plan.outcome["releases"]] == ["comfyui"]
    assert plan.outcome["releases"][0]["confirmed"] is True
    assert plan.outcome["releases"][0]["freed_bytes"] > 11 * GIB
    assert comfy_held(demo) < 0.5 * GIB, "ComfyUI keeps only its CUDA context floor"
    ps = (await http.get(demo.box.servers["ollama"].url + "/api/ps")).json()["models"]
    assert [(m["name"], m["size_vram"] == m["size"]) for m in ps] == [("gemma3:27b", True)], "loaded fully on the GPU"


async def test_chat_during_a_render_waits_for_it_and_busy_comfyui_is_never_released(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    cid = uuid.uuid4().hex
    base = proxy_of(demo).url("comfyui")
    prompt: dict[str, Any] = comfy_prompt("flux1-dev-fp8.safetensors")
    prompt["3"]["inputs"]["steps"] = 300  # ~0.6 s of sampling at the fast step time
    async with ws_connect(base.replace("http", "ws") + f"/ws?clientId={cid}") as ws:
        await ws.recv()
        queued = await http.post(base + "/prompt", json={"prompt": prompt, "client_id": cid})
        assert queued.status_code == 200
        async with asyncio.timeout(5):
            await poll_until(lambda: comfy_held(demo) >= 11 * GIB, 0.01)
        chat = asyncio.ensure_future(generate(http, demo, "gemma3:27b"))
        async with asyncio.timeout(5):
            await poll_until(lambda: [w for w in proxy_of(demo).broker.scheduler.waiting() if w["waiting_for"]])
        waiting = proxy_of(demo).broker.scheduler.waiting()[0]
        assert waiting["tenant"] == "ollama" and waiting["waiting_for"] == ["comfyui"], waiting
        assert comfyui_of(demo).frees == 0, "a busy tenant was asked to free"
        ended = False
        while not ended:
            msg = json.loads(await ws.recv())
            ended = msg["type"] == "executing" and msg["data"]["node"] is None
        r = await chat
    assert r.status_code == 200, r.text
    queued_d = decisions(demo, "queued", tenant="ollama")
    # it waited behind the render, then (the render shorter than the hold) for the rest of its swap's hold
    assert queued_d and queued_d[-1].outcome["waiting_for"] == ["comfyui"], queued_d
    assert queued_d[-1].outcome["reason"].startswith(("queued behind comfyui", "holding the swap of comfyui")), queued_d
    assert queued_d[-1].outcome["result"] == "admitted" and queued_d[-1].outcome["waited_s"] > 0
    plan = decisions(demo, "plan", tenant="ollama")[-1]
    assert [x["tenant"] for x in plan.outcome["releases"]] == ["comfyui"], "freed once the prompt had ended"
    assert queued_d[-1].outcome["ended_by"] == plan.id


async def test_higher_priority_comfyui_takes_memory_back_from_idle_ollama(box: DemoFactory, http: httpx.AsyncClient) -> None:
    sc = fast("default", tenants={"comfyui": {"priority": 60, "model_vram_gb": {"flux1-dev-fp8.safetensors": 13.5}}})
    demo = await box(sc)
    assert (await generate(http, demo, "gemma3:27b")).status_code == 200
    assert ollama_of(demo).loaded(), "gemma should be resident"

    msgs = await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)

    assert "execution_success" in [m["type"] for m in msgs], [m["type"] for m in msgs]
    plan = decisions(demo, "plan", tenant="comfyui")[-1]
    assert [x["tenant"] for x in plan.outcome["releases"]] == ["ollama"]
    assert not ollama_of(demo).loaded()


async def test_tight_card_answers_507_naming_the_unmanaged_speech_relay(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("tight")
    r = await generate(http, demo, "mistral-small:22b")
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["tenant"] == "ollama" and body["need_gb"] == pytest.approx(14.4, abs=0.01)
    relay = [b for b in body["blockers"] if b["pid"] == 4242]
    assert len(relay) == 1
    assert {k: relay[0][k] for k in ("name", "tenant", "vram_gb", "reason")} == {
        "name": "python", "tenant": "unmanaged", "vram_gb": 0.84, "reason": "unmanaged"}
    assert "stt_relay.py" in relay[0]["cmdline"]
    assert body["available_gb"] < body["need_gb"]
    assert not ollama_of(demo).loaded(), "nothing was loaded"
    assert decisions(demo, "rejection", tenant="ollama"), "the 507 is in the decision log"


async def test_oom_answer_is_reclaimed_and_retried_once(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    ollama_of(demo).fail_next_load_with(OOM)  # a foreign allocation raced the load

    r = await generate(http, demo, "llama3.1:8b")

    assert r.status_code == 200, r.text
    retry = decisions(demo, "oom_retry", tenant="ollama")
    assert retry and retry[-1].outcome.get("oom_retry") == "succeeded", [(d.outcome, d.plan) for d in retry]
    assert [x["tenant"] for x in retry[-1].outcome["releases"]] == ["comfyui"]
    assert not proxy_of(demo).broker.scheduler.standing(), \
        "both admissions (first try and retry) give their memory back"


async def test_oom_with_nothing_to_release_is_retried_once_on_a_fresh_reading(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    # The memory the first try lacked may have freed since (a foreign allocation gone): every OOM is retried.
    demo = await box("default")
    ollama_of(demo).fail_next_load_with(OOM)
    r = await generate(http, demo, "llama3.1:8b")
    assert r.status_code == 200, r.text
    retry = decisions(demo, "oom_retry", tenant="ollama")
    assert [d.outcome for d in retry] == [{"result": "succeeded"}]
    assert not proxy_of(demo).broker.scheduler.standing()


async def test_oom_with_nothing_to_release_reaches_the_client_with_blockers(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    ollama_of(demo).fail_next_load_with(OOM, times=2)
    r = await generate(http, demo, "llama3.1:8b")
    assert r.status_code == 500
    body = r.json()
    assert body["error"] == OOM, "the engine's error is passed through unchanged"
    assert {b["name"] for b in body["blockers"]} >= {"Xorg", "gnome-shell"}
    assert not proxy_of(demo).broker.scheduler.standing()


async def test_spill_to_cpu_makes_ollama_starved_and_reclaims_comfyui(box: DemoFactory, http: httpx.AsyncClient) -> None:
    clock = ManualClock(ticking=True)
    demo = await box(fast("default", settings={"proxy": {"spill_stable_s": 30.0}}), clock=clock)
    await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
    # A client talking to Ollama directly: the proxy only sees the spill afterwards.
    r = await http.post(demo.box.servers["ollama"].url + "/api/generate",
                        json={"model": "gemma3:27b", "prompt": "x", "stream": False})
    assert r.status_code == 200
    ps = (await http.get(demo.box.servers["ollama"].url + "/api/ps")).json()["models"][0]
    assert ps["size_vram"] < ps["size"], "precondition: the model spilled"

    first = await proxy_of(demo).watchdog.tick()
    assert not decisions(demo, "spill"), "a split seen once may still be a load growing: no spill yet"
    assert "a spill if it holds still" in first.reasons["ollama"], first.reasons
    await clock.advance(31.0)  # the split held still past spill_stable_s
    report = await proxy_of(demo).watchdog.tick()

    spill = decisions(demo, "spill", tenant="ollama")
    assert spill and [x["tenant"] for x in spill[-1].outcome["releases"]] == ["comfyui"], report
    assert "starved" in report.reasons["ollama"]


async def test_idle_comfyui_is_released_after_its_idle_timeout(box: DemoFactory, http: httpx.AsyncClient) -> None:
    clock = ManualClock(ticking=True)
    demo = await box(fast("default", tenants={"comfyui": {"idle_release_after_s": 30.0}}), clock=clock)
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    first = await proxy_of(demo).watchdog.tick()
    assert first.reasons["comfyui"].startswith("idle release in") or "busy" in first.reasons["comfyui"], first.reasons
    await clock.advance(31.0)

    report = await proxy_of(demo).watchdog.tick()

    assert report.reasons["comfyui"] == "released after idle timeout", report.reasons
    assert comfy_held(demo) < 0.5 * GIB
    assert decisions(demo, "idle_release", tenant="comfyui")[-1].outcome["ok"] is True
    again = await proxy_of(demo).watchdog.tick()
    assert "idle floor" in again.reasons["comfyui"], "released once, not every tick"


async def test_stale_running_entry_does_not_make_comfyui_busy(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", comfyui={"stale_running_entry": True}))
    queue = (await http.get(demo.box.servers["comfyui"].url + "/queue")).json()
    assert queue["queue_running"], "precondition: the scenario leaves a running row"
    report = await proxy_of(demo).watchdog.tick()
    view = (await http.get(proxy_of(demo).url("admin") + "/api/tenants/comfyui")).json()
    assert view["busy"] is False
    assert view["stale_jobs"] == [queue["queue_running"][0][1]]
    assert any("stale" in a for a in report.actions), report.actions


async def test_concurrent_loads_share_one_handoff(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
    frees_before = comfyui_of(demo).frees

    results = await asyncio.gather(*(generate(http, demo, "gemma3:27b") for _ in range(4)))

    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert comfyui_of(demo).frees - frees_before == 1, "ComfyUI was asked to free more than once"
    assert len([d for d in decisions(demo, "plan", tenant="ollama") if d.outcome.get("releases")]) == 1


async def test_client_leaving_during_a_release_lets_the_release_finish_and_holds_nothing(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("proxy.relay.departure.WATCH_AFTER_S", 0.0)
    demo = await box("default")
    await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
    leaving = asyncio.ensure_future(generate(http, demo, "gemma3:27b"))
    async with asyncio.timeout(10):
        # Until the handoff has started: ComfyUI is being asked to free.
        await poll_until(lambda: decisions(demo, "plan", tenant="ollama"), 0.002)
    plan = decisions(demo, "plan", tenant="ollama")[-1]
    assert "releases" not in plan.outcome, "precondition: the client leaves while the release runs"
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    broker = proxy_of(demo).broker
    def now() -> DecisionRead:  # a view is never changed: its later facts come as a new one
        view = proxy_of(demo).decisions.view(plan.id)
        assert view is not None
        return view
    async with asyncio.timeout(5):  # the release's own end: no event to wait on from here
        await poll_until(lambda: "releases" in now().outcome and not broker.scheduler.standing()
                         and not broker.scheduler.releasing, 0.01)
    assert now().outcome["releases"][0]["confirmed"] is True, "the release runs to its end and is recorded"
    assert not broker.scheduler.standing() and not broker.scheduler.releasing, \
        "a departed request holds no memory and no release"
    assert proxy_of(demo).inflight.traffic("ollama").in_flight == 0
    again = await generate(http, demo, "gemma3:27b")
    assert again.status_code == 200, again.text


async def test_each_admission_gives_back_only_its_own_reservation(box: DemoFactory) -> None:
    demo = await box("default")
    scheduler = proxy_of(demo).broker.scheduler
    plan = Plan("ollama", GIB, 0, 0, True, False, (), (), "test", True)
    admitted = Handoff(plan, [], None)
    scheduler.reserve("ollama:m", admitted)
    refused = Handoff(plan, [], None)  # same model, nothing reserved (a 507, a queue timeout)
    scheduler.settle(refused)
    assert scheduler.loading("ollama:m"), "an admission that reserved nothing takes nothing from another"
    scheduler.settle(admitted)
    scheduler.settle(admitted)
    assert not scheduler.standing(), "given back once, whoever calls again"


async def test_third_app_is_attributed_and_its_release_answers_409(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("third-app")
    admin = proxy_of(demo).url("admin")
    view = (await http.get(admin + "/api/tenants/stt")).json()
    assert view["vram_gb"] == 0.84 and [p["pid"] for p in view["processes"]] == [4242]
    r = await http.post(admin + "/api/tenants/stt/release")
    assert r.status_code == 409
    assert "no API to give memory back" in r.json()["error"] and r.json()["reason"] == "not_reclaimable"


async def test_admin_release_reports_the_bytes_freed_as_measured(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)

    dry = (await http.get(admin + "/api/plan", params={"tenant": "ollama", "need_gb": 20})).json()
    assert dry["dry_run"] and [x["tenant"] for x in dry["plan"]["releases"]] == ["comfyui"]
    assert comfy_held(demo) > 6 * GIB, "a dry run executes nothing"

    r = await http.post(admin + "/api/tenants/comfyui/release")
    assert r.status_code == 200, r.text
    assert r.json()["confirmed"] is True and r.json()["freed_gb"] == pytest.approx(6.5, abs=0.05)
    assert (await http.post(admin + "/api/tenants/nope/release")).status_code == 404
    assert (await http.get(admin + "/api/plan", params={"tenant": "ollama", "need_gb": "lots"})).status_code == 400
    log = (await http.get(admin + "/api/decisions")).json()["decisions"]
    assert log[-1]["kind"] == "release" and log[-1]["outcome"]["ok"] is True


async def test_a_failing_gpu_reader_never_stops_traffic(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    demo.box.gpu.fail_with = GpuReadError("driver_mismatch", "Driver/library version mismatch", "reboot")
    r = await generate(http, demo, "llama3.1:8b")
    assert r.status_code == 200, r.text
    stats = (await http.get(proxy_of(demo).url("admin") + "/api/stats")).json()
    assert stats["gpu_error"]["state"] == "driver_mismatch"
    assert stats["device"]["source"] == "engine-estimate"
    ollama = next(t for t in stats["tenants"] if t["name"] == "ollama")
    assert ollama["estimated"] is True and ollama["vram_gb"] > 4


async def test_admin_token_guards_release(box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", "s3cret")
    demo = await box("default")
    url = proxy_of(demo).url("admin") + "/api/tenants/comfyui/release"
    assert (await http.post(url)).status_code == 401
    assert (await http.post(url, headers={"Authorization": "Bearer wrong"})).status_code == 403
    assert (await http.post(url, headers={"Authorization": "Bearer s3cret"})).status_code == 200
    assert (await http.get(proxy_of(demo).url("admin") + "/api/tenants")).status_code == 200, "reads stay open"


def test_module_json_is_valid() -> None:
    assert json.loads(json.dumps(comfy_prompt("x")))


async def test_comfyui_oom_is_retried_under_the_clients_own_prompt_id_which_ends_success(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    # ComfyUI outranks Ollama here, and asks for little up front: the OOM is what reveals the need.
    demo = await box(fast("default", tenants={"comfyui": {"priority": 60, "needs_vram_gb": 1.0}}))
    assert (await generate(http, demo, "gemma3:27b")).status_code == 200
    comfyui_of(demo).fail_next_prompt_with_oom()
    cid = uuid.uuid4().hex
    base = proxy_of(demo).url("comfyui")
    async with ws_connect(base.replace("http", "ws") + f"/ws?clientId={cid}", max_queue=None) as ws:
        await ws.recv()
        first = (await http.post(base + "/prompt", json={"prompt": comfy_prompt("sd_xl_base_1.0.safetensors"),
                                                          "client_id": cid})).json()["prompt_id"]
        seen: list[tuple[str, str | None]] = []
        async with asyncio.timeout(15):
            while ("executing", None) not in seen:
                raw = await ws.recv()
                if isinstance(raw, bytes):
                    continue
                m = json.loads(raw)
                if m["data"].get("prompt_id") == first and m["type"] != "progress_state" and m["type"] != "progress":
                    seen.append((m["type"], m["data"].get("node", "")))
    kinds = [k for k, _ in seen]
    assert "execution_error" not in kinds, f"the client never sees the OOM of a run that is retried: {kinds}"
    assert kinds.count("execution_start") == 2 and kinds[-2:] == ["execution_success", "executing"], kinds
    assert seen.count(("executing", None)) == 1, "one end marker for the client's prompt: the retry's"
    history = (await http.get(base + f"/history/{first}")).json()[first]
    assert history["status"]["status_str"] == "success" and history["prompt"][3]["client_id"] == cid
    assert first in (await http.get(base + "/history")).json()
    retry = decisions(demo, "oom_retry", tenant="comfyui")[-1]
    assert retry.outcome["oom_retry"] == "succeeded" and retry.outcome["prompt_id"] == first, retry.outcome
    assert [x["tenant"] for x in retry.outcome["releases"]] == ["ollama"]
    assert comfyui_of(demo).executed == 2 and not proxy_of(demo).inflight.jobs("comfyui")


async def test_comfyui_oom_of_a_client_without_websocket_is_found_by_the_history_poll_and_ends_success(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    # A script that POSTs /prompt and polls /history itself: no frame ever tells the proxy of the OOM.
    demo = await box(fast("default", tenants={"comfyui": {"priority": 60, "needs_vram_gb": 1.0}}))
    assert (await generate(http, demo, "gemma3:27b")).status_code == 200
    comfyui_of(demo).fail_next_prompt_with_oom()
    base = proxy_of(demo).url("comfyui")
    first = (await http.post(base + "/prompt", json={"prompt": comfy_prompt("sd_xl_base_1.0.safetensors")})).json()["prompt_id"]
    statuses: list[str] = []

    async def history_lists_it() -> bool:
        entry = (await http.get(base + f"/history/{first}")).json().get(first)
        if entry is not None:
            statuses.append(entry["status"]["status_str"])
        return entry is not None
    def retry_ended() -> bool:  # the retry's end is a later fact of its decision, written once its job is seen done
        ended = [d for d in decisions(demo, "oom_retry", tenant="comfyui") if d.outcome.get("oom_retry")]
        return bool(ended) and ended[-1].outcome["oom_retry"] != "requeued"
    async with asyncio.timeout(15):
        await poll_until(history_lists_it, 0.02)
        await poll_until(lambda: not proxy_of(demo).inflight.jobs("comfyui"), 0.05)  # the retry is polled to its end too
    try:
        async with asyncio.timeout(10):
            await poll_until(retry_ended, 0.05)
    except TimeoutError:  # say what the decision shows, and what the client read
        kept = [d.outcome for d in decisions(demo, "oom_retry", tenant="comfyui")]
        raise AssertionError(f"the retry's end was never written: {kept}; the client read {statuses}") from None
    assert statuses == ["success"], "the client polling its own id never reads the failed run"
    retry = [d for d in decisions(demo, "oom_retry", tenant="comfyui") if d.outcome.get("oom_retry")][-1]
    assert retry.outcome["oom_retry"] == "succeeded" and retry.outcome["prompt_id"] == first, retry.outcome
    assert [x["tenant"] for x in retry.outcome["releases"]] == ["ollama"]
    assert comfyui_of(demo).executed == 2


async def test_an_idle_release_that_frees_nothing_backs_off_and_never_holds_up_a_prompt(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # A ComfyUI whose /free gives nothing back (models held by a custom node, say).
    clock = ManualClock(ticking=True)
    demo = await box(fast("default", tenants={"comfyui": {"idle_release_after_s": 0.2, "release_timeout_s": 1.0}}),
                     clock=clock)
    await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    sim = demo.box.comfyui
    monkeypatch.setattr(sim, "_apply_free", lambda: setattr(sim, "_free_flags", {}))  # flags taken, nothing freed
    watchdog = proxy_of(demo).watchdog
    await clock.advance(0.25)
    releasing = asyncio.ensure_future(watchdog.tick())  # waits its 1 s release timeout under the lock
    async with asyncio.timeout(5):
        await poll_until(lambda: bool(proxy_of(demo).broker.scheduler.releasing))
    started = asyncio.get_running_loop().time()
    queued = await http.post(proxy_of(demo).url("comfyui") + "/prompt",
                             json={"prompt": comfy_prompt("sd_xl_base_1.0.safetensors")})
    took = asyncio.get_running_loop().time() - started
    assert queued.status_code == 200, queued.text
    assert not releasing.done(), f"the prompt ({took:.2f} s) waited for the fruitless release"
    await releasing
    for n in (1, 2):
        deadline = watchdog.idle_deadline("comfyui")
        assert deadline is not None and deadline - clock.now() > 0.2 * 2 ** n - 0.15, \
            f"after {n} fruitless release(s) the next waits 0.2 s x {2 ** n}"
        if n == 2:
            break
        await clock.advance(max(0.0, deadline - clock.now()) + 0.02)
        report = await watchdog.tick()
        assert report.reasons["comfyui"] == "released after idle timeout", report.reasons
    again = await watchdog.tick()
    assert again.reasons["comfyui"].startswith("idle release in"), again.reasons
    assert len(decisions(demo, "idle_release", tenant="comfyui")) == 2


async def test_a_prompt_deleted_from_comfyuis_queue_stops_counting_as_busy(box: DemoFactory, http: httpx.AsyncClient) -> None:
    # Issue 14.1: prompt B queued behind a slow A, then deleted with the web UI's cross.
    demo = await box("default")
    base = proxy_of(demo).url("comfyui")
    slow: dict[str, Any] = comfy_prompt("sd_xl_base_1.0.safetensors")
    slow["3"]["inputs"]["steps"] = 300  # ~0.6 s
    a = (await http.post(base + "/prompt", json={"prompt": slow})).json()["prompt_id"]
    quick = comfy_prompt("sd_xl_base_1.0.safetensors", seed=7)
    b = (await http.post(base + "/prompt", json={"prompt": quick})).json()["prompt_id"]
    assert set(proxy_of(demo).inflight.jobs("comfyui")) == {a, b}
    assert (await http.post(base + "/queue", json={"delete": [b]})).status_code == 200
    async with asyncio.timeout(10):
        await poll_until(lambda: not proxy_of(demo).inflight.jobs("comfyui"), 0.02)
    lost = decisions(demo, "stale_job", tenant="comfyui")
    assert [d.outcome["job_id"] for d in lost] == [b], "A ended normally; B was in neither queue nor history"
    r = await http.post(proxy_of(demo).url("admin") + "/api/tenants/comfyui/release")
    assert r.status_code == 200, r.text


async def test_while_a_retry_waits_for_memory_the_clients_prompt_is_queued_and_unfinished(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # The retry's admission held (as if it waited in the queue for a busy tenant): what the client reads meanwhile.
    demo = await box(fast("default", tenants={"comfyui": {"priority": 60, "needs_vram_gb": 1.0}}))
    broker = proxy_of(demo).broker
    admit, go, waiting = broker.admit, asyncio.Event(), asyncio.Event()

    async def held_admit(tenant: Tenant, path: str, body: bytes, trigger: str, *, oom: bool = False,
                         work: Token | None = None, need: Need | None = None) -> tuple[Admitted, Need]:
        if oom:
            waiting.set()
            await go.wait()
        return await admit(tenant, path, body, trigger, oom=oom, work=work, need=need)
    monkeypatch.setattr(broker, "admit", held_admit)
    comfyui_of(demo).fail_next_prompt_with_oom()
    base = proxy_of(demo).url("comfyui")
    cid = uuid.uuid4().hex
    async with ws_connect(base.replace("http", "ws") + f"/ws?clientId={cid}", max_queue=None) as ws:
        await ws.recv()
        first = (await http.post(base + "/prompt", json={"prompt": comfy_prompt("sd_xl_base_1.0.safetensors"),
                                                          "client_id": cid})).json()["prompt_id"]
        async with asyncio.timeout(15):
            await waiting.wait()
            await poll_until(lambda: comfyui_of(demo).executed == 1, 0.01)  # the failed run is in ComfyUI's history
            assert (await http.get(base + f"/history/{first}")).json() == {}, "not finished, as for any queued prompt"
            assert first not in (await http.get(base + "/history")).json()
            queue = (await http.get(base + "/queue")).json()
            assert [row[1] for row in queue["queue_pending"]] == [first] and queue["queue_running"] == []
            assert queue["queue_pending"][0][3]["client_id"] == cid
            engine = (await http.get(demo.box.servers["comfyui"].url + "/queue")).json()
            assert engine["queue_pending"] == [], "the engine itself no longer has it: the proxy's view lists it"
            job = (await http.get(base + f"/api/jobs/{first}")).json()
            assert (job["id"], job["status"]) == (first, "pending"), job
            assert first not in [j["id"] for j in (await http.get(base + "/api/jobs")).json()["jobs"]]
            go.set()
            types: list[str] = []
            while "end" not in types:
                raw = await ws.recv()
                m: dict[str, Any] = json.loads(raw) if isinstance(raw, str) else {"type": "binary", "data": {}}
                if m["data"].get("prompt_id") != first:
                    continue
                if m["type"] in ("execution_error", "execution_success"):
                    types.append(m["type"])
                elif m["type"] == "executing" and m["data"].get("node") is None:
                    types.append("end")
    assert types == ["execution_success", "end"], f"the failed run's error and end never reach the client: {types}"
    assert (await http.get(base + f"/history/{first}")).json()[first]["status"]["status_str"] == "success"
    assert (await http.get(base + f"/api/jobs/{first}")).json()["status"] == "completed"
    assert [j["status"] for j in (await http.get(base + "/api/jobs")).json()["jobs"] if j["id"] == first] == ["completed"]


async def test_when_no_retry_follows_the_client_gets_the_failed_run_as_it_came(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.engines.comfyui import ComfyUIAdapter
    from proxy.engines.ports import JobReplay, Requeued

    async def refused(self: ComfyUIAdapter, client: httpx.AsyncClient, replay: JobReplay) -> Requeued:
        return Requeued(None, 500)  # ComfyUI refused the re-queue
    monkeypatch.setattr(ComfyUIAdapter, "resubmit", refused)
    demo = await box(fast("default", tenants={"comfyui": {"priority": 60, "needs_vram_gb": 1.0}}))
    comfyui_of(demo).fail_next_prompt_with_oom()
    msgs: list[dict[str, Any]] = await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    kinds = [m["type"] for m in msgs if m["type"].startswith("execution_")]
    assert kinds == ["execution_start", "execution_cached", "execution_error"], kinds
    assert msgs[-1]["type"] == "executing" and msgs[-1]["data"]["node"] is None, "its end marker follows its error"
    pid = msgs[-1]["data"]["prompt_id"]
    assert (await http.get(proxy_of(demo).url("comfyui") + f"/history/{pid}")).json()[pid]["status"]["status_str"] == "error"
    retry = decisions(demo, "oom_retry", tenant="comfyui")[-1]
    assert retry.outcome.get("oom_retry", retry.outcome.get("result")) == "re-queue refused: 500", retry.outcome
    assert comfyui_of(demo).executed == 1
