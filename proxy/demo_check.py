"""The demo's self-test (`hyperswap demo --check`): every simulator route through the proxy, then the
handoffs that matter (a chat during a render, a render after a chat, releases, a 507 naming its
blockers, a tenant the proxy stops and starts). The end-to-end check of a real proxy and its engines is
`hyperswap verify` (proxy/verify/); this one knows the simulated box and reads it directly.

Loaded only by `hyperswap demo --check` (cli.py hands `self_test` to the demo's runner), so the
simulators stay out of every other command.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx

from proxy.config.units import GIB
from proxy.demo import Demo, engine_card, run_prompt
from proxy.encoding import JSONValue
from proxy.handoff.decision_json import Decision
from proxy.handoff.decisions import DecisionView
from proxy.lifecycle.state import TenantLifecycle
from proxy.relay.refusals import NotEnoughMemory
from proxy.tasks import poll_until
from proxy.tls import client_context

Check = Callable[[], Awaitable[str]]


async def self_test(demo: Demo) -> list[tuple[str, bool, str]]:
    """Each check's name, whether it passed, and what it saw (or why it failed)."""
    results: list[tuple[str, bool, str]] = []
    async with httpx.AsyncClient(timeout=60.0, trust_env=False, verify=client_context()) as client:
        for name, fn in [*_ollama_routes(demo, client), *_comfyui_routes(demo, client), *_proxy_checks(demo, client)]:
            try:
                results.append((name, True, await fn()))
            except Exception as exc:  # the report says what failed, never a traceback
                results.append((name, False, f"{type(exc).__name__}: {exc}"))
    return results


def expect(r: httpx.Response, status: int = 200) -> httpx.Response:
    if r.status_code != status:
        raise AssertionError(f"{r.request.method} {r.request.url.path} answered {r.status_code}: {r.text[:160]}")
    return r


def _ollama_routes(demo: Demo, client: httpx.AsyncClient) -> list[tuple[str, Check]]:
    """Every Ollama route the simulator serves, asked directly."""
    if not demo.box.ollama:
        return []
    o = demo.box.servers["ollama"].url
    models = demo.box.ollama.config.models
    small = min(models, key=lambda m: m.size_bytes).name
    chat_model = next(m.name for m in sorted(models, key=lambda m: m.size_bytes) if "completion" in m.capabilities)
    embed_model = next((m.name for m in models if "embedding" in m.capabilities), small)

    async def o_root() -> str:
        return expect(await client.get(o + "/")).text

    async def o_version() -> str:
        return str(expect(await client.get(o + "/api/version")).json()["version"])

    async def o_tags() -> str:
        return f"{len(expect(await client.get(o + '/api/tags')).json()['models'])} models"

    async def o_generate() -> str:
        r = expect(await client.post(o + "/api/generate", json={"model": chat_model, "prompt": "hi"}))
        lines = [json.loads(x) for x in r.text.splitlines() if x]
        assert lines[-1]["done"] is True, lines[-1]
        return f"{len(lines)} NDJSON lines"

    async def o_chat() -> str:
        r = expect(await client.post(o + "/api/chat", json={"model": chat_model, "stream": False,
                                                            "messages": [{"role": "user", "content": "hi"}]}))
        return str(r.json()["message"]["content"])[:30]

    async def o_ps() -> str:
        return ", ".join(m["name"] for m in expect(await client.get(o + "/api/ps")).json()["models"])

    async def o_show() -> str:
        shown = expect(await client.post(o + "/api/show", json={"model": chat_model})).json()
        return ",".join(shown.get("capabilities", []))

    async def o_embed() -> str:
        r = expect(await client.post(o + "/api/embed", json={"model": embed_model, "input": "hi"}))
        return f"dim {len(r.json()['embeddings'][0])}"

    async def o_v1() -> str:
        r = expect(await client.post(o + "/v1/chat/completions", json={
            "model": chat_model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}))
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-80:]
        return f"{r.text.count('data: ')} SSE events"

    async def o_models() -> str:
        return f"{len(expect(await client.get(o + '/v1/models')).json()['data'])} models"

    async def o_pull_copy_delete() -> str:
        r = expect(await client.post(o + "/api/pull", json={"model": "tinyllama:1.1b"}))
        assert json.loads(r.text.splitlines()[-1])["status"] == "success"
        expect(await client.post(o + "/api/copy", json={"source": "tinyllama:1.1b", "destination": "tiny-copy"}))
        expect(await client.request("DELETE", o + "/api/delete", json={"model": "tiny-copy"}))
        expect(await client.request("DELETE", o + "/api/delete", json={"model": "tinyllama:1.1b"}))
        return "pull, copy, delete"

    async def o_unload() -> str:
        r = expect(await client.post(o + "/api/generate", json={"model": chat_model, "keep_alive": 0}))
        return str(r.json()["done_reason"])

    return [("ollama GET /", o_root), ("ollama /api/version", o_version), ("ollama /api/tags", o_tags),
                ("ollama /api/generate", o_generate), ("ollama /api/chat", o_chat), ("ollama /api/ps", o_ps),
                ("ollama /api/show", o_show), ("ollama /api/embed", o_embed),
                ("ollama /v1/chat/completions", o_v1), ("ollama /v1/models", o_models),
                ("ollama pull/copy/delete", o_pull_copy_delete), ("ollama unload", o_unload)]


def _comfyui_routes(demo: Demo, client: httpx.AsyncClient) -> list[tuple[str, Check]]:
    """Every ComfyUI route the simulator serves, asked directly."""
    if not demo.box.comfyui:
        return []
    c = demo.box.servers["comfyui"].url
    ckpts = demo.box.comfyui.config.checkpoints
    small_ckpt = min(ckpts, key=lambda k: ckpts[k])

    async def c_stats() -> str:
        return str(expect(await client.get(c + "/system_stats")).json()["devices"][0]["name"])

    async def c_api_prefix() -> str:
        return str(expect(await client.get(c + "/api/queue")).json())

    async def c_object_info() -> str:
        return f"{len(expect(await client.get(c + '/object_info')).json())} nodes"

    async def c_features() -> str:
        return str(expect(await client.get(c + "/features")).json())

    async def c_prompt() -> str:
        msgs = await run_prompt(c, small_ckpt, client)
        types = [m["type"] for m in msgs]
        assert "execution_success" in types, types
        return f"{len(msgs)} ws messages, ends with executing null"

    async def c_history() -> str:
        return f"{len(expect(await client.get(c + '/history')).json())} entries"

    async def c_upload_view() -> str:
        files = {"image": ("demo.png", b"\x89PNG\r\n\x1a\n" + b"0" * 64, "image/png")}
        up = expect(await client.post(c + "/upload/image", files=files)).json()
        r = await client.get(c + "/view", params={"filename": up["name"], "type": "input"},
                             headers={"Range": "bytes=0-7"})
        expect(r, 206)
        return f"uploaded {up['name']}, Range -> 206"

    async def c_free() -> str:
        expect(await client.post(c + "/free", json={"unload_models": True, "free_memory": True}))
        return "200 (memory comes back later)"

    return [("comfyui /system_stats", c_stats), ("comfyui /api/ prefix", c_api_prefix),
                ("comfyui /object_info", c_object_info), ("comfyui /features", c_features),
                ("comfyui /prompt + /ws", c_prompt), ("comfyui /history", c_history),
                ("comfyui upload + view", c_upload_view), ("comfyui /free", c_free)]


def _proxy_checks(demo: Demo, client: httpx.AsyncClient) -> list[tuple[str, Check]]:
    """The handoffs through the proxy that this scenario can show."""
    checks: list[tuple[str, Check]] = []
    if demo.proxy and demo.box.ollama and demo.box.comfyui:
        checks.append(("proxy: handoff ComfyUI -> Ollama", lambda: _handoff_check(demo, client)))
        checks.append(("proxy: chat during a render waits", lambda: _chat_during_render(demo, client)))
        checks.append(("proxy: prompt after a chat runs", lambda: _prompt_after_chat(demo, client)))
        checks.append(("proxy: 3 rounds chat then image", lambda: _rounds(demo, client, 3)))
        checks.append(("proxy: release after end marker", lambda: _release_after_end(demo, client)))
        checks.append(("proxy: unload needs no memory", lambda: _unload_releases_nobody(demo, client)))
    if demo.proxy and demo.box.ollama and demo.box.comfyui and demo.box.gpu.device_count > 1:
        checks.append(("proxy: one GPU's load keeps the other's", lambda: _cards_apart(demo, client)))
    if demo.proxy and demo.box.ollama:
        checks.append(("proxy: 507 names the blockers", lambda: _rejection_check(demo, client)))
    if demo.proxy and demo.box.comfyui and demo.box.scenario.relay is not None:
        checks.append(("proxy: relay stopped for a render", lambda: _relay_stopped_and_started(demo, client)))
    return checks


async def _unload_ollama(demo: Demo, client: httpx.AsyncClient) -> None:
    assert demo.box.ollama
    base = demo.box.servers["ollama"].url
    for m in (await client.get(base + "/api/ps")).json()["models"]:
        await client.post(base + "/api/generate", json={"model": m["name"], "keep_alive": 0})
    await demo.box.ollama.wait_until(lambda: not demo.box.ollama.loaded(), timeout_s=15)  # type: ignore[union-attr]


async def _handoff_check(demo: Demo, client: httpx.AsyncClient) -> str:
    """ComfyUI holds its largest checkpoint; an Ollama model that only fits once ComfyUI lets go."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    await _unload_ollama(demo, client)
    ckpts = demo.box.comfyui.config.checkpoints
    await run_prompt(demo.proxy.url("comfyui"), max(ckpts, key=lambda k: ckpts[k]), client)
    free = demo.box.gpu.free_bytes()
    comfy_held = demo.box.gpu.used_by(demo.box.comfyui.pid or 0)
    allowance = demo.proxy.registry.get("ollama").context_allowance_bytes
    candidates = [m for m in demo.box.ollama.config.models if "completion" in m.capabilities
                  and free < m.size_bytes + allowance <= free + comfy_held - demo.box.comfyui.config.context_floor_bytes]
    if not candidates:
        return "not applicable: no model in this scenario needs ComfyUI's memory"
    model = min(candidates, key=lambda m: m.size_bytes)
    r = await client.post(demo.proxy.url("ollama") + "/api/generate",
                          json={"model": model.name, "prompt": "hi", "stream": False})
    if r.status_code != 200:
        raise AssertionError(f"{model.name} through the proxy answered {r.status_code}: {r.text[:200]}")
    plans = [d for d in demo.proxy.decisions.recent() if d.kind == "plan" and d.tenant == "ollama"]
    assert plans, "the proxy loaded the model without a handoff"
    released = [(x.tenant, x.freed_gb) for x in plans[-1].read().releases or []]
    return f"{model.name} loaded after releasing " + ", ".join(f"{t} ({gb} GiB)" for t, gb in released)


def _swap_pair(demo: Demo) -> tuple[str, str] | None:
    """The smallest chat model and the largest checkpoint that cannot share this card: each load
    needs the other one's memory. None when every pair fits."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    if engine_card(demo, "ollama") != engine_card(demo, "comfyui"):
        return None  # on separate cards no load needs the other's memory
    g, comfy, reg = demo.box.gpu, demo.box.comfyui.config, demo.proxy.registry
    others = sum(int(p.vram_gb * GIB) for p in demo.box.scenario.processes)  # the desktop, unmanaged apps
    usable = g.total_bytes - g.reserved_bytes - others
    ckpt = max(comfy.checkpoints, key=lambda k: comfy.checkpoints[k])
    comfy_uses = comfy.checkpoints[ckpt] + comfy.context_floor_bytes + comfy.working_bytes  # while sampling
    allowance = reg.get("ollama").context_allowance_bytes
    fits_alone = [m for m in demo.box.ollama.config.models if "completion" in m.capabilities
                  and m.size_bytes + allowance <= usable - comfy.context_floor_bytes]
    pair = [m for m in fits_alone if m.size_bytes + comfy_uses > usable]
    return (min(pair, key=lambda m: m.size_bytes).name, ckpt) if pair else None


async def _chat(demo: Demo, client: httpx.AsyncClient, model: str) -> None:
    assert demo.proxy
    r = await client.post(demo.proxy.url("ollama") + "/api/chat",
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    if r.status_code != 200:
        raise AssertionError(f"chat with {model} answered {r.status_code}: {r.text[:200]}")


async def _render(demo: Demo, client: httpx.AsyncClient, ckpt: str) -> None:
    assert demo.proxy
    types = [m["type"] for m in await run_prompt(demo.proxy.url("comfyui"), ckpt, client, timeout_s=120)]
    if "execution_success" not in types:
        raise AssertionError(f"the prompt for {ckpt} did not succeed: {types}")


def _not_applicable(demo: Demo) -> str:
    if engine_card(demo, "ollama") != engine_card(demo, "comfyui"):
        return "not applicable: Ollama and ComfyUI run on separate GPUs"
    return "not applicable: every chat model and checkpoint of this scenario fit on the card together"


async def _cards_apart(demo: Demo, client: httpx.AsyncClient) -> str:
    """Several GPUs: Ollama holds its largest chat model on its card, ComfyUI then loads its largest
    checkpoint on the other: nothing of Ollama's is released, and its model stays loaded."""
    assert demo.proxy and demo.box.ollama and demo.box.comfyui
    o_card, c_card = engine_card(demo, "ollama"), engine_card(demo, "comfyui")
    if o_card == c_card:
        return "not applicable: Ollama and ComfyUI share a card"
    model = max((m for m in demo.box.ollama.config.models if "completion" in m.capabilities), key=lambda m: m.size_bytes)
    ckpts = demo.box.comfyui.config.checkpoints
    ckpt = max(ckpts, key=lambda k: ckpts[k])
    await _chat(demo, client, model.name)
    before = len(demo.proxy.decisions.recent(500))
    await _render(demo, client, ckpt)
    released = [r.tenant for d in demo.proxy.decisions.recent(500)[before:]
                for r in (d.read().releases or []) if r.tenant == "ollama"]
    if released:
        raise AssertionError(f"a load on GPU {c_card} released Ollama on GPU {o_card}")
    loaded = [m["name"] for m in (await client.get(demo.box.servers["ollama"].url + "/api/ps")).json()["models"]]
    if model.name not in loaded:
        raise AssertionError(f"{model.name} is no longer loaded after the render on GPU {c_card}: {loaded}")
    return f"{ckpt} rendered on GPU {c_card}; {model.name} stayed on GPU {o_card}, nothing released"


async def _chat_during_render(demo: Demo, client: httpx.AsyncClient) -> str:
    """A chat whose model needs ComfyUI's memory, sent while a prompt renders: it waits, then runs."""
    assert demo.proxy and demo.box.comfyui
    pair = _swap_pair(demo)
    if pair is None:
        return _not_applicable(demo)
    model, ckpt = pair
    await _unload_ollama(demo, client)
    started = time.monotonic()
    rendering = asyncio.ensure_future(_render(demo, client, ckpt))
    inflight = demo.proxy.inflight
    async with asyncio.timeout(30):
        await poll_until(lambda: inflight.traffic("comfyui").jobs, 0.01)
    await _chat(demo, client, model)
    if not rendering.done():
        raise AssertionError("the chat was answered before the render ended: the busy tenant was not waited for")
    await rendering
    queued = [d for d in demo.proxy.decisions.recent() if d.kind == "queued" and d.tenant == "ollama"]
    if not queued or queued[-1].outcome.get("result") != "admitted":
        raise AssertionError("the chat never waited in the handoff queue")
    waited = queued[-1].outcome["waited_s"]
    return f"{model} waited {waited} s for the {ckpt} render, then ran ({time.monotonic() - started:.1f} s in all)"


async def _prompt_after_chat(demo: Demo, client: httpx.AsyncClient) -> str:
    """ComfyUI asks for memory an idle Ollama holds: whatever the priorities, idle memory serves it."""
    assert demo.proxy
    pair = _swap_pair(demo)
    if pair is None:
        return _not_applicable(demo)
    model, ckpt = pair
    await _chat(demo, client, model)
    await _render(demo, client, ckpt)
    plan = [d for d in demo.proxy.decisions.recent() if d.kind == "plan" and d.tenant == "comfyui"]
    released = [r.tenant for r in plan[-1].read().releases or []] if plan else []
    return f"{ckpt} rendered after releasing {', '.join(released) or 'nobody'}"


async def _rounds(demo: Demo, client: httpx.AsyncClient, rounds: int) -> str:
    assert demo.proxy
    pair = _swap_pair(demo)
    if pair is None:
        return _not_applicable(demo)
    model, ckpt = pair
    started = time.monotonic()
    before = len(demo.proxy.decisions.recent(500))
    for _ in range(rounds):
        await _chat(demo, client, model)
        await _render(demo, client, ckpt)
    bad = [d for d in demo.proxy.decisions.recent(500)[before:] if d.kind in ("rejection", "oom_retry")]
    if bad:
        raise AssertionError(f"{len(bad)} refusal(s) or OOM retries: {Decision.of(bad[0]).dump()}")
    return f"{rounds} x ({model} chat, {ckpt} render) in {time.monotonic() - started:.1f} s, no error"


async def _release_after_end(demo: Demo, client: httpx.AsyncClient) -> str:
    """The watchdog read ComfyUI's queue while the prompt ran; a release asked at its end marker is 200."""
    assert demo.proxy and demo.box.comfyui
    ckpts = demo.box.comfyui.config.checkpoints
    rendering = asyncio.ensure_future(_render(demo, client, min(ckpts, key=lambda k: ckpts[k])))
    inflight = demo.proxy.inflight
    async with asyncio.timeout(30):
        await poll_until(lambda: inflight.traffic("comfyui").jobs, 0.01)
    await demo.proxy.watchdog.tick()
    await rendering
    r = await client.post(demo.proxy.url("admin") + "/api/tenants/comfyui/release")
    if r.status_code != 200:
        raise AssertionError(f"release right after the end marker answered {r.status_code}: {r.text[:200]}")
    return f"200, {r.json()['freed_gb']} GiB back on the card"


async def _unload_releases_nobody(demo: Demo, client: httpx.AsyncClient) -> str:
    assert demo.proxy and demo.box.ollama
    biggest = max(demo.box.ollama.config.models, key=lambda m: m.size_bytes).name
    before = len(demo.proxy.decisions.recent(500))
    # cuda_suspend: a suspended Ollama is restored first (its runner must not end with its CUDA calls locked)
    suspended = demo.proxy.broker.lifecycles.suspensions.dormant("ollama")
    r = await client.post(demo.proxy.url("ollama") + "/api/generate", json={"model": biggest, "keep_alive": 0})
    if r.status_code != 200 or r.json().get("done_reason") != "unload":
        raise AssertionError(f"unload of {biggest} answered {r.status_code}: {r.text[:200]}")
    made = [d.kind for d in demo.proxy.decisions.recent(500)[before:] if not (suspended and d.kind == "resume")]
    if made:
        raise AssertionError(f"an unload made decisions: {made}")
    return f"{biggest} unloaded, no plan, no release"


async def _rejection_check(demo: Demo, client: httpx.AsyncClient) -> str:
    """The largest model, when even releasing everyone reclaimable cannot make room: 507 with blockers."""
    assert demo.proxy and demo.box.ollama
    await _unload_ollama(demo, client)
    biggest = max((m for m in demo.box.ollama.config.models if "completion" in m.capabilities), key=lambda m: m.size_bytes)
    r = await client.post(demo.proxy.url("ollama") + "/api/generate",
                          json={"model": biggest.name, "prompt": "hi", "stream": False})
    if r.status_code == 200:
        return f"not applicable: {biggest.name} fits this card once others are released"
    if r.status_code != 507:
        raise AssertionError(f"{biggest.name} answered {r.status_code}: {r.text[:200]}")
    refused = NotEnoughMemory.model_validate_json(r.content)
    blockers = ", ".join(f"{b.cmdline or b.name} (pid {b.pid}, {b.vram_gb} GiB, {b.reason})"
                         for b in refused.blockers if b.reason == "unmanaged")
    return (f"507 for {biggest.name} (needs {refused.need_gb} GiB, {refused.available_gb} GiB reachable): "
            f"{blockers or 'no unmanaged blocker'}")


async def _relay_stopped_and_started(demo: Demo, client: httpx.AsyncClient) -> str:
    """The speech relay (a `process` tenant) is not started by a read (503), runs after a
    request that needs it (an empty POST: answered); a render that needs its memory
    stops it (a `stop` decision, the child gone, its memory back on the card); the next request to
    its listener starts it again (a `start` decision, 200)."""
    assert demo.proxy and demo.box.comfyui and demo.box.scenario.relay
    spec, proxy, gpu = demo.box.scenario.relay, demo.proxy, demo.box.gpu
    name = spec.tenant
    machine = proxy.broker.lifecycles.machine(name)
    if machine is None:
        raise AssertionError(f"{name} is not a tenant the proxy starts and stops")
    if demo.box.ollama:
        await _unload_ollama(demo, client)  # so that the render needs the relay's memory, not Ollama's
    expect_ok(await client.post(proxy.url("admin") + "/api/tenants/comfyui/release"), "comfyui's release")
    relay = proxy.url(name)
    before = len(proxy.decisions.recent(500))
    pid = await _started_by_a_write(demo, client, machine, relay)
    ckpt, need = _largest_checkpoint(demo)
    if need <= gpu.free_bytes() + gpu.used_by(demo.box.comfyui.pid or 0):
        return f"not applicable: {ckpt} fits beside {name}"
    stop_s = await _stopped_by_a_render(demo, client, machine, ckpt, pid, before)
    starts = await _started_again(demo, client, machine, relay, before)
    return (f"{name} started ({starts[0].outcome.get('duration_s')} s), stopped for {ckpt} ({stop_s} s, "
            f"{spec.vram_gb:g} GiB back), started again ({starts[1].outcome.get('duration_s')} s), 200")


def _largest_checkpoint(demo: Demo) -> tuple[str, int]:
    """ComfyUI's largest checkpoint and what the proxy plans for it (bytes)."""
    assert demo.proxy and demo.box.comfyui
    ckpts, reg = demo.box.comfyui.config.checkpoints, demo.proxy.registry.get("comfyui")
    ckpt = max(ckpts, key=lambda k: ckpts[k])
    return ckpt, int(reg.model_vram_gb.get(ckpt, reg.needs_vram_gb) * GIB)


async def _stopped_by_a_render(demo: Demo, client: httpx.AsyncClient, machine: TenantLifecycle, ckpt: str,
                               pid: int, before: int) -> JSONValue:
    """A render of `ckpt` stops the relay: a `stop` decision that succeeded, the relay stopped and its
    process off the card. The stop's duration."""
    assert demo.proxy
    name, gpu = machine.tenant, demo.box.gpu
    await _render(demo, client, ckpt)
    made = demo.proxy.decisions.recent(500)[before:]
    stops = [d for d in made if d.kind == "stop" and d.tenant == name]
    if not stops or stops[-1].outcome.get("ok") is not True:
        raise AssertionError(f"{ckpt} rendered but {name} was not stopped: {[(d.kind, d.tenant) for d in made]}")
    if _state_now(machine) != "stopped" or pid in gpu.real_pids():
        raise AssertionError(f"{name} is {_state_now(machine)} after its stop; pid {pid} on the card: {pid in gpu.real_pids()}")
    return stops[-1].outcome.get("duration_s")


async def _started_again(demo: Demo, client: httpx.AsyncClient, machine: TenantLifecycle, relay: str,
                         before: int) -> list[DecisionView]:
    """The next request to the stopped relay starts it again and is answered: its two `start` decisions."""
    assert demo.proxy
    name = machine.tenant
    said = expect_ok(await client.post(relay + "/v1/audio/transcriptions", content=b"RIFF" + bytes(4096),
                                       headers={"Content-Type": "audio/wav"}), f"the next request to {name}")
    starts = [d for d in demo.proxy.decisions.recent(500)[before:] if d.kind == "start" and d.tenant == name]
    if len(starts) != 2 or _state_now(machine) != "running" or "text" not in said.json():
        raise AssertionError(f"{name} was not started again: {len(starts)} start(s), {_state_now(machine)}, "
                             f"{said.text[:120]}")
    return starts


async def _started_by_a_write(demo: Demo, client: httpx.AsyncClient, machine: TenantLifecycle, relay: str) -> int:
    """A read leaves the stopped relay stopped (503); the first request that needs it starts it, and
    its process shows on the card: its pid."""
    name = machine.tenant
    polled = await client.get(relay + "/health")
    if polled.status_code != 503 or machine.state != "stopped":
        raise AssertionError(f"a read of the stopped {name} answered {polled.status_code} and left it {machine.state}: "
                             "a read must not start it (wake_on \"writes\")")
    expect_ok(await client.post(relay + "/v1/audio/transcriptions", content=b"",
                                headers={"Content-Type": "audio/wav"}), f"the first request to {name}")
    pid = machine.controller.describe().get("pid")
    on_card = demo.box.gpu.real_pids()
    if not isinstance(pid, int) or pid not in on_card or _state_now(machine) != "running":
        raise AssertionError(f"{name} is {machine.state} after its first request; on the card: {on_card}")
    return pid


def _state_now(machine: TenantLifecycle) -> str:
    """Its state read anew (after an await it may have changed, whatever was read before)."""
    return machine.state


def expect_ok(r: httpx.Response, what: str) -> httpx.Response:
    if r.status_code != 200:
        raise AssertionError(f"{what} answered {r.status_code}: {r.text[:200]}")
    return r


# -- the demo's terminal: one readable line per decision ----------------------------------------------
