"""ComfyUI checkpoint loads timed from execution frames: the loader node's executing frame to the
next executing frame of that prompt; a cached loader loads nothing."""

from __future__ import annotations

import json

from proxy.models.frames import FrameTimer, loader_nodes


def frame(kind: str, **data: object) -> str:
    return json.dumps({"type": kind, "data": data})


def test_the_loader_nodes_are_the_ones_naming_the_checkpoint() -> None:
    body = json.dumps({"prompt": {"4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd.safetensors"}},
                                  "9": {"class_type": "SaveImage", "inputs": {}}}}).encode()
    assert loader_nodes(body, "sd.safetensors") == ("4",)
    assert loader_nodes(body, "other") == () and loader_nodes(b"not json", "sd") == ()


def test_a_load_lasts_from_its_nodes_executing_frame_to_the_next() -> None:
    now = [100.0]
    timer: FrameTimer[str] = FrameTimer(lambda: now[0])
    timer.expect(("4",), "sd")
    assert timer.on_frame(frame("execution_cached", nodes=[], prompt_id="p")) == []
    assert timer.on_frame(frame("executing", node="4", display_node="4", prompt_id="p")) == []
    now[0] = 103.5
    assert timer.on_frame(frame("progress", value=1, max=2, prompt_id="p")) == []
    assert timer.on_frame(frame("executing", node="6", display_node="6", prompt_id="p")) == [("sd", 3.5)]
    assert timer.expected == []


def test_a_cached_loader_loads_nothing_and_another_prompt_does_not_end_a_load() -> None:
    now = [0.0]
    timer: FrameTimer[str] = FrameTimer(lambda: now[0])
    timer.expect(("4",), "cached")
    timer.on_frame(frame("execution_cached", nodes=["4", "5"], prompt_id="a"))
    assert timer.expected == []
    timer.expect(("4",), "sd")
    timer.on_frame(frame("executing", node="4", prompt_id="b"))
    now[0] = 2.0
    assert timer.on_frame(frame("executing", node="7", prompt_id="other")) == []
    assert timer.on_frame(frame("executing", node=None, prompt_id="b")) == [("sd", 2.0)]
