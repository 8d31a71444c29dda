"""Progress on the wire, the pure parts: which requests stream, the lines' framing, the errors."""

from __future__ import annotations

import json

import pytest

from proxy.clock import ManualClock
from proxy.config.schema import Tenant
from proxy.engines import ComfyUIAdapter, OllamaAdapter
from proxy.engines.ports import Streamed
from proxy.relay.progress import Framing, error_message, wait_line, wanted
from proxy.relay.trace import Trace


def ollama() -> OllamaAdapter:
    return OllamaAdapter(Tenant(name="ollama", engine="ollama", upstream="http://127.0.0.1:11434"))


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "ndjson-chat"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}, None),
    ("/api/chat", {"model": "m", "messages": []}, None),  # a load: one JSON object even with stream on
    ("/api/generate", {"model": "m", "prompt": "hi"}, "ndjson-generate"),
    ("/api/generate", {"model": "m", "keep_alive": 0}, None),
    ("/v1/chat/completions", {"model": "m", "messages": [], "stream": True}, "sse-chat"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, None),  # OpenAI streams only when asked
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, "sse-completion"),
    ("/api/embed", {"model": "m", "input": "hi"}, None),
])
def test_only_the_engines_streamed_answers_get_progress(path: str, body: dict[str, object], expected: str | None) -> None:
    got = ollama().stream_format(path, json.dumps(body).encode())
    assert (got.format if got else None) == expected


def test_comfyui_prompts_never_stream() -> None:
    adapter = ComfyUIAdapter(Tenant(name="comfyui", engine="comfyui", upstream="http://127.0.0.1:8188"))
    assert adapter.stream_format("/prompt", b'{"prompt": {}}') is None


@pytest.mark.parametrize(("setting", "header", "on"), [
    ("streams", None, True), ("off", None, False), ("off", "on", True), ("streams", "off", False), ("streams", "??", True)])
def test_the_header_overrides_the_tenants_setting(setting: str, header: str | None, on: bool) -> None:
    assert wanted(setting, header) is on


def test_a_wait_reads_as_who_and_why() -> None:
    entry = {"reason": "queued behind comfyui (1 running job(s))", "waiting_for": ["comfyui"], "releasing": []}
    assert wait_line(entry) == "waiting for comfyui: 1 running job(s)"
    assert wait_line({"reason": "x", "releasing": ["comfyui", "stt"]}) == "releasing comfyui, stt to make room"


def test_each_format_frames_a_line_where_its_clients_show_thinking() -> None:
    clock = ManualClock()
    chat = json.loads(Framing(Streamed("ndjson-chat", "m"), clock).progress("waiting"))
    assert chat["message"] == {"role": "assistant", "content": "", "thinking": "waiting\n"} and chat["done"] is False
    gen = json.loads(Framing(Streamed("ndjson-generate", "m"), clock).progress("waiting"))
    assert gen["thinking"] == "waiting\n" and gen["response"] == "" and gen["done"] is False
    sse = Framing(Streamed("sse-chat", "m"), clock)
    first, second = sse.progress("a"), sse.progress("b")
    assert first.startswith(b"data: ") and first.endswith(b"\n\n")
    assert json.loads(first[6:])["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "a\n"}
    assert json.loads(second[6:])["choices"][0]["delta"] == {"reasoning_content": "b\n"}
    assert json.loads(sse.error("gone")[6:]) == {"error": {"message": "gone", "type": "api_error", "param": None,
                                                         "code": None}}
    assert json.loads(Framing(Streamed("ndjson-chat", "m"), clock).error("gone")) == {"error": "gone"}


def test_an_error_answer_keeps_its_message_and_fix() -> None:
    assert error_message(503, b'{"error": "waited", "fix": "retry"}') == "waited (fix: retry)"
    assert error_message(500, b'{"error": {"message": "boom", "type": "api_error"}}') == "boom"
    assert error_message(502, b"bad gateway") == "HTTP 502: bad gateway"


def test_server_timing_lists_the_phases_in_order_and_adds_a_repeated_one() -> None:
    trace = Trace()
    assert trace.server_timing() is None
    trace.phase("release", 0.5, 'released "comfyui"')
    trace.phase("queue", 1.25, "waited for comfyui")
    trace.phase("queue", 0.25, "waited for comfyui")
    assert trace.server_timing() == (b'queue;dur=1500.0;desc="waited for comfyui", '
                                     b"release;dur=500.0;desc=\"released 'comfyui'\"")


def test_a_held_swap_reads_as_a_choice_not_as_a_wait_for_busy_work() -> None:
    reason = ("holding the swap of ollama for 1 s (proxy.swap_hold_s, weighed by its reload): requests for what is "
              "on the card go first")
    line = wait_line({"reason": reason, "waiting_for": ["ollama"], "releasing": []})
    assert line.startswith("keeping ollama on the card 1.0 s before releasing it: it was just used"), line
    assert "waiting" not in line
