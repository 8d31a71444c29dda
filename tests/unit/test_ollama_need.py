"""What an Ollama request is planned to need: the model's file plus the context allowance until
Ollama has been seen holding it, then the footprint Ollama itself reported (`/api/ps` size), per
model content (digest) and load options, kept true when a name changes and across restarts. The
engine's control calls are answered by respx; shapes from the wire facts (A.6, A.11)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from proxy.config.units import GIB
from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict

OLLAMA = "http://127.0.0.1:11434"
FILE = int(15.2 * GIB)
FOOTPRINT = int(16.2 * GIB)  # file, KV cache for its context, runtime
BIG_CTX = int(22.5 * GIB)  # the same model loaded with num_ctx 32768
DIGEST = "a" * 64
OTHER = "b" * 64


@pytest.fixture
def engine() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
        router.get(f"{OLLAMA}/api/tags").respond(json=tags(("gemma3:27b", FILE, DIGEST)))
        yield router


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def adapter(state: Path | None = None) -> Any:
    tenant = registry_from_dict({"tenants": {"ollama": {"upstream": OLLAMA, "context_allowance_gb": 2.0}}}).get("ollama")
    a = adapter_for(tenant)
    a.keep_state_in(state)
    return a


def tags(*models: tuple[str, int, str]) -> dict[str, Any]:
    return {"models": [{"name": n, "model": n, "size": size, "digest": d} for n, size, d in models]}


def body(model: str = "gemma3:27b", **extra: Any) -> bytes:
    return json.dumps({"model": model, "prompt": "hi", **extra}).encode()


def ps(size: int, size_vram: int, ctx: int = 4096, name: str = "gemma3:27b", digest: str = DIGEST) -> dict[str, Any]:
    return {"models": [{"name": name, "model": name, "size": size, "size_vram": size_vram, "digest": digest,
                        "expires_at": "2026-12-06T12:00:00Z", "context_length": ctx}]}


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def loaded(engine: respx.MockRouter, client: httpx.AsyncClient, a: Any, request: bytes, row: dict[str, Any]) -> None:
    """A request answered through the proxy (it loaded the model), then the watchdog's read of /api/ps."""
    a.saw_gpu_answer("/api/generate", request, 200)
    engine.get(f"{OLLAMA}/api/ps").respond(json=row)
    await a.placements(client)


async def test_the_need_is_the_file_plus_the_allowance_until_ollama_is_seen_holding_the_model(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    before = await a.estimate_need("/api/generate", body(), client)
    assert before.bytes == FILE + 2 * GIB and "context allowance" in before.what
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT))
    after = await a.estimate_need("/api/generate", body(), client)
    assert after.bytes == FOOTPRINT and "as Ollama reported it loaded" in after.what
    assert after.key == before.key


async def test_a_footprint_below_the_file_is_not_believed(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    await loaded(engine, client, a, body(), ps(FILE // 2, FILE // 2))
    assert (await a.estimate_need("/api/generate", body(), client)).bytes == FILE


async def test_each_num_ctx_is_planned_on_its_own_footprint_and_is_never_the_load_on_the_card(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    """The issue's sequence: after a num_ctx 32768 load showed 22.5 GiB, the default request was
    planned at 22.5 and the 32768 one at 17.2, and with the model resident a num_ctx request was
    admitted at once (Ollama reloads a runner whose context differs)."""
    a = adapter()
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT, ctx=4096))
    default = await a.estimate_need("/api/generate", body(), client)
    big_first = await a.estimate_need("/api/generate", body(options={"num_ctx": 32768}), client)
    assert default.bytes == FOOTPRINT
    assert big_first.bytes == FILE + 2 * GIB, "a context never seen loaded is planned on the prior, not the default's"
    assert big_first.key != default.key, "another num_ctx is another load: never 'already on the card'"
    await loaded(engine, client, a, body(options={"num_ctx": 32768}), ps(BIG_CTX, BIG_CTX, ctx=32768))
    big = await a.estimate_need("/api/generate", body(options={"num_ctx": 32768, "temperature": 0}), client)
    assert big.bytes == BIG_CTX and big.key == big_first.key, "num_ctx 32768 is planned on what it showed"
    assert (await a.estimate_need("/api/generate", body(), client)).bytes == FOOTPRINT, \
        "the default request was planned on the num_ctx 32768 footprint"
    row = ps(BIG_CTX, BIG_CTX, ctx=32768)["models"][0]
    assert a.placement_key(row) == big.key != default.key, "the runner on the card is the 32768 one"
    assert a.load_key("gemma3:27b") == "ollama:gemma3:27b" and big.key.startswith("ollama:gemma3:27b?")


async def test_a_load_under_way_with_another_context_is_not_the_default_load_answered_before_it(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    """Between a num_ctx 32768 request's forward and its answer /api/ps already lists its runner: it is
    that load (its reservation's key), not the default one the last answer was for."""
    a = adapter()
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT, ctx=4096))
    default = await a.estimate_need("/api/generate", body(), client)
    big = await a.estimate_need("/api/generate", body(options={"num_ctx": 32768}), client)
    engine.get(f"{OLLAMA}/api/ps").respond(json=ps(BIG_CTX, FOOTPRINT, ctx=32768))  # loading, not answered yet
    (row,) = await a.placements(client)
    assert a.placement_key(row) == big.key != default.key
    assert (await a.estimate_need("/api/generate", body(), client)).bytes == FOOTPRINT


async def test_a_new_default_context_after_an_ollama_upgrade_is_learned_from_the_next_default_answer(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT, ctx=4096))
    await loaded(engine, client, a, body(), ps(BIG_CTX, BIG_CTX, ctx=32768))  # v0.15.5 on a 24 GiB card: 32768
    default = await a.estimate_need("/api/generate", body(), client)
    assert default.bytes == BIG_CTX, "the default load's footprint stayed the old default's"
    assert a.placement_key(ps(BIG_CTX, BIG_CTX, ctx=32768)["models"][0]) == default.key


async def test_options_that_never_reload_keep_the_default_load(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    default = await a.estimate_need("/api/generate", body(), client)
    same = [await a.estimate_need("/api/generate", body(options=o), client)
            for o in ({"temperature": 0.2, "num_predict": 9}, {"num_gpu": -1}, {"num_ctx": None})]
    assert {n.key for n in same} == {default.key}
    assert (await a.estimate_need("/api/chat", body(options={"num_ctx": 32768.0}), client)).key == \
        (await a.estimate_need("/api/generate", body(options={"num_ctx": 32768}), client)).key


async def test_a_model_ollama_split_with_the_cpu_is_planned_at_least_at_the_size_it_split_at(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    await loaded(engine, client, a, body(), ps(FILE + 3 * GIB, FILE // 2))  # 3 GiB of KV and runtime, half on the CPU
    need = await a.estimate_need("/api/generate", body(), client)
    assert need.bytes == FILE + 3 * GIB and "split it with the CPU" in need.what


async def test_a_name_copied_over_is_planned_as_the_new_model(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    """The issue's sequence: `/api/copy` passed through untouched, and a model copied over another name
    was planned at the old size and spilled (16.2 GiB with 11.25 on the card)."""
    engine.get(f"{OLLAMA}/api/tags").respond(json=tags(("gemma3:27b", FILE, DIGEST), ("small:latest", 2 * GIB, OTHER)))
    a = adapter()
    await loaded(engine, client, a, body("small"), ps(3 * GIB, 3 * GIB, name="small:latest", digest=OTHER))
    assert (await a.estimate_need("/api/generate", body("small"), client)).bytes == 3 * GIB
    engine.get(f"{OLLAMA}/api/tags").respond(json=tags(("gemma3:27b", FILE, DIGEST), ("small:latest", FILE, DIGEST)))
    copy = json.dumps({"source": "gemma3:27b", "destination": "small"}).encode()
    assert a.model_news("POST", "/api/copy")
    a.saw_model_news("POST", "/api/copy", copy, 200, b"")
    copied = await a.estimate_need("/api/generate", body("small"), client)
    assert copied.bytes == FILE + 2 * GIB, "planned at the size of the model the name had before the copy"
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT))
    assert (await a.estimate_need("/api/generate", body("small"), client)).bytes == FOOTPRINT, \
        "the same content under another name takes what it took"


async def test_a_failed_change_keeps_the_footprint_and_a_pull_create_or_delete_forgets_the_name(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT))
    tags_route = engine.get(f"{OLLAMA}/api/tags")
    a.saw_model_news("DELETE", "/api/delete", json.dumps({"model": "gemma3:27b"}).encode(), 404, b"")
    await a.estimate_need("/api/generate", body(), client)
    assert tags_route.call_count == 1, "a refused change is no change"
    named = {"model": "gemma3:27b"}
    for method, path, request in (("POST", "/api/pull", named), ("POST", "/api/create", named),
                                  ("DELETE", "/api/delete", named)):
        assert a.model_news(method, path)
        a.saw_model_news(method, path, json.dumps(request).encode(), 200, b"")
        calls = tags_route.call_count
        await a.estimate_need("/api/generate", body(), client)
        assert tags_route.call_count == calls + 1, f"{path} passed: the name's digest must be read again"
    assert not a.model_news("POST", "/api/show") and not a.model_news("GET", "/api/ps")


async def test_a_model_list_with_a_new_digest_for_a_name_drops_its_footprint(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    await loaded(engine, client, a, body(), ps(FOOTPRINT, FOOTPRINT))
    listing = json.dumps(tags(("gemma3:27b", FILE, OTHER))).encode()  # pulled again behind the proxy
    a.saw_model_news("GET", "/api/tags", b"", 200, listing)  # a client's /api/tags passing through
    need = await a.estimate_need("/api/generate", body(), client)
    assert need.bytes == FILE + 2 * GIB, "the old content's footprint was used for the new one"


async def test_footprints_outlive_a_restart_in_the_state_folder(
        engine: respx.MockRouter, client: httpx.AsyncClient, tmp_path: Path) -> None:
    """The issue's sequence: footprints lived in memory, so after every restart the first request was
    planned on the file size and released ComfyUI needlessly."""
    first = adapter(tmp_path)
    await loaded(engine, client, first, body(), ps(FOOTPRINT, FOOTPRINT))
    await loaded(engine, client, first, body(options={"num_ctx": 32768}), ps(BIG_CTX, BIG_CTX, ctx=32768))
    assert files_in(tmp_path) == ["ollama.footprints.json"], "written whole, with no file left half way"
    again = adapter(tmp_path)  # a restarted proxy: nothing read from /api/ps yet
    assert (await again.estimate_need("/api/generate", body(), client)).bytes == FOOTPRINT
    assert (await again.estimate_need("/api/generate", body(options={"num_ctx": 32768}), client)).bytes == BIG_CTX
    engine.get(f"{OLLAMA}/api/ps").respond(json=ps(FOOTPRINT, FOOTPRINT, ctx=4096))
    assert again.placement_key((await again.placements(client))[0]) == \
        (await again.estimate_need("/api/generate", body(), client)).key, \
        "a default load on the card before the restart is still the default load"


async def test_a_bad_footprints_file_is_ignored_with_a_warning(
        engine: respx.MockRouter, client: httpx.AsyncClient, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for text in ("{not json", json.dumps({"version": 99, "footprints": []}),
                 json.dumps({"version": 1, "footprints": [{"content": DIGEST, "shape": [], "bytes": -5}]})):
        (tmp_path / "ollama.footprints.json").write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hyperswap.engines"):
            a = adapter(tmp_path)
        assert "ignoring the Ollama footprints" in caplog.text
        assert (await a.estimate_need("/api/generate", body(), client)).bytes == FILE + 2 * GIB




async def test_one_request_body_is_parsed_once_for_its_stream_format_need_and_answer(
        engine: respx.MockRouter, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.engines.ollama as ollama

    parsed: list[bytes] = []

    def counted(raw: bytes) -> object:
        parsed.append(raw)
        return json.loads(raw) if raw else None

    monkeypatch.setattr(ollama, "json_or_none", counted)
    a = adapter()
    request = body()
    assert a.stream_format("/api/generate", request) is not None
    need = await a.estimate_need("/api/generate", request, client)
    a.saw_gpu_answer("/api/generate", request, 200)
    assert parsed == [request], f"the same body was parsed {len(parsed)} times"
    # equal bytes of another request: parsed again, and read the same
    again = bytes(bytearray(request))
    assert again is not request
    assert await a.estimate_need("/api/generate", again, client) == need
    assert len(parsed) == 2
    other = body(options={"num_ctx": 32768})
    assert (await a.estimate_need("/api/generate", other, client)).key != need.key, "another body is not the last one's"
