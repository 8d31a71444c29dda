"""The ComfyUI simulator on real sockets: wire shapes from comfyui-observed.md / engine-wire-facts.md B."""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from proxy.clock import ManualClock
from proxy.relay.servers import RunningServer
from proxy.sim.comfyui import OOM_MESSAGE, ComfySim, ComfySimConfig
from proxy.sim.gpu import GIB, SimulatedGpu
from proxy.tasks import poll_until
from tests.integration.boxes import LOOPBACK_TLS

SDXL = "sd_xl_base_1.0.safetensors"
SD15 = "v1-5-pruned-emaonly.safetensors"
FLOOR = int(0.4 * GIB)
WORK = 1 * GIB


def fast_config(**overrides: Any) -> ComfySimConfig:
    base: dict[str, Any] = dict(checkpoints={SDXL: 6 * GIB, SD15: 2 * GIB}, context_floor_bytes=FLOOR,
                                step_time_s=0.005, working_bytes=WORK, free_delay_s=0.1, load_gbps=1000.0)
    base.update(overrides)
    return ComfySimConfig(**base)


class Box:
    def __init__(self, gpu: SimulatedGpu, sim: ComfySim, server: RunningServer, http: httpx.AsyncClient,
                 clock: ManualClock) -> None:
        self.gpu, self.sim, self.server, self.http, self.clock = gpu, sim, server, http, clock

    def ws(self, client_id: str | None = None, path: str = "/ws", **kw: Any) -> Any:
        query = f"?clientId={client_id}" if client_id else ""
        return ws_connect(self.server.port, f"{path}{query}", **kw)

    def used(self) -> int:
        assert self.sim.pid is not None
        return self.gpu.used_by(self.sim.pid)

    async def post_prompt(self, graph: dict[str, Any], client_id: str | None = None, **extra: Any) -> str:
        body: dict[str, Any] = {"prompt": graph, **extra}
        if client_id:
            body["client_id"] = client_id
        r = await self.http.post("/prompt", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["prompt_id"])

    async def history(self, prompt_id: str) -> dict[str, Any]:
        """Wait until the prompt's history entry exists (it is written before the end marker)."""
        async def entry() -> dict[str, Any] | None:
            data: dict[str, dict[str, Any]] = (await self.http.get(f"/history/{prompt_id}")).json()
            return data.get(prompt_id)
        return await until(entry, f"history of {prompt_id}")


T = TypeVar("T")


async def until(probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 5.0) -> T:
    """Poll an observable (the simulator frees asynchronously on purpose) until it is truthy; its value."""
    seen: list[T | None] = [None]

    async def truthy() -> bool:
        seen[0] = await probe()
        return bool(seen[0])
    try:
        async with asyncio.timeout(timeout_s):
            await poll_until(truthy, every_s=0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None
    assert seen[0] is not None
    return seen[0]


def ws_connect(port: int, path: str, **kw: Any) -> Any:
    # Unbounded receive queue: tests leave frames unread, and a paused reader would not see the
    # server's close frame (the client would then wait out close_timeout).
    return connect(f"ws://127.0.0.1:{port}{path}", max_queue=None, **kw)


async def make_box(gpu: SimulatedGpu, config: ComfySimConfig,
                   clock: ManualClock | None = None) -> tuple[ComfySim, RunningServer]:
    sim = ComfySim(gpu, config, clock=clock)
    return sim, await sim.start()


@pytest.fixture
async def box() -> AsyncIterator[Box]:
    gpu = SimulatedGpu(total_bytes=24 * GIB)
    clock = ManualClock(ticking=True)  # steps and delays run by themselves; a test can jump past one
    sim, server = await make_box(gpu, fast_config(), clock)
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http:
        yield Box(gpu, sim, server, http, clock)
    await sim.stop()


def image_graph(color: int | None = None, prefix: str = "smoke/smoke", width: int = 64) -> dict[str, Any]:
    color = uuid.uuid4().int % 0xFFFFFF if color is None else color
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": width, "height": 64, "batch_size": 1, "color": color}},
            "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}}}


def txt2img(ckpt: str = SDXL, steps: int = 4, seed: int | None = None) -> dict[str, Any]:
    seed = uuid.uuid4().int % 2**32 if seed is None else seed
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": steps, "cfg": 7.0, "sampler_name": "euler",
                                                   "scheduler": "normal", "denoise": 1.0, "model": ["4", 0],
                                                   "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    }


async def first_frame(ws: ClientConnection) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await ws.recv())
    return frame


async def until_end(ws: ClientConnection, prompt_id: str) -> list[Any]:
    """Every frame up to and including executing {node: null} for prompt_id (binary frames as bytes)."""
    frames: list[Any] = []
    while True:
        raw = await asyncio.wait_for(ws.recv(), timeout=10)
        if isinstance(raw, bytes):
            frames.append(raw)
            continue
        message = json.loads(raw)
        frames.append(message)
        if message["type"] == "executing" and message["data"] == {"node": None, "prompt_id": prompt_id}:
            return frames


def types(frames: list[Any]) -> list[str]:
    return [f["type"] if isinstance(f, dict) else "binary" for f in frames]


# -- websocket -------------------------------------------------------------------------------------

async def test_ws_first_frame_is_status_with_client_id_as_sid(box: Box) -> None:
    async with box.ws("abc123") as ws:
        assert await first_frame(ws) == {"type": "status", "data": {
            "status": {"exec_info": {"queue_remaining": 0}}, "sid": "abc123"}}
    async with box.ws(path="/api/ws") as ws:
        sid = (await first_frame(ws))["data"]["sid"]
        assert len(sid) == 32 and int(sid, 16) >= 0, f"server-made sid should be uuid hex, got {sid!r}"


async def test_feature_flags_first_message_is_answered(box: Box) -> None:
    async with box.ws("ff") as ws:
        await first_frame(ws)
        await ws.send(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))
        reply = await first_frame(ws)
        assert reply == {"type": "feature_flags", "data": {
            "supports_preview_metadata": True, "max_upload_size": 104857600,
            "extension": {"manager": {"supports_v4": True}}}}


async def test_fresh_run_follows_the_observed_event_order(box: Box) -> None:
    async with box.ws("c1") as ws:
        await first_frame(ws)
        pid = await box.post_prompt(image_graph(), "c1")
        frames = await until_end(ws, pid)
    assert types(frames) == ["status", "status", "execution_start", "execution_cached", "progress_state", "executing",
                             "progress_state", "progress_state", "executing", "executed", "progress_state",
                             "execution_success", "status", "executing"]
    assert [f["data"]["status"]["exec_info"]["queue_remaining"] for f in frames if f["type"] == "status"] == [1, 1, 0]
    assert frames[3]["data"]["nodes"] == [] and isinstance(frames[2]["data"]["timestamp"], int)
    assert frames[2]["data"]["timestamp"] > 1_700_000_000_000, "timestamps are ms"
    assert frames[4]["data"]["nodes"] == {"1": {"value": 0.0, "max": 1.0, "state": "running", "node_id": "1",
                                                "prompt_id": pid, "display_node_id": "1", "parent_node_id": None,
                                                "real_node_id": "1"}}
    assert frames[5]["data"] == {"node": "1", "display_node": "1", "prompt_id": pid}
    assert set(frames[7]["data"]["nodes"]) == {"1", "2"} and frames[7]["data"]["nodes"]["2"]["state"] == "running"
    assert frames[9]["data"] == {"node": "2", "display_node": "2", "prompt_id": pid, "output": {
        "images": [{"filename": "smoke_00001_.png", "subfolder": "smoke", "type": "output"}]}}


async def test_identical_resubmit_takes_the_cached_path_with_the_old_filename(box: Box) -> None:
    graph = image_graph(color=123)
    async with box.ws("c2") as ws:
        await first_frame(ws)
        await until_end(ws, await box.post_prompt(graph, "c2"))
        pid = await box.post_prompt(graph, "c2")
        frames = await until_end(ws, pid)
    assert types(frames) == ["status", "status", "execution_start", "execution_cached", "executed", "progress_state",
                             "execution_success", "status", "executing"]
    assert frames[3]["data"]["nodes"] == ["1", "2"]
    assert frames[4]["data"]["output"]["images"][0]["filename"] == "smoke_00001_.png"
    node = frames[5]["data"]["nodes"]
    assert list(node) == ["2"] and node["2"]["value"] == 1 and isinstance(node["2"]["value"], int)
    assert sorted(p.name for p in (box.sim.output_dir / "smoke").iterdir()) == ["smoke_00001_.png"], "nothing new written"


async def test_txt2img_loads_the_checkpoint_reports_steps_and_keeps_the_weights(box: Box) -> None:
    async with box.ws("c3") as ws:
        await first_frame(ws)
        pid = await box.post_prompt(txt2img(steps=4), "c3")
        frames = await until_end(ws, pid)
    progress = [f["data"] for f in frames if isinstance(f, dict) and f["type"] == "progress"]
    assert progress == [{"value": i, "max": 4, "prompt_id": pid, "node": "3"} for i in range(1, 5)]
    executing = [f["data"]["node"] for f in frames if isinstance(f, dict) and f["type"] == "executing"]
    assert executing[:1] == ["4"] and executing.index("4") < executing.index("3") < executing.index("8") < executing.index("9")
    assert box.sim.loaded() == {SDXL: 6 * GIB}
    assert box.used() == FLOOR + 6 * GIB, "smart memory keeps the weights, the sampling memory is released"
    assert box.sim.executed == 1


async def test_loading_another_checkpoint_unloads_the_first(box: Box) -> None:
    async with box.ws("c4") as ws:
        await first_frame(ws)
        await until_end(ws, await box.post_prompt(txt2img(SDXL), "c4"))
        await until_end(ws, await box.post_prompt(txt2img(SD15), "c4"))
    assert box.sim.loaded() == {SD15: 2 * GIB}
    assert box.used() == FLOOR + 2 * GIB


async def test_events_are_targeted_to_the_owner_and_ownerless_prompts_only_broadcast_progress(box: Box) -> None:
    async with box.ws("owner") as owner, box.ws("other") as other:
        await first_frame(owner)
        await first_frame(other)
        pid = await box.post_prompt(txt2img(steps=2), "owner")
        owned = await until_end(owner, pid)
        anon = await box.post_prompt(txt2img(steps=2))
        history = await box.history(anon)
        # `other` saw only broadcasts: status for both prompts, plus progress for the ownerless one.
        # Read up to a fence: /queue broadcasts a status behind everything the prompts sent (one
        # outbox per socket, in order), the third idle status after the two prompts' ends.
        assert (await box.http.post("/queue", json={})).status_code == 200
        idle = {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}}}
        seen: list[dict[str, Any]] = []
        while seen.count(idle) < 3:
            seen.append(json.loads(await asyncio.wait_for(other.recv(), timeout=10)))
    assert "execution_start" in types(owned)
    assert set(types(seen)) == {"status", "progress", "progress_state"}
    assert all(f["data"]["prompt_id"] == anon for f in seen if f["type"] != "status")
    assert history["status"]["status_str"] == "success"


async def test_previews_use_type_1_jpeg_or_type_4_with_metadata_when_negotiated() -> None:
    gpu = SimulatedGpu(total_bytes=24 * GIB)
    sim, server = await make_box(gpu, fast_config(previews=True))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http, \
                ws_connect(server.port, "/ws?clientId=plain") as plain, \
                ws_connect(server.port, "/ws?clientId=meta") as meta:
            await first_frame(plain)
            await first_frame(meta)
            await meta.send(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))
            await first_frame(meta)
            r1 = await http.post("/prompt", json={"prompt": txt2img(steps=2), "client_id": "plain"})
            frames_plain = await until_end(plain, r1.json()["prompt_id"])
            r2 = await http.post("/prompt", json={"prompt": txt2img(steps=2), "client_id": "meta"})
            frames_meta = await until_end(meta, r2.json()["prompt_id"])
    finally:
        await sim.stop()
    binary = [f for f in frames_plain if isinstance(f, bytes)]
    assert len(binary) == 2 and all(struct.unpack(">II", f[:8]) == (1, 1) for f in binary)
    assert binary[0][8:10] == b"\xff\xd8", "JPEG payload after the two headers"
    with_meta = [f for f in frames_meta if isinstance(f, bytes)]
    assert len(with_meta) == 2
    kind, length = struct.unpack(">II", with_meta[0][:8])
    info = json.loads(with_meta[0][8:8 + length])
    assert kind == 4 and info["node_id"] == "3" and info["prompt_id"] == r2.json()["prompt_id"]
    assert info["image_type"] == "image/jpeg" and with_meta[0][8 + length:][:2] == b"\xff\xd8"


def ws_graph(batch: int = 2) -> dict[str, Any]:
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": batch, "color": 7}},
            "2": {"class_type": "SaveImageWebsocket", "inputs": {"images": ["1", 0]}}}


async def test_save_image_websocket_sends_each_image_as_a_binary_png_frame(box: Box) -> None:
    async with box.ws("sw") as ws:
        await first_frame(ws)
        pid = await box.post_prompt(ws_graph(batch=2), "sw")
        frames = await until_end(ws, pid)
        again = await until_end(ws, await box.post_prompt(ws_graph(batch=2), "sw"))
    node2 = frames[types(frames).index("executing", 6):]
    assert types(node2)[:8] == ["executing", "progress_state", "progress", "binary",
                                "progress_state", "progress", "binary", "progress_state"]
    binary = [f for f in frames if isinstance(f, bytes)]
    assert len(binary) == 2 and all(struct.unpack(">II", f[:8]) == (1, 2) for f in binary), "type 1, format 2 (PNG)"
    assert binary[0][8:16] == b"\x89PNG\r\n\x1a\n"
    progress = [f["data"] for f in frames if isinstance(f, dict) and f["type"] == "progress"]
    assert progress == [{"value": i, "max": 2, "prompt_id": pid, "node": "2"} for i in (0, 1)]
    last_state = [f for f in frames if isinstance(f, dict) and f["type"] == "progress_state"][-1]["data"]["nodes"]["2"]
    assert (last_state["value"], last_state["max"], last_state["state"]) == (2, 2, "finished")
    assert "executed" not in types(frames), "no UI output"
    assert (await box.history(pid))["outputs"] == {}
    assert not list(box.sim.output_dir.rglob("*.png")), "nothing written to disk"
    cached = next(f for f in again if isinstance(f, dict) and f["type"] == "execution_cached")
    assert cached["data"]["nodes"] == ["1"], "IS_CHANGED is time.time(): the node runs every time"
    assert len([f for f in again if isinstance(f, bytes)]) == 2


async def test_save_image_websocket_sends_type_4_to_an_owner_with_preview_metadata(box: Box) -> None:
    async with box.ws("swm") as ws:
        await first_frame(ws)
        await ws.send(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))
        await first_frame(ws)
        pid = await box.post_prompt(ws_graph(batch=1), "swm")
        frames = await until_end(ws, pid)
    (frame,) = [f for f in frames if isinstance(f, bytes)]
    kind, length = struct.unpack(">II", frame[:8])
    assert kind == 4 and frame[8 + length:][:4] == b"\x89PNG"
    assert json.loads(frame[8:8 + length]) == {"node_id": "2", "prompt_id": pid, "display_node_id": "2",
                                               "parent_node_id": None, "real_node_id": "2", "image_type": "image/png"}
    at = frames.index(frame)
    assert types(frames)[at - 1:at + 2] == ["progress_state", "binary", "progress"], "type 4 goes before progress"


async def test_object_info_has_save_image_websocket(box: Box) -> None:
    info = (await box.http.get("/object_info/SaveImageWebsocket")).json()["SaveImageWebsocket"]
    assert info["output_node"] is True and info["output"] == [] and info["category"] == "api/image"
    assert info["input"]["required"] == {"images": ["IMAGE"]}
    assert info["python_module"] == "custom_nodes.websocket_image_save"


# -- queue, history, interrupt ----------------------------------------------------------------------

async def test_queue_runs_in_number_order_and_shows_five_element_items(box: Box) -> None:
    async with box.ws("q") as ws:
        await first_frame(ws)
        long_id = await box.post_prompt(txt2img(steps=2000), "q")
        await until(lambda: _running(box), "the long prompt to start")
        later = [await box.post_prompt(image_graph(), "q") for _ in range(2)]
        front = await box.post_prompt(image_graph(), "q", front=True)
        queue = (await box.http.get("/api/queue")).json()
        assert [i[1] for i in queue["queue_running"]] == [long_id]
        running = queue["queue_running"][0]
        assert len(running) == 5 and running[0] == 0 and running[4] == ["9"]
        assert running[3] == {"client_id": "q", "create_time": running[3]["create_time"]}
        assert sorted(i[1] for i in queue["queue_pending"]) == sorted([*later, front])
        assert (await box.http.get("/prompt")).json() == {"exec_info": {"queue_remaining": 4}}
        assert (await box.http.post("/interrupt", json={"prompt_id": long_id})).content == b""
        order: list[str] = []
        while len(order) < 4:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
            if message["type"] == "execution_start":
                order.append(message["data"]["prompt_id"])
    assert order[1:] == [front, *later], "front:true jumps the queue (negative number), then POST order"


async def _running(box: Box) -> bool:
    return bool((await box.http.get("/queue")).json()["queue_running"])


async def test_interrupt_during_sampling_reports_execution_interrupted_then_end(box: Box) -> None:
    async with box.ws("i") as ws:
        await first_frame(ws)
        pid = await box.post_prompt(txt2img(steps=2000), "i")
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == "progress":
                break
        r = await box.http.post("/interrupt")
        assert r.status_code == 200 and r.content == b""
        frames = await until_end(ws, pid)
    tail = [f for f in frames if f["type"] not in ("progress", "progress_state")]
    assert types(tail) == ["execution_interrupted", "status", "executing"]
    data = tail[0]["data"]
    assert data["node_id"] == "3" and data["node_type"] == "KSampler" and sorted(data["executed"]) == ["4", "5", "6", "7"]
    entry = await box.history(pid)
    assert entry["status"]["status_str"] == "error" and entry["status"]["completed"] is False
    assert entry["status"]["messages"][-1][0] == "execution_interrupted"
    assert box.used() == FLOOR + 6 * GIB, "the sampler's working memory is released on interrupt"


async def test_interrupt_while_idle_is_dropped(box: Box) -> None:
    assert (await box.http.post("/interrupt", content=b"")).status_code == 200
    assert (await box.http.post("/interrupt", json={"prompt_id": "nope"})).status_code == 200
    pid = await box.post_prompt(image_graph())
    assert (await box.history(pid))["status"]["status_str"] == "success"


async def test_history_entry_shape_paging_and_unknown_id(box: Box) -> None:
    ids = []
    for _ in range(3):
        ids.append(await box.post_prompt(image_graph(), "h"))
        await box.history(ids[-1])
    entry = (await box.http.get(f"/history/{ids[0]}")).json()[ids[0]]
    assert entry["prompt"][1] == ids[0] and entry["prompt"][4] == ["2"]
    assert list(entry["prompt"][3]) == ["client_id", "create_time"] and entry["prompt"][3]["client_id"] == "h"
    assert entry["outputs"]["2"]["images"][0]["type"] == "output"
    assert entry["meta"] == {"2": {"node_id": "2", "display_node": "2", "parent_node": None, "real_node_id": "2"}}
    assert [m[0] for m in entry["status"]["messages"]] == ["execution_start", "execution_cached", "execution_success"]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert (await box.http.get("/history/unknown")).json() == {}
    assert list((await box.http.get("/history", params={"max_items": 2})).json()) == ids[1:]
    assert list((await box.http.get("/api/history", params={"max_items": 1, "offset": 0})).json()) == ids[:1]
    assert (await box.http.post("/history", json={"delete": [ids[0]]})).content == b""
    assert list((await box.http.get("/history")).json()) == ids[1:]
    await box.http.post("/history", json={"clear": True})
    assert (await box.http.get("/history")).json() == {}


# -- jobs API (0.8.0) -------------------------------------------------------------------------------

async def test_jobs_lists_a_finished_prompt_with_its_preview_and_pagination(box: Box) -> None:
    pid = await box.post_prompt(image_graph(prefix="jobs/run"), "j")
    entry = await box.history(pid)
    body = (await box.http.get("/api/jobs")).json()
    assert body["pagination"] == {"offset": 0, "limit": None, "total": 1, "has_more": False}
    (job,) = body["jobs"]
    messages = dict(entry["status"]["messages"])
    assert job == {"id": pid, "status": "completed", "priority": 0, "create_time": entry["prompt"][3]["create_time"],
                   "execution_start_time": messages["execution_start"]["timestamp"],
                   "execution_end_time": messages["execution_success"]["timestamp"], "outputs_count": 1,
                   "preview_output": {**entry["outputs"]["2"]["images"][0], "nodeId": "2", "mediaType": "images"}}
    one = (await box.http.get(f"/api/jobs/{pid}")).json()
    assert one == {**job, "outputs": entry["outputs"], "execution_status": entry["status"],
                   "workflow": {"prompt": entry["prompt"][2], "extra_data": entry["prompt"][3]}}
    assert (await box.http.get("/api/api/jobs")).json() == body, "the route's /api gets the /api prefix too"
    r = await box.http.get("/jobs")
    assert (r.status_code, r.content) == (404, b""), "there is no /jobs without the prefix"
    r = await box.http.get("/api/jobs/no-such-job")
    assert (r.status_code, r.json()) == (404, {"error": "Job not found"})


async def test_jobs_shows_running_and_pending_prompts_filters_sorts_and_pages(box: Box) -> None:
    long_id = await box.post_prompt(txt2img(steps=2000), "jp")
    await until(lambda: _running(box), "the long prompt to start")
    pending = [await box.post_prompt(image_graph(), "jp") for _ in range(2)]
    jobs = (await box.http.get("/api/jobs")).json()["jobs"]
    times = {j["id"]: j["create_time"] for j in jobs}
    newest_first = sorted(pending, key=lambda p: -times[p])  # two posts in one millisecond tie: queue order, as ComfyUI sorts
    assert [(j["id"], j["status"]) for j in jobs] == [*((p, "pending") for p in newest_first),
                                                      (long_id, "in_progress")], "newest create_time first"
    assert set(jobs[0]) == {"id", "status", "priority", "create_time", "outputs_count"} and jobs[0]["outputs_count"] == 0
    page = (await box.http.get("/api/jobs", params={"status": "pending", "sort_order": "asc", "limit": 1})).json()
    assert [j["id"] for j in page["jobs"]] == [pending[0]]
    assert page["pagination"] == {"offset": 0, "limit": 1, "total": 2, "has_more": True}
    assert (await box.http.get(f"/api/jobs/{long_id}")).json()["status"] == "in_progress"
    await box.http.post("/interrupt", json={"prompt_id": long_id})
    await box.history(long_id)
    stopped = (await box.http.get(f"/api/jobs/{long_id}")).json()
    assert stopped["status"] == "failed" and "execution_error" not in stopped, "0.8.0: an interrupted job is failed"


async def test_jobs_reports_an_execution_error(box: Box) -> None:
    box.sim.fail_next_prompt_with_oom()
    pid = await box.post_prompt(txt2img())
    await box.history(pid)
    job = (await box.http.get("/api/jobs", params={"status": "failed"})).json()["jobs"][0]
    assert job["id"] == pid and job["status"] == "failed"
    assert job["execution_error"]["exception_type"] == "torch.OutOfMemoryError" and job["outputs_count"] == 0


@pytest.mark.parametrize(("params", "message"), [
    ({"status": "done"}, "Invalid status value(s): done. Valid values: pending, in_progress, completed, failed"),
    ({"sort_by": "name"}, "sort_by must be 'created_at' or 'execution_duration'"),
    ({"sort_order": "up"}, "sort_order must be 'asc' or 'desc'"),
    ({"limit": "x"}, "limit must be an integer"), ({"limit": "0"}, "limit must be a positive integer"),
    ({"offset": "x"}, "offset must be an integer"),
])
async def test_jobs_rejects_bad_parameters_with_400(box: Box, params: dict[str, str], message: str) -> None:
    r = await box.http.get("/api/jobs", params=params)
    assert (r.status_code, r.json()) == (400, {"error": message})


async def test_a_prompt_queued_again_under_its_own_id_replaces_its_record_when_it_ends(box: Box) -> None:
    # server.py post_prompt: prompt_id = str(json_data.get("prompt_id", uuid.uuid4())); PromptQueue.task_done
    # writes history[prompt_id] (a dict: the old record stays in place until the new run ends).
    async with box.ws("o") as ws:
        await first_frame(ws)
        box.sim.fail_next_prompt_with_oom()
        pid = await box.post_prompt(txt2img(), "o")
        failed = await until_end(ws, pid)
        other = await box.post_prompt(image_graph(color=5), "o")
        await until_end(ws, other)
        before = await box.history(pid)
        again = await box.http.post("/prompt", json={"prompt": txt2img(), "client_id": "o", "prompt_id": pid})
        assert again.status_code == 200 and again.json()["prompt_id"] == pid
        assert again.json()["number"] != before["prompt"][0], "a new run has a new queue number"
        queue = (await box.http.get("/queue")).json()
        assert pid in [row[1] for row in queue["queue_running"] + queue["queue_pending"]]
        assert (await box.history(pid))["status"]["status_str"] == "error", "the failed run's record until the new one ends"
        rerun = await until_end(ws, pid)
    assert types(failed)[-3:] == ["execution_error", "status", "executing"]
    assert next(f["type"] for f in rerun if f["type"].startswith("execution_")) == "execution_start"
    assert types(rerun)[-3:] == ["execution_success", "status", "executing"], "the same id, frames to the same client"
    history = (await box.http.get("/history")).json()
    assert list(history) == [pid, other], "the record replaced in place"
    assert history[pid]["status"]["status_str"] == "success" and history[pid]["prompt"][0] == again.json()["number"]


# -- memory: OOM, /free -----------------------------------------------------------------------------

async def test_injected_oom_sends_execution_error_and_unloads_everything(box: Box) -> None:
    async with box.ws("o") as ws:
        await first_frame(ws)
        await until_end(ws, await box.post_prompt(txt2img(), "o"))
        box.sim.fail_next_prompt_with_oom()
        pid = await box.post_prompt(txt2img(), "o")
        frames = await until_end(ws, pid)
    assert types(frames)[-3:] == ["execution_error", "status", "executing"]
    error = frames[-3]["data"]
    assert error["exception_type"] == "torch.OutOfMemoryError" and error["exception_message"] == OOM_MESSAGE
    assert error["node_id"] == "3" and error["node_type"] == "KSampler"
    assert isinstance(error["traceback"], list) and error["traceback"]
    assert error["current_inputs"]["steps"] == [4] and error["current_inputs"]["sampler_name"] == ["euler"]
    assert set(error["current_outputs"]) == set(txt2img()) and isinstance(error["timestamp"], int)
    assert box.sim.loaded() == {} and box.used() == FLOOR, "after an OOM ComfyUI unloads all models"
    entry = await box.history(pid)
    assert entry["status"]["status_str"] == "error" and entry["status"]["messages"][-1][0] == "execution_error"


async def test_a_device_too_small_for_sampling_fails_at_the_ksampler() -> None:
    gpu = SimulatedGpu(total_bytes=7 * GIB, reserved_bytes=0)
    sim, server = await make_box(gpu, fast_config())
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http, \
                ws_connect(server.port, "/ws?clientId=s") as ws:
            await first_frame(ws)
            pid = (await http.post("/prompt", json={"prompt": txt2img(), "client_id": "s"})).json()["prompt_id"]
            frames = await until_end(ws, pid)
        assert gpu.free_bytes() == 7 * GIB - FLOOR, "the OOM unload leaves only the context"
    finally:
        await sim.stop()
    error = next(f["data"] for f in frames if f["type"] == "execution_error")
    assert error["node_type"] == "KSampler" and sorted(error["executed"]) == ["4", "5", "6", "7"]


async def test_free_when_idle_returns_memory_after_the_delay_down_to_the_floor(box: Box) -> None:
    await box.history(await box.post_prompt(txt2img()))
    assert box.used() == FLOOR + 6 * GIB
    r = await box.http.post("/free", json={"unload_models": True, "free_memory": True})
    assert r.status_code == 200 and r.content == b"" and box.sim.frees == 1
    await until(lambda: _async(box.sim.loaded() == {}), "the worker to unload")
    stats = (await box.http.get("/system_stats")).json()["devices"][0]
    if box.used() > FLOOR:  # inside free_delay_s: torch still reserves it, and counts it as free
        assert stats["torch_vram_free"] == stats["torch_vram_total"] == 6 * GIB
    await until(lambda: _async(box.used() == FLOOR), "the memory to come back")
    stats = (await box.http.get("/system_stats")).json()["devices"][0]
    assert stats["torch_vram_total"] == 0 and stats["vram_free"] == box.gpu.free_bytes()


async def _async(value: bool) -> bool:
    return value


async def test_free_during_a_prompt_waits_until_it_finishes(box: Box) -> None:
    async with box.ws("f") as ws:
        await first_frame(ws)
        pid = await box.post_prompt(txt2img(steps=30), "f")
        while json.loads(await ws.recv())["type"] != "progress":
            pass
        assert (await box.http.post("/free", json={"unload_models": True, "free_memory": True})).status_code == 200
        frames = await until_end(ws, pid)
        assert types(frames)[-3:] == ["execution_success", "status", "executing"], "/free does not stop the prompt"
    await until(lambda: _async(box.used() == FLOOR), "the deferred free")
    assert box.sim.loaded() == {}


async def test_free_with_both_flags_false_leaves_vram_alone(box: Box) -> None:
    await box.history(await box.post_prompt(txt2img()))
    await box.http.post("/free", json={"unload_models": False, "free_memory": False})
    await box.clock.advance(0.2)  # past free_delay_s: nothing may come back
    assert box.used() == FLOOR + 6 * GIB and box.sim.loaded() == {SDXL: 6 * GIB}


async def test_highvram_unload_keeps_the_weights_on_the_gpu() -> None:
    gpu = SimulatedGpu(total_bytes=24 * GIB)
    clock = ManualClock(ticking=True)
    sim, server = await make_box(gpu, fast_config(argv=("main.py", "--highvram")), clock)
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http:
            pid = (await http.post("/prompt", json={"prompt": txt2img()})).json()["prompt_id"]
            await until(lambda: _has_history(http, pid), "the prompt")
            await http.post("/free", json={"unload_models": True})
            await clock.advance(0.2)  # past free_delay_s: the weights stay
            assert sim.pid is not None and gpu.used_by(sim.pid) == FLOOR + 6 * GIB
            await http.post("/free", json={"unload_models": True, "free_memory": True})
            await until(lambda: _async(gpu.used_by(sim.pid or 0) == FLOOR), "free_memory to drop the weights")
    finally:
        await sim.stop()


async def _has_history(http: httpx.AsyncClient, pid: str) -> bool:
    return bool((await http.get(f"/history/{pid}")).json())


async def test_free_without_a_body_and_malformed_prompt_json_are_plain_500s(box: Box) -> None:
    r = await box.http.post("/free")
    assert r.status_code == 500 and r.headers["content-type"].startswith("text/plain")
    r = await box.http.post("/prompt", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 500 and r.headers["content-type"].startswith("text/plain")
    assert box.sim.frees == 0


# -- stale running entry ----------------------------------------------------------------------------

async def test_stale_running_entry_stays_in_queue_while_vram_sits_at_the_floor() -> None:
    gpu = SimulatedGpu(total_bytes=24 * GIB)
    sim, server = await make_box(gpu, fast_config(stale_running_entry=True))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http:
            queue = (await http.get("/queue")).json()
            assert [i[1] for i in queue["queue_running"]] == [sim.stale_prompt_id]
            assert sim.pid is not None and gpu.used_by(sim.pid) == FLOOR
            pid = (await http.post("/prompt", json={"prompt": image_graph()})).json()["prompt_id"]
            await until(lambda: _has_history(http, pid), "a new prompt to run past the stuck row")
            queue = (await http.get("/queue")).json()
            assert [i[1] for i in queue["queue_running"]] == [sim.stale_prompt_id]
            assert (await http.get("/prompt")).json()["exec_info"]["queue_remaining"] == 1
            assert gpu.used_by(sim.pid) == FLOOR
    finally:
        await sim.stop()


# -- HTTP surface ----------------------------------------------------------------------------------

async def test_system_stats_has_the_exact_shape_and_reads_the_simulated_gpu(box: Box) -> None:
    await box.history(await box.post_prompt(txt2img()))
    stats = (await box.http.get("/api/system_stats")).json()
    assert list(stats) == ["system", "devices"] and len(stats["devices"]) == 1
    system = stats["system"]
    assert system["os"] == "linux", "sys.platform, as the real 0.8.0 answered"
    assert system["comfyui_version"] == "0.8.0" and system["argv"] == ["main.py"]
    assert isinstance(system["python_version"], str) and system["embedded_python"] is False
    device = stats["devices"][0]
    assert device["name"] == "cuda:0 Simulated RTX 4090 : cudaMallocAsync" and device["type"] == "cuda"
    assert device["index"] == 0 and device["vram_total"] == 24 * GIB
    assert device["vram_free"] == box.gpu.free_bytes()
    assert device["torch_vram_total"] == 6 * GIB and device["torch_vram_free"] == 0


async def test_device_name_follows_the_simulated_gpu_unless_configured() -> None:
    gpu = SimulatedGpu(total_bytes=16 * GIB, name="Simulated RTX 4080")
    for config, expected in ((fast_config(), "cuda:0 Simulated RTX 4080 : cudaMallocAsync"),
                             (fast_config(device_name="cuda:0 X : native"), "cuda:0 X : native")):
        sim, server = await make_box(gpu, config)
        try:
            async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http:
                assert (await http.get("/system_stats")).json()["devices"][0]["name"] == expected
        finally:
            await sim.stop()


async def test_reconnecting_owner_gets_the_node_it_is_running(box: Box) -> None:
    async with box.ws("r") as ws:
        await first_frame(ws)
        pid = await box.post_prompt(txt2img(steps=2000), "r")
        while json.loads(await ws.recv())["type"] != "progress":
            pass
    async with box.ws("r") as again:
        assert (await first_frame(again))["data"]["sid"] == "r"
        assert await first_frame(again) == {"type": "executing", "data": {"node": "3"}}
        await box.http.post("/interrupt", json={"prompt_id": pid})
        assert types(await until_end(again, pid))[-3:] == ["execution_interrupted", "status", "executing"]


async def test_the_process_is_in_the_gpu_with_its_context_floor(box: Box) -> None:
    snapshot = box.gpu.read()
    proc = next(p for p in snapshot.processes if p.pid == box.sim.pid)
    assert proc.name == "python3" and proc.used_bytes == FLOOR
    assert proc.cmdline == f"python3 /opt/ComfyUI/main.py --listen 127.0.0.1 --port {box.server.port}"


async def test_origin_rule_rejects_mismatched_origin_on_loopback_for_http_and_ws(box: Box) -> None:
    port = box.server.port
    bad = [("127.0.0.1:8188", "https://comfy.example"), ("localhost:9000", "http://localhost:8188")]
    for host, origin in bad:
        r = await box.http.get("/system_stats", headers={"Host": host, "Origin": origin})
        assert r.status_code == 403 and r.content == b"", f"{host} vs {origin}"
    ok = [("comfy.example", "https://comfy.example"), (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
          ("localhost:8188", "http://localhost")]  # Origin without port compares hostnames only
    for host, origin in ok:
        r = await box.http.get("/system_stats", headers={"Host": host, "Origin": origin})
        assert r.status_code == 200, f"{host} with {origin} should pass"
    with pytest.raises(InvalidStatus) as rejected:
        async with box.ws("x", origin="http://localhost:3000"):
            pass
    assert rejected.value.response.status_code == 403
    async with box.ws("y", origin=f"http://127.0.0.1:{port}") as ws:
        assert (await first_frame(ws))["data"]["sid"] == "y"


def refusal(kind: str, message: str, details: str = "", node_errors: dict[str, Any] | None = None) -> dict[str, Any]:
    """ComfyUI's 400 body for a refused prompt, as observed."""
    return {"error": {"type": kind, "message": message, "details": details, "extra_info": {}},
            "node_errors": node_errors or {}}


async def test_validation_errors_have_the_observed_bodies_and_still_count_numbers(box: Box) -> None:
    async def post(body: dict[str, Any]) -> httpx.Response:
        return await box.http.post("/prompt", json=body)

    r = await post({"prompt": {"1": {"class_type": "NoSuchNode", "inputs": {}}}})
    assert r.status_code == 400 and r.json() == refusal(
        "invalid_prompt", "Cannot execute because node NoSuchNode does not exist.", "Node ID '#1'")
    r = await post({"prompt": {"1": image_graph()["1"]}})
    assert r.json() == refusal("prompt_no_outputs", "Prompt has no outputs")
    r = await post({"prompt": {"1": image_graph()["1"], "2": {"class_type": "SaveImage", "inputs": {"filename_prefix": "x"}}}})
    missing = {"type": "required_input_missing", "message": "Required input is missing", "details": "images",
               "extra_info": {"input_name": "images"}}
    assert r.json() == refusal("prompt_outputs_failed_validation", "Prompt outputs failed validation",
                               "Required input is missing: images",
                               {"2": {"errors": [missing], "dependent_outputs": ["2"], "class_type": "SaveImage"}})
    r = await post({"prompt": image_graph(width=0)})
    too_small = {"type": "value_smaller_than_min", "message": "Value 0 smaller than min of 1", "details": "width",
                 "extra_info": {"input_name": "width", "received_value": 0,
                                "input_config": ["INT", {"default": 512, "min": 1, "max": 16384, "step": 1}]}}
    assert r.json() == refusal("prompt_outputs_failed_validation", "Prompt outputs failed validation", "",
                               {"1": {"errors": [too_small], "dependent_outputs": ["2"], "class_type": "EmptyImage"}})
    r = await post({"client_id": "x"})
    assert r.json() == refusal("no_prompt", "No prompt provided", "No prompt provided")
    r = await post({"prompt": txt2img(ckpt="missing.safetensors")})
    error = r.json()["node_errors"]["4"]["errors"][0]
    assert r.status_code == 400 and error["type"] == "value_not_in_list"
    assert error["details"] == f"ckpt_name: 'missing.safetensors' not in {sorted([SDXL, SD15])!r}"
    r = await post({"prompt": image_graph()})
    assert r.status_code == 200 and r.json()["number"] == 6, "number counts every POST, rejected ones too"
    assert r.headers["content-type"].startswith("application/json")


def saved(images: Any) -> dict[str, Any]:
    """An EmptyImage -> SaveImage graph whose SaveImage.images input is `images`."""
    return {**image_graph(), "2": {"class_type": "SaveImage", "inputs": {"images": images, "filename_prefix": "x"}}}


async def test_a_link_to_a_missing_node_is_an_exception_during_validation(box: Box) -> None:
    r = await box.http.post("/prompt", json={"prompt": saved(["99", 0])})
    assert r.status_code == 400
    body = r.json()
    assert body["error"] == {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                             "details": "Exception when validating node: '99'", "extra_info": {}}
    (error,) = body["node_errors"]["2"]["errors"]
    assert body["node_errors"]["2"]["dependent_outputs"] == ["2"] and body["node_errors"]["2"]["class_type"] == "SaveImage"
    assert (error["type"], error["message"], error["details"]) == ("exception_during_validation",
                                                                   "Exception when validating node", "'99'")
    assert error["extra_info"]["exception_type"] == "KeyError"
    assert all(isinstance(line, str) for line in error["extra_info"]["traceback"]) and error["extra_info"]["traceback"]
    assert (await box.http.get("/queue")).json()["queue_pending"] == [] and box.sim.executed == 0, "nothing ran"


async def test_a_bad_link_further_up_is_an_inner_exception_on_the_node_that_holds_it(box: Box) -> None:
    graph = txt2img()
    graph["8"]["inputs"]["samples"] = ["99", 0]
    r = await box.http.post("/prompt", json={"prompt": graph})
    assert r.status_code == 400 and r.json()["error"]["details"] == "", "the output's own inputs are fine"
    errors = r.json()["node_errors"]
    assert list(errors) == ["8"] and errors["8"]["dependent_outputs"] == ["9"]
    (error,) = errors["8"]["errors"]
    assert error["type"] == "exception_during_inner_validation" and error["details"] == "'99'"
    extra = error["extra_info"]
    assert extra["input_name"] == "images" and extra["linked_node"] == ["8", 0]
    assert extra["input_config"] == ["IMAGE", {"tooltip": "The images to save."}]
    assert extra["exception_type"] == "KeyError" and extra["exception_message"] == "'99'"


@pytest.mark.parametrize(("images", "kind", "details"), [
    (["1", 3], "exception_during_validation", "tuple index out of range"),
    (["1"], "bad_linked_input", "images"),
    (["1", 0, 1], "bad_linked_input", "images"),
])
async def test_malformed_links_fail_like_execution_py(box: Box, images: list[Any], kind: str, details: str) -> None:
    r = await box.http.post("/prompt", json={"prompt": saved(images)})
    error = r.json()["node_errors"]["2"]["errors"][0]
    assert r.status_code == 400 and (error["type"], error["details"]) == (kind, details)


async def test_a_link_of_the_wrong_type_is_a_return_type_mismatch(box: Box) -> None:
    graph = txt2img()
    graph["9"]["inputs"]["images"] = ["4", 0]  # the checkpoint's MODEL into SaveImage.images
    r = await box.http.post("/prompt", json={"prompt": graph})
    error = r.json()["node_errors"]["9"]["errors"][0]
    assert error["type"] == "return_type_mismatch"
    assert error["details"] == "images, received_type(MODEL) mismatch input_type(IMAGE)"
    assert error["extra_info"] == {"input_name": "images", "input_config": ["IMAGE", {"tooltip": "The images to save."}],
                                   "received_type": "MODEL",
                                   "linked_node": ["4", 0]}


async def test_widget_values_are_converted_like_python_and_bad_ones_are_invalid_input_type(box: Box) -> None:
    graph = image_graph()
    graph["1"]["inputs"]["width"] = "abc"
    r = await box.http.post("/prompt", json={"prompt": graph})
    error = r.json()["node_errors"]["1"]["errors"][0]
    assert error["type"] == "invalid_input_type" and error["message"] == "Failed to convert an input value to a INT value"
    assert error["details"] == "width, abc, invalid literal for int() with base 10: 'abc'"
    graph["1"]["inputs"]["width"] = "64"
    entry = await box.history(await box.post_prompt(graph))
    assert entry["prompt"][2]["1"]["inputs"]["width"] == 64, "ComfyUI stores the converted value in the prompt"


@pytest.mark.parametrize(("body", "status", "kind"), [
    ([], 400, "no_prompt"), (["client_id"], 400, "no_prompt"), ("text", 400, "no_prompt"),
    ({"prompt": []}, 400, "prompt_no_outputs"), ({"prompt": ""}, 400, "prompt_no_outputs"),
    (5, 500, None), (None, 500, None), (["prompt"], 500, None), ({"prompt": ["1"]}, 500, None),
    ({"prompt": 5}, 500, None), ({"prompt": {"1": 5}}, 500, None), ({"prompt": {"1": "no class"}}, 400, "invalid_prompt"),
])
async def test_prompt_bodies_of_other_json_types_get_what_server_py_does(box: Box, body: Any, status: int,
                                                                         kind: str | None) -> None:
    r = await box.http.post("/prompt", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if kind is None:
        assert r.headers["content-type"].startswith("text/plain")
    else:
        assert r.json()["error"]["type"] == kind


async def test_a_list_body_still_counts_a_number(box: Box) -> None:
    await box.http.post("/prompt", json=[])
    await box.http.post("/prompt", json=5)  # raises before the counter
    r = await box.http.post("/prompt", json={"prompt": image_graph()})
    assert r.json()["number"] == 1


async def test_partial_execution_targets_pick_outputs_before_validation(box: Box) -> None:
    r = await box.http.post("/prompt", json={"prompt": image_graph(), "partial_execution_targets": ["7"]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "prompt_no_outputs"
    graph = {**image_graph(), "3": {"class_type": "PreviewImage", "inputs": {}}}
    r = await box.http.post("/prompt", json={"prompt": graph, "partial_execution_targets": ["2"]})
    assert r.status_code == 200 and r.json()["node_errors"] == {}, "the invalid output was never a target"


async def test_queue_and_history_carry_create_time_but_not_the_api_keys(box: Box) -> None:
    before = int(time.time() * 1000)
    pid = await box.post_prompt(image_graph(), "k", extra_data={"api_key_comfy_org": "secret", "extra_pnginfo": {}})
    extra = (await box.history(pid))["prompt"][3]
    assert list(extra) == ["extra_pnginfo", "client_id", "create_time"]
    assert before <= extra["create_time"] <= int(time.time() * 1000)


async def test_partially_valid_prompt_is_queued_with_node_errors(box: Box) -> None:
    graph = {**image_graph(), "3": {"class_type": "PreviewImage", "inputs": {}}}
    r = await box.http.post("/prompt", json={"prompt": graph})
    assert r.status_code == 200 and list(r.json()["node_errors"]) == ["3"]
    entry = await box.history(r.json()["prompt_id"])
    assert entry["prompt"][4] == ["2"] and list(entry["outputs"]) == ["2"]


async def test_bodies_over_max_upload_size_get_413() -> None:
    gpu = SimulatedGpu(total_bytes=24 * GIB)
    sim, server = await make_box(gpu, fast_config(max_upload_size_mb=0.01))
    try:
        async with httpx.AsyncClient(verify=LOOPBACK_TLS, base_url=server.url) as http:
            r = await http.post("/prompt", content=b"x" * 20_000, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "Maximum request body size" in r.text
            features = (await http.get("/features")).json()
            assert features["max_upload_size"] == 10485
    finally:
        await sim.stop()


async def test_view_serves_outputs_with_range_and_rejects_traversal(box: Box) -> None:
    entry = await box.history(await box.post_prompt(image_graph(prefix="ComfyUI")))
    image = entry["outputs"]["2"]["images"][0]
    r = await box.http.get("/view", params={"filename": image["filename"], "type": "output", "subfolder": ""})
    assert r.status_code == 200 and r.content.startswith(b"\x89PNG") and r.headers["content-type"] == "image/png"
    assert r.headers["content-disposition"] == f'filename="{image["filename"]}"'
    r2 = await box.http.get("/api/view", params={"filename": image["filename"]}, headers={"Range": "bytes=0-3"})
    assert r2.status_code == 206 and r2.content == b"\x89PNG"
    assert (await box.http.get("/view", params={"filename": "../secret"})).status_code == 400
    assert (await box.http.get("/view", params={"filename": "x.png", "subfolder": "../.."})).status_code == 403
    assert (await box.http.get("/view", params={"filename": "none.png"})).status_code == 404


async def test_upload_renames_different_files_and_reuses_identical_ones(box: Box) -> None:
    async def upload(data: bytes, **fields: str) -> dict[str, Any]:
        r = await box.http.post("/upload/image", files={"image": ("cat.png", data, "image/png")}, data=fields)
        assert r.status_code == 200, r.text
        return dict(r.json())

    assert await upload(b"one") == {"name": "cat.png", "subfolder": "", "type": "input"}
    assert (await upload(b"one"))["name"] == "cat.png", "identical content is reused"
    assert (await upload(b"two"))["name"] == "cat (1).png"
    assert (await upload(b"three", overwrite="true"))["name"] == "cat.png"
    assert await upload(b"x", subfolder="pets", type="temp") == {"name": "cat.png", "subfolder": "pets", "type": "temp"}
    r = await box.http.get("/view", params={"filename": "cat.png", "type": "input"})
    assert r.content == b"three"
    r = await box.http.post("/upload/image", data={"type": "input"}, files={"other": ("a", b"1")})
    assert r.status_code == 400


async def test_catalogue_routes_answer_under_both_prefixes(box: Box) -> None:
    for prefix in ("", "/api"):
        info = (await box.http.get(f"{prefix}/object_info")).json()
        assert {"CheckpointLoaderSimple", "CLIPTextEncode", "EmptyLatentImage", "KSampler", "VAEDecode",
                "SaveImage", "PreviewImage", "EmptyImage"} <= set(info)
        one = (await box.http.get(f"{prefix}/object_info/CheckpointLoaderSimple")).json()
        assert one["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == sorted([SDXL, SD15])
        assert one["CheckpointLoaderSimple"]["output"] == ["MODEL", "CLIP", "VAE"]
        assert (await box.http.get(f"{prefix}/models/checkpoints")).json() == sorted([SDXL, SD15])
        assert (await box.http.get(f"{prefix}/models/nope")).status_code == 404
        assert "checkpoints" in (await box.http.get(f"{prefix}/models")).json()
        assert (await box.http.get(f"{prefix}/embeddings")).json() == []
        assert (await box.http.get(f"{prefix}/extensions")).json() == []
        assert (await box.http.get(f"{prefix}/features")).json()["supports_preview_metadata"] is True
        assert (await box.http.get(f"{prefix}/queue")).json() == {"queue_running": [], "queue_pending": []}
    r = await box.http.get("/")
    assert r.status_code == 200 and "<html" in r.text
    assert r.headers["content-type"] == "text/html", "a real ComfyUI 0.8.0 sends its index as text/html, no charset"


async def test_models_lists_latent_upscale_models_after_upscale_models(box: Box) -> None:
    folders = (await box.http.get("/models")).json()
    assert folders[folders.index("upscale_models") + 1] == "latent_upscale_models"
    assert (await box.http.get("/api/models/latent_upscale_models")).json() == []


@pytest.mark.parametrize("path", ["/nope", "/api/nope", "/interrupt", "/api/free", "/prompt/", "/api"])
async def test_a_get_no_route_takes_is_a_404_with_an_empty_body(box: Box, path: str) -> None:
    for method in ("GET", "HEAD"):
        r = await box.http.request(method, path)
        assert (r.status_code, r.content) == (404, b""), (method, path)


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("POST", "/nope", "GET,HEAD"), ("DELETE", "/prompt", "GET,HEAD,POST"), ("PUT", "/api/interrupt", "GET,HEAD,POST"),
    ("POST", "/system_stats", "GET,HEAD"), ("PATCH", "/", "GET,HEAD"),
])
async def test_other_methods_get_aiohttps_405_text_with_allow(box: Box, method: str, path: str, allow: str) -> None:
    r = await box.http.request(method, path)
    assert (r.status_code, r.text, r.headers["allow"]) == (405, "405: Method Not Allowed", allow)
    assert r.headers["content-type"] == "text/plain; charset=utf-8"


async def test_options_is_answered_by_the_middleware_on_any_path(box: Box) -> None:
    for path in ("/prompt", "/nope"):
        r = await box.http.options(path)
        assert (r.status_code, r.content) == (200, b""), path


def test_from_scenario_converts_gib_and_rejects_unknown_keys() -> None:
    config = ComfySimConfig.from_scenario({"checkpoints": {SDXL: 6.5}, "context_floor_gb": 0.4, "free_delay_s": 0.5,
                                           "stale_running_entry": True, "argv": ["main.py", "--highvram"]})
    assert config.checkpoints == {SDXL: int(6.5 * GIB)} and config.context_floor_bytes == int(0.4 * GIB)
    assert config.free_delay_s == 0.5 and config.stale_running_entry and config.argv == ("main.py", "--highvram")
    with pytest.raises(ValueError, match="checkpoint"):
        ComfySimConfig.from_scenario({"checkpoint": {}})


# -- 0.8.0: versions, aiohttp headers, object_info as nodes.py, /userdata and /settings (issue 27) ----

async def test_system_stats_reports_0_8_0_with_its_frontend_and_torch(box: Box) -> None:
    system = (await box.http.get("/system_stats")).json()["system"]
    assert system["comfyui_version"] == "0.8.0"
    assert system["required_frontend_version"] == "1.35.9" and system["pytorch_version"] == "2.9.1+cu128"
    assert system["installed_templates_version"] == system["required_templates_version"] == "0.7.64"


async def test_every_response_carries_aiohttps_date_and_server(box: Box) -> None:
    for method, path in (("GET", "/system_stats"), ("POST", "/interrupt"), ("GET", "/nope"), ("OPTIONS", "/x"),
                         ("PATCH", "/"), ("HEAD", "/queue")):
        r = await box.http.request(method, path)
        assert re.fullmatch(r"Python/3\.\d+ aiohttp/3\.13\.3", r.headers["server"]), (method, path, r.headers)
        assert r.headers["date"].endswith(" GMT") and email.utils.parsedate_to_datetime(r.headers["date"]), path


async def test_empty_answers_carry_no_content_type_as_a_real_comfyui_sends_none(box: Box) -> None:
    for method, path, body in (("POST", "/interrupt", None), ("POST", "/free", {"unload_models": True}),
                               ("POST", "/queue", {"clear": True}), ("GET", "/models/nope", None),
                               ("OPTIONS", "/prompt", None)):
        r = await box.http.request(method, path, json=body)
        assert (r.status_code, r.content) in ((200, b""), (404, b"")), (method, path)
        assert "content-type" not in r.headers, (method, path, r.headers.get("content-type"))
        assert r.headers["content-length"] == "0", (method, path)


async def test_an_unrouted_get_is_the_static_routes_missing_file(box: Box) -> None:
    """aiohttp >= 3.10: the static root's FileResponse sets 404 and streams an empty body (chunked)."""
    r = await box.http.get("/nope.js")
    assert (r.status_code, r.content) == (404, b"")
    assert r.headers["content-type"] == "application/octet-stream" and r.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in r.headers
    head = await box.http.head("/nope")
    assert head.status_code == 404 and "content-type" not in head.headers


async def test_the_websocket_upgrade_carries_date_and_server(box: Box) -> None:
    async with box.ws("abc") as ws:
        assert ws.response is not None
        assert ws.response.headers["Server"].startswith("Python/3.")
        assert ws.response.headers["Date"].endswith(" GMT")


async def test_object_info_follows_nodes_py(box: Box) -> None:
    info = (await box.http.get("/object_info")).json()
    empty = info["EmptyImage"]["input"]["required"]
    assert empty["color"] == ["INT", {"default": 0, "min": 0, "max": 0xFFFFFF, "step": 1, "display": "color"}]
    assert empty["batch_size"] == ["INT", {"default": 1, "min": 1, "max": 4096}], "no step in nodes.py"
    latent = info["EmptyLatentImage"]["input"]["required"]
    assert latent["batch_size"] == ["INT", {"default": 1, "min": 1, "max": 4096,
                                            "tooltip": "The number of latent images in the batch."}]
    assert latent["width"][1] == {"default": 512, "min": 16, "max": 16384, "step": 8,
                                  "tooltip": "The width of the latent images in pixels."}
    sampler = info["KSampler"]
    assert sampler["input"]["required"]["seed"] == ["INT", {
        "default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True,
        "tooltip": "The random seed used for creating the noise."}]
    assert sampler["output_tooltips"] == ["The denoised latent."]
    assert sampler["description"] == "Uses the provided model, positive and negative conditioning to denoise the latent image."
    assert info["VAEDecode"]["input"]["required"]["vae"] == ["VAE", {"tooltip": "The VAE model used for decoding the latent."}]
    assert info["PreviewImage"]["input"]["required"] == {"images": ["IMAGE"]}
    assert "output_tooltips" not in info["SaveImage"] and "output_tooltips" not in info["EmptyImage"]
    assert info["CheckpointLoaderSimple"]["output_tooltips"][2].startswith("The VAE model")


async def test_a_validation_error_shows_the_input_config_with_its_tooltip(box: Box) -> None:
    graph = txt2img()
    graph["5"]["inputs"]["batch_size"] = 0
    r = await box.http.post("/prompt", json={"prompt": graph})
    error = r.json()["node_errors"]["5"]["errors"][0]
    assert error["extra_info"]["input_config"] == ["INT", {"default": 1, "min": 1, "max": 4096,
                                                           "tooltip": "The number of latent images in the batch."}]


async def test_a_workflow_is_saved_listed_read_and_deleted_like_the_web_ui_does(box: Box) -> None:
    listing = await box.http.get("/api/userdata", params={"dir": "workflows", "recurse": "true", "split": "false",
                                                          "full_info": "true"})
    assert (listing.status_code, listing.text) == (404, "Directory not found")
    assert listing.headers["content-type"] == "text/plain; charset=utf-8"
    workflow = b'{"last_node_id": 9, "nodes": []}'
    saved = await box.http.post("/api/userdata/workflows%2Fmy%20flow.json?overwrite=false&full_info=true",
                                content=workflow)
    assert saved.status_code == 200 and saved.headers["content-type"] == "application/json; charset=utf-8"
    info = saved.json()
    assert info["path"] == "workflows/my flow.json" and info["size"] == len(workflow)
    assert isinstance(info["modified"], float) and isinstance(info["created"], float), "getmtime(): seconds"
    again = await box.http.post("/api/userdata/workflows%2Fmy%20flow.json?overwrite=false", content=b"{}")
    assert (again.status_code, again.text) == (409, "File already exists")
    plain = await box.http.post("/userdata/workflows%2Fmy%20flow.json", content=workflow)
    assert plain.json() == "workflows/my flow.json", "overwrite defaults to true; the answer is the relative path"
    listed = (await box.http.get("/api/userdata", params={"dir": "workflows", "recurse": "true",
                                                          "full_info": "true"})).json()
    assert [(e["path"], e["size"]) for e in listed] == [("my flow.json", len(workflow))]
    assert (await box.http.get("/userdata?dir=workflows")).json() == ["my flow.json"]
    assert (await box.http.get("/userdata?dir=workflows&split=true")).json() == [["my flow.json", "my flow.json"]]
    read = await box.http.get("/api/userdata/workflows%2Fmy%20flow.json")
    assert (read.status_code, read.content) == (200, workflow)
    assert read.headers["content-type"] == "application/json" and read.headers["content-length"] == str(len(workflow))
    assert re.fullmatch(r'"[0-9a-f]+-[0-9a-f]+"', read.headers["etag"]) and "last-modified" in read.headers
    assert (box.sim.base_dir / "user" / "default" / "workflows" / "my flow.json").read_bytes() == workflow
    deleted = await box.http.delete("/api/userdata/workflows%2Fmy%20flow.json")
    assert (deleted.status_code, deleted.content) == (204, b"") and "content-type" not in deleted.headers
    gone = await box.http.get("/api/userdata/workflows%2Fmy%20flow.json")
    assert (gone.status_code, gone.content, gone.headers.get("content-type")) == (404, b"", None)
    assert (await box.http.delete("/userdata/workflows%2Fmy%20flow.json")).status_code == 404


async def test_userdata_refuses_paths_leaving_the_user_directory(box: Box) -> None:
    for path in ("/userdata/..%2F..%2Fsecret.json", "/userdata/%2Fetc%2Fpasswd", "/userdata/%252E%252E%252Fx.json"):
        for method in ("GET", "POST", "DELETE"):
            r = await box.http.request(method, path, content=b"{}" if method == "POST" else None)
            assert (r.status_code, r.content) == (403, b""), (method, path)
            assert "content-type" not in r.headers
    listing = await box.http.get("/userdata", params={"dir": "../.."})
    assert (listing.status_code, listing.text) == (403, "Invalid directory")
    missing = await box.http.get("/userdata")
    assert (missing.status_code, missing.text) == (400, "Directory not provided")
    assert not (box.sim.base_dir / "secret.json").exists() and not (box.sim.base_dir / "x.json").exists()


async def test_a_literal_slash_in_the_file_name_is_a_path_no_route_takes(box: Box) -> None:
    """aiohttp's {file} is one segment: /userdata/a/b is left to the static route (GET 404, POST 405)."""
    r = await box.http.post("/userdata/workflows/a.json", content=b"{}")
    assert (r.status_code, r.text, r.headers["allow"]) == (405, "405: Method Not Allowed", "GET,HEAD")
    get = await box.http.get("/userdata/workflows/a.json")
    assert (get.status_code, get.content) == (404, b"") and "content-length" not in get.headers


async def test_settings_are_read_merged_and_stored_in_comfy_settings_json(box: Box) -> None:
    assert (await box.http.get("/api/settings")).json() == {}
    missing = await box.http.get("/api/settings/Comfy.Locale")
    assert (missing.status_code, missing.text) == (200, "null")
    posted = await box.http.post("/api/settings", json={"Comfy.Locale": "en", "Comfy.ColorPalette": "dark"})
    assert (posted.status_code, posted.content, posted.headers.get("content-type")) == (200, b"", None)
    one = await box.http.post("/api/settings/Comfy.Locale", json="fr")
    assert (one.status_code, one.content) == (200, b"")
    assert (await box.http.get("/settings")).json() == {"Comfy.Locale": "fr", "Comfy.ColorPalette": "dark"}
    assert (await box.http.get("/settings/Comfy.ColorPalette")).json() == "dark"
    stored = box.sim.base_dir / "user" / "default" / "comfy.settings.json"
    assert stored.read_text() == json.dumps({"Comfy.Locale": "fr", "Comfy.ColorPalette": "dark"}, indent=4)
    as_file = await box.http.get("/userdata/comfy.settings.json")
    assert as_file.json() == {"Comfy.Locale": "fr", "Comfy.ColorPalette": "dark"}


async def test_settings_bodies_that_are_not_json_are_aiohttps_500(box: Box) -> None:
    for path, body in (("/settings", b"{"), ("/settings/Comfy.Locale", b""), ("/settings", b"[1]")):
        r = await box.http.post(path, content=body)
        assert (r.status_code, r.text) == (500, "500 Internal Server Error\n\nServer got itself in trouble"), path
