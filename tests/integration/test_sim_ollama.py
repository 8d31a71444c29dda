"""The Ollama simulator against the official clients and raw httpx: wire shapes, memory story, timers."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import httpx
import ollama
import openai
import pytest

from proxy.sim.gpu import GIB, SimulatedGpu
from proxy.sim.ollama import OllamaSim, OllamaSimConfig, SimModel
from proxy.sim.ollama_wire import parse_keep_alive
from tests.integration.boxes import LOOPBACK_TLS

LLAMA = SimModel("llama3.2:latest", 2 * GIB)
QWEN = SimModel("qwen2.5:7b", 4 * GIB, family="qwen2", parameter_size="7.6B")
EMBED = SimModel("nomic-embed-text:latest", GIB // 4, family="nomic-bert", capabilities=("embedding",))


def fast_config(**overrides: Any) -> OllamaSimConfig:
    base: dict[str, Any] = dict(models=(LLAMA, QWEN, EMBED), load_gbps=100.0, unload_delay_s=0.2,
                                   token_rate=200.0, response_tokens=6)
    base.update(overrides)
    return OllamaSimConfig(**base)


async def started(gpu: SimulatedGpu, config: OllamaSimConfig) -> tuple[OllamaSim, str]:
    sim = OllamaSim(gpu, config)
    server = await sim.start()
    return sim, server.url


@pytest.fixture
def gpu() -> SimulatedGpu:
    return SimulatedGpu(total_bytes=8 * GIB, reserved_bytes=0)


@pytest.fixture
async def sim(gpu: SimulatedGpu) -> AsyncIterator[OllamaSim]:
    s = OllamaSim(gpu, fast_config())
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def http(sim: OllamaSim) -> AsyncIterator[httpx.AsyncClient]:
    assert sim.server is not None
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=sim.server.url, timeout=10) as client:
        yield client


# The official clients are closed at teardown: an unclosed one leaves its sockets to the garbage collector.
@pytest.fixture
async def client(sim: OllamaSim) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=url(sim), verify=LOOPBACK_TLS) as c:
        yield c


@pytest.fixture
async def openai_client(sim: OllamaSim) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=url(sim) + "/v1", api_key="x") as c:
        yield c


def url(sim: OllamaSim) -> str:
    assert sim.server is not None
    return sim.server.url


# -- official ollama client -------------------------------------------------------------------------

async def test_ollama_client_lists_shows_and_generates(sim: OllamaSim, client: ollama.AsyncClient) -> None:
    listed = await client.list()
    names = {m.model for m in listed.models}
    assert names == {"llama3.2:latest", "qwen2.5:7b", "nomic-embed-text:latest"}
    shown = await client.show("llama3.2")
    assert shown.details is not None and shown.details.family == "llama"
    assert shown.capabilities == ["completion"]

    whole = await client.generate(model="llama3.2", prompt="why is the sky blue?", stream=False)
    assert whole.done and whole.done_reason == "stop" and whole.response
    assert whole.eval_count == 6 and isinstance(whole.total_duration, int)

    parts = [p async for p in await client.generate(model="llama3.2", prompt="hi", stream=True)]
    assert [p.done for p in parts] == [False] * 6 + [True], "six token chunks then one done chunk"
    assert "".join(p.response or "" for p in parts) == whole.response
    assert parts[-1].eval_count == 6 and parts[0].eval_count is None, "metrics only on the final chunk"


async def test_ollama_client_chat_ps_embed_and_unload(sim: OllamaSim, gpu: SimulatedGpu, client: ollama.AsyncClient) -> None:
    reply = await client.chat(model="llama3.2", messages=[{"role": "user", "content": "hello"}])
    assert reply.message.role == "assistant" and reply.message.content and reply.done_reason == "stop"
    chunks = [c async for c in await client.chat(model="llama3.2", messages=[{"role": "user", "content": "x"}],
                                                 stream=True)]
    assert chunks[-1].done and all(c.message.role == "assistant" for c in chunks)

    ps = await client.ps()
    assert [m.model for m in ps.models] == ["llama3.2:latest"]
    assert ps.models[0].size_vram == LLAMA.size_bytes and ps.models[0].expires_at is not None

    emb = await client.embed(model="nomic-embed-text", input=["a", "b"])
    assert len(emb.embeddings) == 2 and len(emb.embeddings[0]) == 384
    assert math.isclose(sum(v * v for v in emb.embeddings[0]), 1.0, rel_tol=1e-4), "L2-normalised"
    again = await client.embed(model="nomic-embed-text", input="a")
    assert list(again.embeddings[0]) == list(emb.embeddings[0]), "deterministic from the input"

    gone = await client.generate(model="llama3.2", keep_alive=0)
    assert gone.done_reason == "unload"
    assert sim.unload_requests == 1
    assert "llama3.2:latest" not in {m.model for m in (await client.ps()).models}


async def test_ollama_client_pull_streams_progress_and_adds_the_model(sim: OllamaSim, client: ollama.AsyncClient) -> None:
    lines = [p async for p in await client.pull("phi3:mini", stream=True)]
    statuses = [p.status for p in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    layer = next(p for p in lines if p.status and p.status.startswith("pulling ") and p.total)
    assert layer.digest and layer.digest.startswith("sha256:") and layer.status == f"pulling {layer.digest[7:19]}"
    tags = {m.model: m.size for m in (await client.list()).models}
    assert tags["phi3:mini"] == 2_200_000_000, "the simulated registry's phi3:mini"
    deleted = await client.delete("phi3:mini")
    assert deleted.status == "success"
    assert "phi3:mini" not in {m.model for m in (await client.list()).models}


async def test_pulling_a_model_the_registry_does_not_have_fails_after_the_manifest_line(
        http: httpx.AsyncClient, client: ollama.AsyncClient) -> None:
    r = await http.post("/api/pull", json={"model": "no-such-model"})
    assert (r.status_code, r.headers["content-type"]) == (200, "application/x-ndjson")
    assert [json.loads(line) for line in r.text.splitlines()] == [
        {"status": "pulling manifest"}, {"error": "pull model manifest: file does not exist"}]
    r = await http.post("/api/pull", json={"model": "no-such-model", "stream": False})
    assert (r.status_code, r.headers["content-type"]) == (500, "application/json")
    assert r.json() == {"error": "pull model manifest: file does not exist"}
    with pytest.raises(ollama.ResponseError, match="file does not exist"):
        [p async for p in await client.pull("no-such-model", stream=True)]
    assert "no-such-model:latest" not in {m["name"] for m in (await http.get("/api/tags")).json()["models"]}
    await http.post("/api/copy", json={"source": "llama3.2", "destination": "mine"})
    r = await http.post("/api/pull", json={"model": "mine", "stream": False})
    assert r.status_code == 500, "a local copy is not in the registry"
    r = await http.post("/api/pull", json={"model": "QWEN2.5:7b", "stream": False})
    assert (r.status_code, r.json(), r.headers["content-type"]) == (200, {"status": "success"}, "application/json")


def test_scenario_registry_replaces_the_default_one() -> None:
    cfg = OllamaSimConfig.from_scenario({"models": [], "registry": [{"name": "mine", "size_gb": 1.5}]})
    assert cfg.registry is not None and [(m.name, m.size_bytes) for m in cfg.registry] == [("mine:latest", int(1.5 * GIB))]


# -- official openai client -------------------------------------------------------------------------

async def test_openai_client_chat_streamed_and_not_and_models(openai_client: openai.AsyncOpenAI) -> None:
    client = openai_client
    done = await client.chat.completions.create(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
    assert done.choices[0].message.content and done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.completion_tokens == 6

    stream = await client.chat.completions.create(model="llama3.2", messages=[{"role": "user", "content": "hi"}],
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    assert roles[0] == "assistant" and all(r is None for r in roles[1:]), "role only in the first chunk"
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 6

    models = await client.models.list()
    assert {m.id for m in models.data} >= {"llama3.2:latest"} and models.data[0].owned_by == "library"


async def test_sse_framing_is_data_lines_ending_with_done(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions", json={"model": "llama3.2", "stream": True,
                                                      "messages": [{"role": "user", "content": "x"}]})
    assert r.headers["content-type"] == "text/event-stream"
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    finish = json.loads(events[-3][6:])
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]


async def test_v1_errors_use_the_openai_shape(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions", json={"model": "llama3.2", "messages": []})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "[] is too short - 'messages'", "type": "invalid_request_error",
                                  "param": None, "code": None}}
    r = await http.get("/v1/models/nope:latest")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# -- loading and memory -----------------------------------------------------------------------------

async def test_model_is_listed_in_ps_while_loading_and_nothing_written_before(gpu: SimulatedGpu) -> None:
    sim, base = await started(gpu, fast_config(load_gbps=4 * GIB / 1e9 / 0.4))  # 4 GiB in 0.4 s
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            task = asyncio.create_task(http.post("/api/generate", json={"model": "qwen2.5:7b", "prompt": "x"}))
            await sim.wait_until(lambda: "qwen2.5:7b" in sim.runners)
            ps = (await http.get("/api/ps")).json()["models"]
            assert [m["name"] for m in ps] == ["qwen2.5:7b"] and not task.done()
            assert ps[0]["size_vram"] == ps[0]["size"] == 4 * GIB, "Ollama's estimate from the start of the load"
            proc = next(p for p in gpu.read().processes if p.name == "ollama_llama_server")
            assert "runner --model /root/.ollama/models/blobs/sha256-" in proc.cmdline
            assert proc.used_bytes is not None and proc.used_bytes < 4 * GIB, "the real VRAM is still growing"
            r = await task
            assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["load_duration"] >= 0.3e9
            assert sim.loads == 1 and sim.loaded() == {"qwen2.5:7b": 4 * GIB}
    finally:
        await sim.stop()
    assert gpu.read().processes == (), "stop() kills the runner processes"


async def test_unload_replies_before_the_memory_is_back(sim: OllamaSim, http: httpx.AsyncClient,
                                                        gpu: SimulatedGpu) -> None:
    free_before = gpu.free_bytes()
    r = await http.post("/api/generate", json={"model": "llama3.2"})
    assert r.json()["done_reason"] == "load" and gpu.free_bytes() == free_before - LLAMA.size_bytes
    r = await http.post("/api/generate", json={"model": "llama3.2", "keep_alive": 0, "stream": True})
    assert r.headers["content-type"].startswith("application/json"), "one JSON object even with stream on"
    assert r.json()["done_reason"] == "unload"
    assert (await http.get("/api/ps")).json() == {"models": []}
    assert gpu.free_bytes() == free_before - LLAMA.size_bytes, "memory still held right after the reply"
    await sim.wait_until(lambda: gpu.free_bytes() == free_before)
    assert sim.loaded() == {}


async def test_unload_of_unknown_model_is_404_and_of_unloaded_model_is_a_noop(http: httpx.AsyncClient) -> None:
    r = await http.post("/api/generate", json={"model": "ghost", "keep_alive": 0})
    assert r.status_code == 404 and r.json() == {"error": "model 'ghost' not found"}
    r = await http.post("/api/chat", json={"model": "qwen2.5:7b", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"


async def test_busy_model_unloads_when_its_request_finishes(sim: OllamaSim, http: httpx.AsyncClient) -> None:
    async with http.stream("POST", "/api/generate", json={"model": "llama3.2", "prompt": "x"}) as stream:
        lines = stream.aiter_lines()
        await lines.__anext__()
        r = await http.post("/api/generate", json={"model": "llama3.2", "keep_alive": 0})
        assert r.json()["done_reason"] == "unload"
        assert "llama3.2:latest" in sim.runners, "still generating"
        rest = [json.loads(line) async for line in lines]
        assert rest[-1]["done"] is True
    await sim.wait_until(lambda: "llama3.2:latest" not in sim.runners)


async def test_spill_loads_what_fits_and_reports_size_vram_below_size(gpu: SimulatedGpu) -> None:
    foreign = gpu.spawn("python", "python main.py --listen", used_bytes=5 * GIB)  # ComfyUI, say
    sim, base = await started(gpu, fast_config())
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            r = await http.post("/api/generate", json={"model": "qwen2.5:7b", "prompt": "x", "stream": False})
            assert r.status_code == 200
            (entry,) = (await http.get("/api/ps")).json()["models"]
            assert entry["size"] == 4 * GIB and entry["size_vram"] == 3 * GIB, "spilled 1 GiB to CPU"
            assert gpu.used_by(foreign) == 5 * GIB
    finally:
        await sim.stop()


async def test_spill_layout_is_fixed_at_the_start_so_a_foreign_allocation_meanwhile_is_an_oom(
        gpu: SimulatedGpu) -> None:
    foreign = gpu.spawn("python", "python main.py --listen", used_bytes=2 * GIB)
    sim, base = await started(gpu, fast_config(load_gbps=4 * GIB / 1e9 / 0.4))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            task = asyncio.create_task(http.post("/api/generate", json={"model": "qwen2.5:7b", "prompt": "x"}))
            await sim.wait_until(lambda: "qwen2.5:7b" in sim.runners)
            (entry,) = (await http.get("/api/ps")).json()["models"]
            assert (entry["size"], entry["size_vram"]) == (4 * GIB, 4 * GIB)
            gpu.allocate(foreign, 3 * GIB)  # ComfyUI takes the room the layout counted on
            r = await task
            assert (r.status_code, r.json()) == (500, {"error": "llama runner process has terminated: "
                                                                 "cudaMalloc failed: out of memory"})
    finally:
        await sim.stop()


async def test_oom_mode_answers_500_and_the_runner_is_gone(gpu: SimulatedGpu) -> None:
    gpu.spawn("python", "python main.py", used_bytes=5 * GIB)
    sim, base = await started(gpu, fast_config(memory_short="oom"))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            r = await http.post("/api/generate", json={"model": "qwen2.5:7b", "prompt": "x"})
            assert r.status_code == 500
            assert r.json() == {"error": "llama runner process has terminated: cudaMalloc failed: out of memory"}
            assert [p.name for p in gpu.read().processes] == ["python"], "runner process gone"
            assert (await http.get("/api/ps")).json() == {"models": []}
            sim.fail_next_load_with("llama runner process has terminated: exit status 2")
            sim.set_memory_short("spill")
            r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x"})
            assert r.status_code == 500 and r.json()["error"].endswith("exit status 2")
            r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x"})
            assert r.status_code == 200, "only the next load fails"
    finally:
        await sim.stop()


async def test_eviction_picks_shortest_keep_alive_then_name_not_lru(gpu: SimulatedGpu) -> None:
    gpu6 = SimulatedGpu(total_bytes=7 * GIB, reserved_bytes=0)
    models = (SimModel("a:latest", 2 * GIB), SimModel("b:latest", 2 * GIB), SimModel("c:latest", 2 * GIB),
              SimModel("d:latest", 2 * GIB))
    sim, base = await started(gpu6, fast_config(models=models))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            await http.post("/api/generate", json={"model": "a", "keep_alive": "1h"})
            await http.post("/api/generate", json={"model": "b", "keep_alive": "10m"})
            await http.post("/api/generate", json={"model": "c", "keep_alive": "10m"})
            await http.post("/api/generate", json={"model": "b"})  # most recently used, keep_alive sticks at 10m
            await http.post("/api/generate", json={"model": "d"})
            names = sorted(m["name"] for m in (await http.get("/api/ps")).json()["models"])
            assert names == ["a:latest", "c:latest", "d:latest"], "b evicted: shortest keep_alive, first by name"
    finally:
        await sim.stop()


async def test_max_loaded_models_is_enforced_by_eviction(gpu: SimulatedGpu) -> None:
    sim, base = await started(gpu, fast_config(max_loaded_models=1))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            await http.post("/api/generate", json={"model": "llama3.2"})
            r = await http.post("/api/embed", json={"model": "nomic-embed-text", "input": []})
            assert r.json() == {"model": "nomic-embed-text", "embeddings": []}, "empty input only loads"
            assert [m["name"] for m in (await http.get("/api/ps")).json()["models"]] == ["nomic-embed-text:latest"]
    finally:
        await sim.stop()


async def test_num_parallel_one_serialises_generations(gpu: SimulatedGpu) -> None:
    sim, base = await started(gpu, fast_config(token_rate=50.0, response_tokens=500))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            async with http.stream("POST", "/api/generate", json={"model": "llama3.2", "prompt": "x"}) as stream:
                await stream.aiter_lines().__anext__()
                second = asyncio.create_task(http.post("/api/generate", json={
                    "model": "llama3.2", "prompt": "y", "stream": False, "options": {"num_predict": 1}}))
                runner = sim.runners["llama3.2:latest"]
                await sim.wait_until(lambda: runner.refs == 2)
                assert runner.sem.locked() and not second.done(), "second waits for the only slot"
            r = await second  # the first one's client went away, freeing the slot
            assert r.status_code == 200 and r.json()["done_reason"] == "length"
    finally:
        await sim.stop()


# -- keep_alive -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "seconds"), [
    (300, 300.0), (0.5, 0.5), (-1, math.inf), ("10m", 600.0), ("1h30m", 5400.0), ("0", 0.0), ("0s", 0.0),
    ("-1m", math.inf), (None, None),
])
def test_keep_alive_accepted_values(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize(("value", "message"), [
    ("300", 'time: missing unit in duration "300"'), ("-1", 'time: missing unit in duration "-1"'),
    ("5d", 'time: unknown unit "d" in duration "5d"'), (True, "Unsupported type: 'bool'"),
    ([1], "Unsupported type: '[]interface {}'"),
])
async def test_bad_keep_alive_is_400_with_gos_message(http: httpx.AsyncClient, value: object, message: str) -> None:
    r = await http.post("/api/generate", json={"model": "llama3.2", "keep_alive": value})
    assert r.status_code == 400 and r.json() == {"error": message}


async def test_keep_alive_is_sticky_and_expiry_unloads(sim: OllamaSim, http: httpx.AsyncClient,
                                                       gpu: SimulatedGpu) -> None:
    await http.post("/api/generate", json={"model": "llama3.2", "keep_alive": -1})
    await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x"})
    (entry,) = (await http.get("/api/ps")).json()["models"]
    assert datetime.fromisoformat(entry["expires_at"]).year >= 2318, "forever sticks after a plain request"
    await http.post("/api/generate", json={"model": "llama3.2", "keep_alive": 0.3})
    (entry,) = (await http.get("/api/ps")).json()["models"]
    assert datetime.fromisoformat(entry["expires_at"]).year < 2300
    await sim.wait_until(lambda: sim.loaded() == {})
    assert gpu.free_bytes() == gpu.total_bytes


# -- request decoding (Go's encoding/json) ----------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "message"), [
    ("/api/generate", {"model": "llama3.2", "prompt": 5},
     "json: cannot unmarshal number into Go struct field GenerateRequest.prompt of type string"),
    ("/api/generate", {"model": "llama3.2", "stream": "no"},
     "json: cannot unmarshal string into Go struct field GenerateRequest.stream of type bool"),
    ("/api/generate", {"model": "llama3.2", "context": [1, 2.5]},
     "json: cannot unmarshal number 2.5 into Go struct field GenerateRequest.context of type int"),
    ("/api/generate", {"model": "llama3.2", "options": [1]},
     "json: cannot unmarshal array into Go struct field GenerateRequest.options of type map[string]interface {}"),
    ("/api/generate", [{"model": "llama3.2"}], "json: cannot unmarshal array into Go value of type api.GenerateRequest"),
    ("/api/generate", {"model": "llama3.2", "prompt": 5, "keep_alive": "5d"}, 'time: unknown unit "d" in duration "5d"'),
    ("/api/generate", {"model": "llama3.2", "think": "max"},
     'invalid think value: "max" (must be "high", "medium", "low", true, or false)'),
    ("/api/generate", {"model": "llama3.2", "think": 1}, 'think must be a boolean or string ("high", "medium", "low")'),
    ("/api/chat", {"model": "llama3.2", "messages": [{"role": "user", "content": 5}]},
     "json: cannot unmarshal number into Go struct field ChatRequest.messages.content of type string"),
    ("/api/chat", {"model": "llama3.2", "messages": "hi"},
     "json: cannot unmarshal string into Go struct field ChatRequest.messages of type []api.Message"),
    ("/api/chat", {"model": "llama3.2", "messages": ["hi"]},
     "json: cannot unmarshal string into Go struct field ChatRequest.messages of type api.Alias"),
    ("/api/chat", {"model": "llama3.2", "tools": [{"function": {"name": 5}}]},
     "json: cannot unmarshal number into Go struct field ToolFunction.tools.function.name of type string"),
    ("/api/embed", {"model": "nomic-embed-text", "input": "x", "dimensions": "8"},
     "json: cannot unmarshal string into Go struct field EmbedRequest.dimensions of type int"),
    ("/api/embeddings", {"model": "nomic-embed-text", "prompt": ["x"]},
     "json: cannot unmarshal array into Go struct field EmbeddingRequest.prompt of type string"),
    ("/api/pull", {"model": 5}, "json: cannot unmarshal number into Go struct field PullRequest.model of type string"),
    ("/api/show", {"model": True}, "json: cannot unmarshal bool into Go struct field ShowRequest.model of type string"),
    ("/api/copy", {"source": "llama3.2", "destination": {}},
     "json: cannot unmarshal object into Go struct field CopyRequest.destination of type string"),
])
async def test_wrong_json_types_are_400_with_gos_unmarshal_text(sim: OllamaSim, http: httpx.AsyncClient, path: str,
                                                               body: object, message: str) -> None:
    r = await http.post(path, json=body)
    assert (r.status_code, r.json()) == (400, {"error": message})
    assert sim.loads == 0


async def test_keys_match_case_insensitively_and_bytes_after_the_json_are_ignored(http: httpx.AsyncClient) -> None:
    r = await http.post("/api/generate", json={"Model": "llama3.2", "PROMPT": "hi", "Stream": False})
    assert r.status_code == 200 and r.json()["done_reason"] == "stop" and r.json()["model"] == "llama3.2"
    r = await http.post("/api/generate", content=b'{"model": "llama3.2", "stream": false, "prompt": "x"} trailing')
    assert r.status_code == 200 and r.json()["response"]
    r = await http.post("/api/generate", content=b"null")
    assert (r.status_code, r.json()) == (404, {"error": "model '' not found"}), "null decodes to the zero request"


# -- capabilities -----------------------------------------------------------------------------------

async def test_think_on_a_model_without_thinking_is_400_before_loading(sim: OllamaSim, http: httpx.AsyncClient) -> None:
    r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x", "think": True})
    assert (r.status_code, r.json()) == (400, {"error": "registry.ollama.ai/library/llama3.2:latest does not support thinking"})
    r = await http.post("/api/chat", json={"model": "llama3.2", "think": True})
    assert r.status_code == 400 and r.json()["error"].endswith(" does not support thinking"), "load-only too"
    r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x", "think": "high"})
    assert (r.status_code, r.json()) == (400, {"error": 'think value "high" is not supported for this model'})
    assert sim.loads == 0
    r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x", "think": False, "stream": False})
    assert r.status_code == 200, "think false is fine"


async def test_missing_capabilities_are_joined_and_completion_comes_first(http: httpx.AsyncClient) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = await http.post("/api/chat", json={"model": "llama3.2", "messages": [{"role": "user", "content": "x"}],
                                           "tools": tools, "think": True})
    assert r.json() == {"error": "registry.ollama.ai/library/llama3.2:latest does not support tools\nthinking"}
    r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x", "suffix": "y"})
    assert r.json() == {"error": "registry.ollama.ai/library/llama3.2:latest does not support insert"}
    r = await http.post("/api/generate", json={"model": "nomic-embed-text", "prompt": "x", "think": True})
    assert r.json() == {"error": '"nomic-embed-text" does not support generate'}


async def test_a_thinking_model_accepts_think(gpu: SimulatedGpu) -> None:
    qwen3 = SimModel("qwen3:8b", GIB, family="qwen3", capabilities=("completion", "thinking"))
    sim, base = await started(gpu, fast_config(models=(qwen3,)))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            r = await http.post("/api/chat", json={"model": "qwen3:8b", "think": True, "stream": False,
                                                   "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200 and r.json()["done_reason"] == "stop"
    finally:
        await sim.stop()


async def test_chat_unloads_for_any_keep_alive_under_a_second_generate_only_for_zero(http: httpx.AsyncClient) -> None:
    assert (await http.post("/api/chat", json={"model": "llama3.2", "keep_alive": 0.5})).json()["done_reason"] == "unload"
    r = await http.post("/api/generate", json={"model": "llama3.2", "keep_alive": 0.5})
    assert r.json()["done_reason"] == "load", "GenerateHandler tests the duration for exactly 0"


# -- streaming edge cases ---------------------------------------------------------------------------

async def test_error_after_first_chunk_is_an_error_line_without_done(sim: OllamaSim,
                                                                     http: httpx.AsyncClient) -> None:
    sim.fail_next_stream_with("an error was encountered while running the model", after_chunks=2)
    r = await http.post("/api/generate", json={"model": "llama3.2", "prompt": "x"})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert [line.get("done") for line in lines] == [False, False, None]
    assert lines[-1] == {"error": "an error was encountered while running the model"}


async def test_client_disconnect_stops_generation(gpu: SimulatedGpu) -> None:
    sim, base = await started(gpu, fast_config(token_rate=50.0, response_tokens=500))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            async with http.stream("POST", "/api/generate", json={"model": "llama3.2", "prompt": "x"}) as stream:
                lines = stream.aiter_lines()
                await lines.__anext__()
                await lines.__anext__()
            await sim.wait_until(lambda: sim.cancellations == 1, timeout_s=1.0)
            runner = sim.runners["llama3.2:latest"]
            assert runner.refs == 0 and runner.timer is not None, "idle again, keep-alive timer running"
    finally:
        await sim.stop()


# -- headers, routing, empty bodies -----------------------------------------------------------------

async def test_public_host_gets_403_with_empty_body(http: httpx.AsyncClient) -> None:
    r = await http.get("/api/tags", headers={"Host": "llm.example.com"})
    assert r.status_code == 403 and r.content == b""
    for ok in ("localhost:11434", "box.local", "10.1.2.3", "[::1]:11434", "gpu.internal"):
        assert (await http.get("/api/version", headers={"Host": ok})).status_code == 200, ok


async def test_foreign_origin_gets_403_and_allowed_origin_gets_cors(http: httpx.AsyncClient) -> None:
    r = await http.get("/api/tags", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.content == b""
    r = await http.get("/api/tags", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    host = http.base_url.netloc.decode()
    assert (await http.get("/api/tags", headers={"Origin": f"http://{host}"})).status_code == 200
    r = await http.options("/api/chat", headers={"Origin": "app://desktop", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 204


async def test_unknown_path_and_wrong_method_bodies(http: httpx.AsyncClient) -> None:
    r = await http.get("/api/nothing")
    assert (r.status_code, r.text, r.headers["content-type"]) == (404, "404 page not found", "text/plain; charset=utf-8")
    r = await http.get("/api/generate")
    assert (r.status_code, r.text) == (405, "405 method not allowed")
    assert (await http.get("/")).text == "Ollama is running"
    assert (await http.head("/")).status_code == 200
    assert (await http.get("/api/version")).json() == {"version": "0.12.3"}


async def test_a_trailing_slash_redirects_like_gin_301_for_get_307_otherwise(http: httpx.AsyncClient) -> None:
    r = await http.get("/api/tags/")
    assert (r.status_code, r.headers["location"], r.headers["content-type"]) == (301, "/api/tags", "text/html; charset=utf-8")
    assert r.text == '<a href="/api/tags">Moved Permanently</a>.\n\n'
    r = await http.post("/api/generate/", json={"model": "llama3.2"})
    assert (r.status_code, r.headers["location"], r.content) == (307, "/api/generate", b"")
    assert "content-type" not in r.headers
    r = await http.head("/api/version/")
    assert (r.status_code, r.headers["location"], r.headers["content-type"]) == (307, "/api/version", "text/html; charset=utf-8")
    r = await http.get("/v1/models/llama3.2:latest/", params={"x": "1"})
    assert (r.status_code, r.headers["location"]) == (301, "/v1/models/llama3.2:latest?x=1")
    followed = await http.post("/api/generate/", json={"model": "llama3.2"}, follow_redirects=True)
    assert followed.json()["done_reason"] == "load", "307 keeps the method and the body"


async def test_trailing_slash_redirect_comes_before_the_host_check_and_takes_a_forwarded_prefix(
        http: httpx.AsyncClient) -> None:
    r = await http.get("/api/tags/", headers={"Host": "llm.example.com"})
    assert r.status_code == 301, "the router redirects before any middleware runs"
    r = await http.get("/api/tags/", headers={"X-Forwarded-Prefix": "/ollama/"})
    assert r.headers["location"] == "/ollama/api/tags"
    r = await http.get("/api/generate/")
    assert (r.status_code, r.text) == (404, "404 page not found"), "not routed for GET even without the slash"
    assert (await http.get("/api/nothing/")).status_code == 404


async def test_delete_and_copy_answer_empty_200(http: httpx.AsyncClient) -> None:
    r = await http.post("/api/copy", json={"source": "llama3.2", "destination": "mine"})
    assert r.status_code == 200 and r.content == b""
    r = await http.request("DELETE", "/api/delete", json={"model": "mine"})
    assert r.status_code == 200 and r.content == b""
    r = await http.request("DELETE", "/api/delete", json={"model": "mine"})
    assert r.status_code == 404 and r.json() == {"error": "model 'mine' not found"}
    r = await http.request("DELETE", "/api/delete")
    assert r.status_code == 400 and r.json() == {"error": "missing request body"}
    r = await http.post("/api/copy", json={"source": "ghost", "destination": "x"})
    assert r.status_code == 404 and r.json() == {"error": 'model "ghost" not found'}


async def test_blob_upload_checks_the_digest(http: httpx.AsyncClient) -> None:
    import hashlib
    data = b"gguf" * 1000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert (await http.head(f"/api/blobs/{digest}")).status_code == 404
    r = await http.post(f"/api/blobs/{digest}", content=data)
    assert r.status_code == 201
    assert (await http.head(f"/api/blobs/{digest}")).status_code == 200
    wrong = "sha256:" + "0" * 64
    r = await http.post(f"/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and r.json()["error"] == f'digest mismatch, expected "{wrong}", got "{digest}"'


async def test_tags_shape_digest_and_local_time(http: httpx.AsyncClient) -> None:
    models = (await http.get("/api/tags")).json()["models"]
    entry = next(m for m in models if m["name"] == "llama3.2:latest")
    assert len(entry["digest"]) == 64 and all(c in "0123456789abcdef" for c in entry["digest"])
    assert datetime.fromisoformat(entry["modified_at"]).tzinfo is not None
    assert entry["details"]["format"] == "gguf" and entry["size"] == LLAMA.size_bytes


async def test_show_omits_what_is_empty(http: httpx.AsyncClient) -> None:
    shown = (await http.post("/api/show", json={"model": "llama3.2"})).json()
    assert list(shown) == ["modelfile", "parameters", "template", "details", "model_info", "capabilities",
                           "modified_at"], "omitempty: no license, no tensors"


async def test_embedding_only_model_refuses_generate(http: httpx.AsyncClient) -> None:
    r = await http.post("/api/generate", json={"model": "nomic-embed-text", "prompt": "x"})
    assert r.status_code == 400 and r.json() == {"error": '"nomic-embed-text" does not support generate'}


def test_scenario_section_in_gib_and_unknown_keys_rejected() -> None:
    cfg = OllamaSimConfig.from_scenario({"models": [{"name": "llama3.1:8b", "size_gb": 4.9}], "load_gbps": 2.0,
                                         "memory_short": "oom"})
    assert cfg.models[0].size_bytes == int(4.9 * GIB) and cfg.memory_short == "oom"
    assert OllamaSimConfig.from_scenario({"models": [{"name": "phi3", "size_gb": 1}]}).models[0].name == "phi3:latest"
    with pytest.raises(ValueError, match="load_gbs"):
        OllamaSimConfig.from_scenario({"models": [], "load_gbs": 2.0})


async def test_legacy_embeddings_and_v1_completions_embeddings_model(http: httpx.AsyncClient) -> None:
    legacy = (await http.post("/api/embeddings", json={"model": "nomic-embed-text", "prompt": "x"})).json()
    assert list(legacy) == ["embedding"] and len(legacy["embedding"]) == 384
    assert (await http.post("/api/embeddings", json={"model": "nomic-embed-text"})).json() == {"embedding": []}
    done = (await http.post("/v1/completions", json={"model": "llama3.2", "prompt": "x", "max_tokens": 2})).json()
    assert done["object"] == "text_completion" and done["choices"][0]["finish_reason"] == "length"
    vecs = (await http.post("/v1/embeddings", json={"model": "nomic-embed-text", "input": ["a", "b"]})).json()
    assert [d["index"] for d in vecs["data"]] == [0, 1] and vecs["object"] == "list"
    one = (await http.get("/v1/models/llama3.2:latest")).json()
    assert one["id"] == "llama3.2:latest" and one["object"] == "model" and one["owned_by"] == "library"


async def test_pending_queue_overflow_is_503(gpu: SimulatedGpu) -> None:
    sim, base = await started(gpu, fast_config(max_queue=1, load_gbps=4 * GIB / 1e9 / 0.5))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=base, timeout=10) as http:
            first = asyncio.create_task(http.post("/api/generate", json={"model": "qwen2.5:7b"}))
            await sim.wait_until(lambda: "qwen2.5:7b" in sim.runners)
            r = await http.post("/api/generate", json={"model": "llama3.2"})
            assert r.status_code == 503
            assert r.json() == {"error": "server busy, please try again.  maximum pending requests exceeded"}
            assert (await first).json()["done_reason"] == "load"
    finally:
        await sim.stop()


async def test_another_num_ctx_reloads_the_model_and_ps_reports_its_context_and_size(
        sim: OllamaSim, http: httpx.AsyncClient) -> None:
    """needsReload (wire facts A.11): a request whose runner options differ from the loaded runner's
    reloads it; /api/ps reports the runner's context_length and its size with the bigger KV cache.
    Options that are not runner options, and num_gpu below 0, reuse the runner."""
    async def ps() -> dict[str, object]:
        (row,) = (await http.get("/api/ps")).json()["models"]
        return dict(row)

    assert (await http.post("/api/generate", json={"model": "llama3.2", "prompt": "hi", "stream": False})).status_code == 200
    default = await ps()
    assert default["context_length"] == 4096 and default["size"] == 2 * GIB and sim.loads == 1
    for options in ({"temperature": 0.1}, {"num_gpu": -1}, {"num_ctx": 4096}):
        await http.post("/api/generate", json={"model": "llama3.2", "prompt": "hi", "stream": False, "options": options})
        assert sim.loads == 1, f"{options} reloaded the model"
    await http.post("/api/generate", json={"model": "llama3.2", "prompt": "hi", "stream": False,
                                           "options": {"num_ctx": 8192}})
    bigger = await ps()
    assert sim.loads == 2 and bigger["context_length"] == 8192
    assert bigger["size"] == 2 * GIB + 4096 * fast_config().kv_bytes_per_token
    await http.post("/api/chat", json={"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}],
                                       "stream": False})
    assert sim.loads == 3 and (await ps())["context_length"] == 4096, "a default request after it reloads again"


async def test_a_copy_keeps_the_digest_and_a_copy_over_a_loaded_name_reloads_it(
        sim: OllamaSim, http: httpx.AsyncClient) -> None:
    """A copy is the same manifest under another name (same digest in /api/tags); a name copied over
    is other content: its next request loads the new model, and /api/ps shows the digest loaded."""
    def digests(listing: httpx.Response) -> dict[str, str]:
        return {m["name"]: m["digest"] for m in listing.json()["models"]}

    await http.post("/api/generate", json={"model": "llama3.2", "prompt": "hi", "stream": False})
    before = digests(await http.get("/api/tags"))
    assert (await http.post("/api/copy", json={"source": "qwen2.5:7b", "destination": "llama3.2"})).status_code == 200
    after = digests(await http.get("/api/tags"))
    assert after["llama3.2:latest"] == after["qwen2.5:7b"] != before["llama3.2:latest"]
    assert digests(await http.get("/api/ps")) == {"llama3.2:latest": before["llama3.2:latest"]}, \
        "the runner loaded before the copy is the old content"
    await http.post("/api/generate", json={"model": "llama3.2", "prompt": "hi", "stream": False})
    assert sim.loads == 2
    (row,) = (await http.get("/api/ps")).json()["models"]
    assert row["digest"] == after["qwen2.5:7b"] and row["size"] == 4 * GIB
