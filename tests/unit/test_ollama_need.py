"""What an Ollama request is planned to need: the model's file plus the context allowance until
Ollama has been seen holding it, then the footprint Ollama itself reported (`/api/ps` size). The
engine's control calls are answered by respx; shapes from the wire facts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
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


@pytest.fixture
def engine() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
        router.get(f"{OLLAMA}/api/tags").respond(json={"models": [{"name": "gemma3:27b", "size": FILE}]})
        yield router


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def adapter() -> Any:
    tenant = registry_from_dict({"tenants": {"ollama": {"upstream": OLLAMA, "context_allowance_gb": 2.0}}}).get("ollama")
    return adapter_for(tenant)


def body(**extra: Any) -> bytes:
    return json.dumps({"model": "gemma3:27b", "prompt": "hi", **extra}).encode()


def ps(size: int, size_vram: int) -> dict[str, Any]:
    return {"models": [{"name": "gemma3:27b", "model": "gemma3:27b", "size": size, "size_vram": size_vram,
                        "expires_at": "2026-12-06T12:00:00Z", "context_length": 4096}]}


async def test_the_need_is_the_file_plus_the_allowance_until_ollama_is_seen_holding_the_model(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    before = await a.estimate_need("/api/generate", body(), client)
    assert before.bytes == FILE + 2 * GIB and "context allowance" in before.what
    engine.get(f"{OLLAMA}/api/ps").respond(json=ps(FOOTPRINT, FOOTPRINT))
    await a.placements(client)  # the watchdog's read of /api/ps
    after = await a.estimate_need("/api/generate", body(), client)
    assert after.bytes == FOOTPRINT and "as Ollama reported it loaded" in after.what
    assert after.key == before.key


async def test_a_partial_load_or_a_request_with_load_options_keeps_the_allowance(
        engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    engine.get(f"{OLLAMA}/api/ps").respond(json=ps(FOOTPRINT, FOOTPRINT // 2))  # spilled to the CPU: not its footprint
    await a.placements(client)
    assert (await a.estimate_need("/api/generate", body(), client)).bytes == FILE + 2 * GIB
    engine.get(f"{OLLAMA}/api/ps").respond(json=ps(FOOTPRINT, FOOTPRINT))
    await a.placements(client)
    bigger = await a.estimate_need("/api/generate", body(options={"num_ctx": 131072}), client)
    assert bigger.bytes == FILE + 2 * GIB, "a request that loads with another context was planned on the old footprint"


async def test_a_footprint_below_the_file_is_not_believed(engine: respx.MockRouter, client: httpx.AsyncClient) -> None:
    a = adapter()
    engine.get(f"{OLLAMA}/api/ps").respond(json=ps(FILE // 2, FILE // 2))
    await a.placements(client)
    assert (await a.estimate_need("/api/generate", body(), client)).bytes == FILE
