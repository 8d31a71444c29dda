"""`hyperswap verify`'s stages against a faked proxy (httpx.MockTransport): each failure says what
it breaks and how to fix it; the graph it builds and the graphs it reads; the report's verdict."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config.units import GIB
from proxy.errors import HyperSwapError
from proxy.handoff.plan import Plan
from proxy.handoff.plan_json import plan_json
from proxy.verify import Options, Report, Verify, load_graph, stages
from proxy.verify.clients import minimal_graph
from proxy.verify.report import StageResult, StageSkipped, VerifyReport
from proxy.verify.session import Session

ADMIN, OLLAMA = "http://admin.test", "http://ollama.test"


def tenant_view(name: str = "ollama", *, busy: bool = False, vram: int = 0) -> dict[str, Any]:
    return {"name": name, "config": {"engine": "ollama", "listen": "127.0.0.1:11435", "upstream": "http://127.0.0.1:11434",
                                     "needs_vram_gb": 6.0, "context_allowance_gb": 1.0},
            "listening": OLLAMA, "busy": busy, "busy_reason": "1 request in flight" if busy else "idle",
            "in_flight": int(busy), "waiting": [], "vram_bytes": vram, "reclaimable": True, "idle_release_in_s": None}


def plan_answer(feasible: bool, explanation: str) -> dict[str, object]:
    """GET /api/plan's answer as the proxy writes it: ready (fits) or impossible (507)."""
    plan = Plan("ollama", GIB, 20 * GIB, 0, feasible, False, (), (), explanation, False, possible=feasible)
    return {"plan": plan_json(plan)}


class FakeBox:
    """An admin API and one Ollama behind the proxy; `answers` overrides a route's answer."""

    def __init__(self, **answers: httpx.Response) -> None:
        self.answers = answers
        self.tenants = [tenant_view()]
        self.seen: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.method} {request.url.host}{request.url.path}"
        self.seen.append(key)
        if key in self.answers:
            return self.answers[key]
        routes: dict[str, Any] = {
            "GET admin.test/api/tenants": {"tenants": self.tenants},
            "GET admin.test/api/tenants/ollama": self.tenants[0],
            "GET admin.test/api/stats": {"device": {"name": "Fake 24G", "total_bytes": 24 * GIB, "free_bytes": 20 * GIB,
                                                    "reserved_bytes": 0, "source": "nvml"}, "gpu_error": None},
            "GET admin.test/api/plan": plan_answer(False, "too large for this card")
            if float(request.url.params.get("need_gb", "0")) > 24 else plan_answer(True, "fits"),
            "GET admin.test/api/decisions": {"decisions": []},
            "GET ollama.test/api/version": {"version": "0.12.3"},
            "GET ollama.test/api/tags": {"models": [{"name": "tiny:1b", "size": GIB}]},
            "POST ollama.test/api/show": {"capabilities": ["completion"]},
            "GET ollama.test/api/ps": {"models": []},
            "POST ollama.test/api/generate": {"response": "hi", "done": True, "eval_count": 2},
        }
        if key not in routes:
            return httpx.Response(404, json={"error": f"no fake route {key}"})
        return httpx.Response(200, json=routes[key])


async def run(box: FakeBox, **options: Any) -> Report:
    async with httpx.AsyncClient(transport=httpx.MockTransport(box.handler)) as http:
        return await Verify(Options(admin=ADMIN, **options), http).run()


def result(report: Report, name: str) -> StageResult:
    found = report.result(name)
    assert found is not None, f"no stage {name}: {[s.name for s in report.stages]}"
    return found


async def test_a_fake_box_passes_what_it_can_and_skips_the_rest_with_reasons() -> None:
    report = await run(FakeBox(), yes=True)
    assert result(report, "ollama generation").status == "pass"
    assert result(report, "comfyui graph").status == "skip" and "no comfyui tenant" in result(report, "comfyui graph").detail
    assert result(report, "507 too large").status == "pass"
    assert report.passed, report.text()


async def test_no_proxy_fails_the_first_stage_and_runs_nothing_else() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
        report = await Verify(Options(admin=ADMIN), http).run()
    assert [s.name for s in report.stages] == ["proxy"] and not report.passed
    assert "hyperswap serve" in (report.stages[0].fix or "") and report.stages[0].impact


async def test_the_engine_behind_the_proxy_down_fails_upstream_with_the_proxys_fix() -> None:
    down = httpx.Response(502, json={"error": "ollama is not answering at http://127.0.0.1:11434",
                                     "fix": "start Ollama (`systemctl start ollama`)"})
    report = await run(FakeBox(**{"GET ollama.test/api/version": down}), yes=True)
    up = result(report, "upstream ollama")
    assert up.status == "fail" and "502" in up.detail and up.fix == "start Ollama (`systemctl start ollama`)"
    assert result(report, "ollama generation").status == "skip"
    assert not report.passed


async def test_an_out_of_memory_answer_fails_the_generation_with_the_allowance_fix() -> None:
    oom = httpx.Response(500, json={"error": "llama runner process has terminated: cudaMalloc failed: out of memory"})
    report = await run(FakeBox(**{"POST ollama.test/api/generate": oom}), yes=True)
    gen = result(report, "ollama generation")
    assert gen.status == "fail" and "ran out of GPU memory" in gen.detail
    assert "context_allowance_gb" in (gen.fix or "")


async def test_a_507_from_the_proxy_fails_the_generation_naming_the_fix() -> None:
    refused = httpx.Response(507, json={"error": "not enough GPU memory for ollama", "fix": "stop pid 4242"})
    report = await run(FakeBox(**{"POST ollama.test/api/generate": refused}), yes=True)
    gen = result(report, "ollama generation")
    assert gen.status == "fail" and "refused" in gen.detail and gen.fix == "stop pid 4242"


async def test_a_proxy_that_would_admit_more_than_the_card_fails_the_507_stage() -> None:
    admits = httpx.Response(200, json=plan_answer(True, "fits"))
    report = await run(FakeBox(**{"GET admin.test/api/plan": admits}), yes=True)
    too_large = result(report, "507 too large")
    assert too_large.status == "fail" and "25.00 GiB on a 24.00 GiB card" in too_large.detail


async def test_a_busy_tenant_is_never_disturbed() -> None:
    """The reclaim and OOM stages check this before they touch anything."""
    box = FakeBox()
    box.tenants = [tenant_view(busy=True)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(box.handler)) as http:
        with pytest.raises(StageSkipped) as caught:
            await Verify(Options(admin=ADMIN, yes=True, busy_wait_s=0), http).nobody_busy()
    assert "ollama (1 request in flight) busy" in caught.value.reason
    assert "never disturbs running work" in caught.value.reason


async def test_a_stage_that_loads_waits_for_a_busy_tenant_bounded_then_skips_and_later_ones_wait_no_more() -> None:
    from proxy.clock import ManualClock

    box = FakeBox()
    box.tenants = [tenant_view(busy=True)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(box.handler)) as http:
        clock = ManualClock()
        said: list[str] = []
        verify = Verify(Options(admin=ADMIN, yes=True, busy_wait_s=10, poll_s=1), http, clock=clock, say=said.append)
        waiting = asyncio.ensure_future(verify.nobody_busy())
        await clock.advance(9.0)
        assert not waiting.done(), "gave up before its 10 s"
        assert said and "waiting up to 10 s for ollama" in said[0]
        await clock.advance(2.0)
        with pytest.raises(StageSkipped) as caught:
            await waiting
        assert "still busy after 10 s" in caught.value.reason and "nothing was loaded" in caught.value.reason
        with pytest.raises(StageSkipped):  # the next stage looks once and does not wait again
            await verify.nobody_busy()
        box.tenants = [tenant_view(busy=True)]
        verify = Verify(Options(admin=ADMIN, yes=True, busy_wait_s=10, poll_s=1), http, clock=clock)
        waiting = asyncio.ensure_future(verify.nobody_busy())
        await clock.advance(3.0)
        box.tenants = [tenant_view()]  # the user's work ended: the stage goes on
        await clock.advance(1.0)
        await waiting


async def test_a_stage_that_changed_something_is_never_reported_skipped() -> None:
    async def stops_after_an_effect(v: Session) -> str:
        v.did("released comfyui")
        raise StageSkipped("the graph still fits")

    async def fails_after_an_effect(v: Session) -> str:
        v.did("generated with tiny:1b in ollama")
        from proxy.verify.report import StageFailed
        raise StageFailed("it broke", impact="i", fix="f")

    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeBox().handler)) as http:
        verify = Verify(Options(admin=ADMIN, yes=True), http)
        await verify.stage("a", stops_after_an_effect)
        await verify.stage("b", fails_after_an_effect)
        await verify.stage("c", stages.restore)
    a, b = verify.report.stages[0], verify.report.stages[1]
    assert a.status == "incomplete"
    assert a.detail == "did: released comfyui; then stopped before proving anything: the graph still fits"
    assert b.status == "fail" and b.detail == "it broke (this stage did: generated with tiny:1b in ollama)"
    assert verify.report.stages[2].status == "skip" and "did:" not in verify.report.stages[2].detail


def test_without_a_gpu_reader_the_verdict_is_verified_without_arbitration_with_its_own_exit_status() -> None:
    ok = [StageResult("proxy", "pass", 0, "ok"), StageResult("reclaim", "skip", 0, "no GPU reader")]
    assert (Report("x", ok, gpu_reader=True).verdict, Report("x", ok, gpu_reader=True).exit_code) == ("verified", 0)
    without = Report("x", ok, gpu_reader=False)
    assert (without.verdict, without.exit_code) == ("verified without arbitration (no GPU reader)", 3)
    body = VerifyReport.of(without).dump()
    assert body["status"] == "pass-without-arbitration" and body["gpu_reader"] is False
    assert without.text().endswith(": partly verified without arbitration (no GPU reader): 1 stage(s) skipped or "
                                   "incomplete: reclaim; proved: proxy"), without.text()
    failed = Report("x", [*ok, StageResult("b", "fail", 0, "bad", "i", "f")], gpu_reader=False)
    assert (failed.verdict, failed.exit_code) == ("NOT verified", 1)


def test_verify_help_documents_each_exit_status() -> None:
    from proxy.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    text = " ".join(sub.choices["verify"].format_help().split())
    assert "0 verified" in text and "3 verified without arbitration (no GPU reader" in text and "1 NOT verified" in text
    assert "--busy-wait SECONDS" in text


async def test_a_stage_that_hangs_fails_after_its_timeout() -> None:
    box = FakeBox()

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/generate":
            await asyncio.sleep(30)  # hangs: a stage that never ends (a fake; stage_timeout_s cuts it)
        return box.handler(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as http:
        report = await Verify(Options(admin=ADMIN, yes=True, stage_timeout_s=0.2), http).run()
    gen = result(report, "ollama generation")
    assert gen.status == "fail" and "did not finish within 0.2 s" in gen.detail and "--stage-timeout" in (gen.fix or "")


def test_the_minimal_graph_reads_v1_and_v3_combos_and_saves_nothing() -> None:
    info = {
        "CheckpointLoaderSimple": {"input": {"required": {"ckpt_name": [["b.safetensors", "a.safetensors"], {}]}}},
        "EmptyLatentImage": {}, "CLIPTextEncode": {}, "VAEDecode": {}, "PreviewImage": {}, "SaveImage": {},
        "KSampler": {"input": {"required": {"sampler_name": ["COMBO", {"options": ["dpmpp_2m", "euler"]}],
                                            "scheduler": ["COMBO", {"options": ["karras"]}]}}},
    }
    made, ckpt = minimal_graph(info, None, seed=7)
    graph: dict[str, Any] = made  # read as a test indexes it
    assert ckpt == "b.safetensors"
    sampler = next(n for n in graph.values() if n["class_type"] == "KSampler")["inputs"]
    assert (sampler["sampler_name"], sampler["scheduler"], sampler["steps"]) == ("euler", "karras", 1)
    assert any(n["class_type"] == "PreviewImage" for n in graph.values())
    assert minimal_graph(info, "a.safetensors", seed=7)[1] == "a.safetensors"
    with pytest.raises(LookupError, match=r"no checkpoint 'c\.safetensors'"):
        minimal_graph(info, "c.safetensors", seed=7)
    with pytest.raises(LookupError, match="KSampler"):
        minimal_graph({k: v for k, v in info.items() if k != "KSampler"}, None, seed=7)


def test_graphs_are_read_bare_or_as_a_prompt_body_and_the_ui_format_is_refused(tmp_path: Path) -> None:
    graph = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}}}
    (tmp_path / "bare.json").write_text(json.dumps(graph))
    (tmp_path / "body.json").write_text(json.dumps({"prompt": graph}))
    (tmp_path / "ui.json").write_text(json.dumps({"nodes": [], "links": [], "version": 0.4}))
    assert load_graph(str(tmp_path / "bare.json")) == graph == load_graph(str(tmp_path / "body.json"))
    with pytest.raises(HyperSwapError, match="API format") as caught:
        load_graph(str(tmp_path / "ui.json"))
    assert caught.value.fix and "Export (API)" in caught.value.fix
    with pytest.raises(HyperSwapError, match="cannot read"):
        load_graph(str(tmp_path / "missing.json"))


def test_the_verdict_needs_a_stage_that_ran_and_no_failure() -> None:
    assert not Report("x", [StageResult("a", "skip", 0, "why")]).passed
    assert Report("x", [StageResult("a", "pass", 0, "ok"), StageResult("b", "skip", 0, "why")]).passed
    failed = Report("x", [StageResult("a", "pass", 0, "ok"), StageResult("b", "fail", 0, "bad", "breaks", "fix it")])
    assert not failed.passed and VerifyReport.of(failed).dump()["counts"] == {"pass": 1, "fail": 1, "skip": 0, "incomplete": 0}
    assert "breaks: breaks" in failed.text() and "fix:    fix it" in failed.text()


@pytest.mark.parametrize("answer", [True, False])
async def test_at_a_terminal_verify_says_what_it_would_unload_and_asks(answer: bool) -> None:
    box = FakeBox()
    box.tenants = [tenant_view(vram=3 * GIB)]
    said: list[str] = []
    asked: list[str] = []

    def ask(question: str) -> bool:
        asked.append(question)
        return answer

    async with httpx.AsyncClient(transport=httpx.MockTransport(box.handler)) as http:
        report = await Verify(Options(admin=ADMIN, interactive=True), http, ask=ask, say=said.append).run()
    assert asked == ["Go ahead? [y/N] "]
    assert "ollama holds 3.00 GiB" in said[0] and "never touched" in said[0]
    reclaim = result(report, "reclaim").detail
    if answer:
        assert "no comfyui tenant" in reclaim  # past the consent check
    else:
        assert "needs consent (run with --yes)" in reclaim and said[-1].startswith("no consent")


async def test_without_a_terminal_and_without_yes_nothing_is_asked_and_releasing_stages_skip() -> None:
    asked: list[str] = []

    def ask(question: str) -> bool:
        asked.append(question)
        return True

    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeBox().handler)) as http:
        report = await Verify(Options(admin=ADMIN), http, ask=ask).run()
    assert asked == [] and "needs consent" in result(report, "out of memory").detail


async def test_an_oom_the_proxy_never_acts_on_fails_with_what_to_check() -> None:
    from proxy.clock import ManualClock
    from proxy.verify.clients import GraphRun
    from proxy.verify.report import StageFailed

    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeBox().handler)) as http:
        clock = ManualClock()
        verify = Verify(Options(admin=ADMIN), http, clock=clock)
        failed = GraphRun("p-1", False, "torch.OutOfMemoryError", "Allocation on device", "websocket")
        retry = asyncio.ensure_future(stages._judge_oom_retry(verify, tenant_info(), failed, 0, "staged", GIB))
        await clock.advance(29.0)
        assert not retry.done(), "gave up before its 30 s"
        await clock.advance(2.0)
        with pytest.raises(StageFailed) as caught:
            await retry
    assert "the proxy decided nothing" in caught.value.detail and "hyperswap check" in caught.value.fix


async def test_a_graph_that_fails_is_not_run_again_by_the_reclaim() -> None:
    from proxy.verify.clients import GraphRun

    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeBox().handler)) as http:
        verify = Verify(Options(admin=ADMIN, yes=True), http)
        failed = GraphRun("p-1", False, "torch.OutOfMemoryError", "Allocation on device", "websocket")

        async def graph(t: Any) -> tuple[dict[str, Any], str, str]:
            return {"1": {"class_type": "X", "inputs": {}}}, "x.safetensors", "your"

        class Comfy:
            async def run(self, g: Any) -> GraphRun:
                return failed

        verify.graph_for = graph  # type: ignore[method-assign]
        verify.comfy = lambda t: Comfy()  # type: ignore[assignment,method-assign,return-value]
        run, _, _ = await verify.run_graph(tenant_info())
    assert run is failed and verify.found.graph is None


def tenant_info() -> Any:
    from proxy.verify.clients import TenantInfo

    return TenantInfo.from_json(tenant_view("comfyui"))


def test_the_admin_url_comes_from_the_flag_or_the_configuration(tmp_path: Path) -> None:
    from proxy.admin.address import admin_base_url as admin_url

    assert admin_url(None, "127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert admin_url(None, "http://h:1/") == "http://h:1"
    config = tmp_path / "tenants.json"
    config.write_text(json.dumps({"admin": {"listen": "0.0.0.0:11999", "token_env": "X"}}))
    assert admin_url(str(config), None) == "http://127.0.0.1:11999"
    assert admin_url(None, None) == "http://127.0.0.1:11400"  # the shipped default
    config.write_text(json.dumps({"admin": {"listen": "[::]:11998", "token_env": "X"}}))
    assert admin_url(str(config), None) == "http://127.0.0.1:11998", "the IPv6 wildcard is not an address to call"


async def test_without_a_websocket_the_graph_is_followed_through_history() -> None:
    from contextlib import AbstractAsyncContextManager

    from proxy.clock import ManualClock
    from proxy.verify.clients import ComfyClient, WsConnection

    polls = {"n": 0}

    def comfy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/prompt":
            assert json.loads(request.content)["client_id"].startswith("hyperswap-verify-")
            return httpx.Response(200, json={"prompt_id": "p-1", "number": 0, "node_errors": {}})
        polls["n"] += 1
        if polls["n"] < 3:  # not finished yet: ComfyUI answers {} for a prompt not in its history
            return httpx.Response(200, json={})
        oom = {"prompt_id": "p-1", "exception_type": "torch.OutOfMemoryError",
               "exception_message": "Allocation on device \nThis error means"}
        return httpx.Response(200, json={"p-1": {"status": {"status_str": "error", "completed": False,
                                                            "messages": [["execution_error", oom]]}}})

    def no_ws(url: str) -> AbstractAsyncContextManager[WsConnection]:
        raise OSError("websocket refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy)) as http:
        clock = ManualClock()
        client = ComfyClient("http://comfy.test", http, no_ws, clock)
        following = asyncio.ensure_future(client.run({"1": {"class_type": "X", "inputs": {}}}))
        await clock.advance(60.0)  # the history polls, each woken in turn
        run = await following
    assert (run.ok, run.followed, run.error_type) == (False, "history", "torch.OutOfMemoryError")
    assert run.error == "Allocation on device" and polls["n"] == 3


def generic_view(ready: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"engine": "generic", "listen": "127.0.0.1:9001", "upstream": "http://127.0.0.1:9000"}
    if ready is not None:
        config |= {"ready": ready, "release": {"kind": "process", "command": ["stt"]}}
    return {"name": "stt", "config": config, "listening": "http://stt.test", "busy": False, "busy_reason": "idle",
            "in_flight": 0, "waiting": [], "vram_bytes": 0, "reclaimable": True, "idle_release_in_s": None}


async def test_a_generic_tenant_without_a_ready_path_passes_on_its_port_and_says_that_is_all_it_judged() -> None:
    box = FakeBox(**{"GET stt.test/": httpx.Response(404, text="Not Found")})
    box.tenants.append(generic_view())
    up = result(await run(box, yes=True), "upstream stt")
    assert up.status == "pass", up
    assert "accepted a connection" in up.detail and "ready.path" in up.detail, up.detail
    assert "not exercised" in up.detail, f"a 404 from GET / proves the port, not the app: {up.detail}"


async def test_a_generic_tenant_with_a_ready_path_is_judged_by_it_not_by_a_404_from_the_root() -> None:
    box = FakeBox(**{"GET stt.test/": httpx.Response(404, text="Not Found"),
                     "GET stt.test/health": httpx.Response(503, text="loading")})
    box.tenants.append(generic_view({"path": "/health", "status": 200}))
    up = result(await run(box, yes=True), "upstream stt")
    assert up.status == "fail" and "/health" in up.detail and "503" in up.detail, up

    box = FakeBox(**{"GET stt.test/health": httpx.Response(200, text="ok")})
    box.tenants.append(generic_view({"path": "/health", "status": 200}))
    up = result(await run(box, yes=True), "upstream stt")
    assert up.status == "pass" and "/health" in up.detail and "tenants.stt.ready" in up.detail, up


def test_the_verdict_line_names_what_was_proved_and_what_was_skipped() -> None:
    ran = [StageResult("proxy", "pass", 0, "ok"), StageResult("reclaim", "pass", 0, "ok")]
    assert Report("x", ran, gpu_reader=True).text().endswith(" s: verified: proxy, reclaim")
    partly = Report("x", [*ran, StageResult("out of memory", "skip", 0, "no consent"),
                          StageResult("comfyui graph", "skip", 0, "no graph")], gpu_reader=True)
    assert partly.summary == ("partly verified: 2 stage(s) skipped or incomplete: out of memory, comfyui graph; "
                              "proved: proxy, reclaim"), partly.summary
    assert partly.exit_code == 0 and VerifyReport.of(partly).dump()["summary"] == partly.summary
    failed = Report("x", [*ran, StageResult("507 too large", "fail", 0, "bad", "i", "f")], gpu_reader=True)
    assert failed.summary == "NOT verified: failed: 507 too large"


def test_the_gpu_line_says_what_is_not_known_and_a_cpu_comfyui_is_told() -> None:
    from proxy.verify.stages import gpu_text, on_cpu

    assert gpu_text({}) == "GPU not known: no GPU reader reads it and no engine reports it"
    assert "unknown" not in gpu_text({"name": None, "total_bytes": 24 * 2**30, "source": "engine-estimate"})
    assert gpu_text({"name": "RTX 4090", "total_bytes": None}) == "GPU RTX 4090 size not known"
    assert on_cpu({"devices": [{"name": "cpu", "type": "cpu"}]}) and not on_cpu({"devices": [{"type": "cuda"}]})
    assert not on_cpu({"devices": []})
