"""Clients cannot tell the proxy from the engine: the same flows, direct and through the proxy, against
the simulators on one box, with the official ollama and openai clients and a websocket client
speaking ComfyUI's protocol. Only what differs between any two runs (clocks, durations, ids) is
left out of the comparison."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

import httpx
import ollama
import openai
from websockets.asyncio.client import connect as ws_connect

from proxy.demo import comfy_prompt
from tests.integration.boxes import LOOPBACK_TLS, DemoFactory, ollama_of, proxy_of

# Fields that differ between any two runs, direct or not.
VOLATILE = {"created_at", "modified_at", "expires_at", "total_duration", "load_duration", "prompt_eval_duration",
            "eval_duration", "created", "id", "system_fingerprint", "prompt_id", "sid", "timestamp"}
COUNTER = re.compile(r"\d{5}")  # ComfyUI numbers each saved image: demo_00002_.png, then demo_00003_.png


def stable(value: Any) -> Any:
    """The value with the run-specific fields removed, recursively."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: COUNTER.sub("NNNNN", v) if k == "filename" and isinstance(v, str) else stable(v)
                for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, (list, tuple)):
        return [stable(v) for v in value]
    return value


async def ollama_flows(base: str, models: dict[str, str]) -> dict[str, Any]:
    async with ollama.AsyncClient(host=base, verify=LOOPBACK_TLS) as client:
        return await _ollama_flows(client, models)


async def _ollama_flows(client: ollama.AsyncClient, models: dict[str, str]) -> dict[str, Any]:
    small, embedder = models["small"], models["embed"]
    out: dict[str, Any] = {}
    out["list"] = stable(await client.list())
    out["show"] = stable(await client.show(small))
    out["generate"] = stable(await client.generate(model=small, prompt="why is the sky blue?", stream=False))
    out["generate_stream"] = [stable(p) async for p in await client.generate(model=small, prompt="hi", stream=True)]
    messages = [{"role": "user", "content": "hello"}]
    out["chat"] = stable(await client.chat(model=small, messages=messages))
    out["chat_stream"] = [stable(c) async for c in await client.chat(model=small, messages=messages, stream=True)]
    out["embed"] = stable(await client.embed(model=embedder, input=["a", "b"]))
    out["ps"] = [m.model for m in (await client.ps()).models]
    pulled = [p async for p in await client.pull("phi3:mini", stream=True)]
    out["pull"] = [(p.status, p.digest, p.total) for p in pulled if p.completed in (None, 0, p.total)]
    out["pulled_listed"] = "phi3:mini" in {m.model for m in (await client.list()).models}
    out["delete"] = stable(await client.delete("phi3:mini"))
    try:
        await client.show("no-such-model")
    except ollama.ResponseError as exc:
        out["missing"] = (exc.status_code, exc.error)
    return out


async def openai_flows(base: str, model: str) -> dict[str, Any]:
    messages: Any = [{"role": "user", "content": "hi"}]
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
        whole = await client.chat.completions.create(model=model, messages=messages)
        stream = await client.chat.completions.create(model=model, messages=messages, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        models = await client.models.list()
    return {"whole": stable(whole), "chunks": stable(chunks), "models": sorted(m.id for m in models.data)}


def pick_models(demo: Any) -> dict[str, str]:
    config = ollama_of(demo).config.models
    chat = sorted((m for m in config if "completion" in m.capabilities), key=lambda m: m.size_bytes)[0].name
    embed = next((m.name for m in config if "embedding" in m.capabilities), chat)
    return {"small": chat, "embed": embed}


async def test_official_ollama_client_gets_the_same_answers_through_the_proxy(box: DemoFactory) -> None:
    demo = await box("default")
    models = pick_models(demo)
    direct = await ollama_flows(demo.box.servers["ollama"].url, models)
    through = await ollama_flows(proxy_of(demo).url("ollama"), models)
    assert direct["generate_stream"] and direct["pull"] and direct["missing"][0] == 404, "the flows ran"
    for key in direct:
        assert through[key] == direct[key], key


async def test_openai_client_streams_chat_completions_through_the_proxy(box: DemoFactory) -> None:
    demo = await box("default")
    model = pick_models(demo)["small"]
    direct = await openai_flows(demo.box.servers["ollama"].url, model)
    through = await openai_flows(proxy_of(demo).url("ollama"), model)
    assert len(direct["chunks"]) > 3, "a stream of several chunks"
    assert through == direct


async def comfy_frames(base: str, http: httpx.AsyncClient, graph: dict[str, Any]) -> list[Any]:
    """Every websocket frame from the socket's first to the prompt's end marker."""
    client_id = uuid.uuid4().hex
    ws_url = base.replace("http://", "ws://") + f"/ws?clientId={client_id}"
    frames: list[Any] = []
    async with ws_connect(ws_url, max_size=None) as ws:
        frames.append(json.loads(await ws.recv()))
        r = await http.post(base + "/prompt", json={"prompt": graph, "client_id": client_id})
        assert r.status_code == 200, r.text
        prompt_id = r.json()["prompt_id"]
        async with asyncio.timeout(30):
            while True:
                raw = await ws.recv()
                if isinstance(raw, bytes):
                    frames.append(("binary", raw[:4]))  # the event type; the preview image itself varies
                    continue
                message = json.loads(raw)
                frames.append(message)
                data = message.get("data", {})
                if message["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                    return frames


async def test_websocket_client_sees_the_same_comfyui_message_sequence_through_the_proxy(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    direct_base, proxy_base = demo.box.servers["comfyui"].url, proxy_of(demo).url("comfyui")
    ckpt = "sd_xl_base_1.0.safetensors"
    await comfy_frames(direct_base, http, comfy_prompt(ckpt, seed=1))  # load the checkpoint: both runs below start warm
    direct = await comfy_frames(direct_base, http, comfy_prompt(ckpt, seed=2))
    through = await comfy_frames(proxy_base, http, comfy_prompt(ckpt, seed=3))
    assert any(isinstance(f, dict) and f["type"] == "progress" for f in direct), "a sampling run with progress"
    assert stable(through) == stable(direct)


async def test_raw_answers_match_direct_byte_for_byte(box: DemoFactory, http: httpx.AsyncClient) -> None:
    # What no client library shows: status, every header (repeats and order kept) and the body bytes.
    demo = await box("default")
    ollama_direct, comfy_direct = demo.box.servers["ollama"].url, demo.box.servers["comfyui"].url
    cases: list[tuple[str, str, str, bytes | None, dict[str, str]]] = [
        ("ollama", "GET", "/", None, {}),
        ("ollama", "HEAD", "/", None, {}),
        ("ollama", "GET", "/api/version", None, {}),
        ("ollama", "GET", "/api/tags", None, {}),
        ("ollama", "POST", "/api/show", b'{"model": "no-such-model"}', {}),
        ("ollama", "POST", "/api/generate", b"{not json", {}),
        ("ollama", "GET", "/api/nothing-here", None, {}),
        ("comfyui", "GET", "/object_info/KSampler", None, {}),
        ("comfyui", "GET", "/api/features", None, {}),
        ("comfyui", "POST", "/prompt", b'{"prompt": {}}', {}),
        ("comfyui", "GET", "/view?filename=../secret", None, {}),
    ]
    for engine, method, path, body, headers in cases:
        direct_base = ollama_direct if engine == "ollama" else comfy_direct
        answers = []
        for base in (direct_base, proxy_of(demo).url(engine)):
            r = await http.request(method, base + path, content=body, headers=headers)
            answers.append((r.status_code, [(k, v) for k, v in r.headers.multi_items() if k != "date"], r.content))
        assert answers[1] == answers[0], (engine, method, path)
