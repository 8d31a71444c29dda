"""/metrics and /api/history on the simulated box: scraped and parsed after a handoff and a 507."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin.metrics import Metrics
from proxy.admin.telemetry import Telemetry
from proxy.config.units import GIB
from proxy.demo import Demo, comfy_prompt, run_prompt
from tests.integration.boxes import DemoFactory, comfyui_of, fast, ollama_of, proxy_of

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
TOO_BIG = {"model": "mistral-small:22b", "prompt": "hi", "stream": False}  # more than the "tight" box can ever hold


async def scrape(http: httpx.AsyncClient, demo: Demo) -> Samples:
    r = await http.get(proxy_of(demo).url("admin") + "/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


E = TypeVar("E")


def extension(demo: Demo, cls: type[E]) -> E:
    return next(e for e in proxy_of(demo).extensions if isinstance(e, cls))


async def handoff_then_507(demo: Demo, http: httpx.AsyncClient) -> None:
    """ComfyUI keeps flux (11.9 GiB); Ollama's gemma3:27b takes it back; ComfyUI, lower priority, then gets a
    507 because Ollama protects its idle memory from lower priorities (the box comes from `protected_box`)."""
    await run_prompt(proxy_of(demo).url("comfyui"), "flux1-dev-fp8.safetensors", http)
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text
    r = await http.post(proxy_of(demo).url("comfyui") + "/prompt", json={"prompt": comfy_prompt("flux1-dev-fp8.safetensors")})
    assert r.status_code == 507, r.text


@pytest.fixture(autouse=True)
def _telemetry_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "telemetry.sqlite3"
    monkeypatch.setenv("HYPERSWAP_TELEMETRY", str(path))
    return path


async def protected(box: DemoFactory) -> Demo:
    return await box(fast("default", tenants={"ollama": {"protect_idle_memory": True}}))


async def test_metrics_count_a_handoff_and_a_507_on_the_simulated_box(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await protected(box)
    await handoff_then_507(demo, http)

    m = await scrape(http, demo)

    assert value(m, "hyperswap_releases_total", tenant="comfyui", result="confirmed") == 1
    assert value(m, "hyperswap_handoff_seconds_count") == 1
    assert value(m, "hyperswap_handoff_seconds_sum") > 0
    assert value(m, "hyperswap_rejections_total", tenant="comfyui") == 1
    assert value(m, "hyperswap_rejections_total", tenant="ollama") == 0
    assert value(m, "hyperswap_requests_total", tenant="comfyui", outcome="rejected") == 1
    assert value(m, "hyperswap_requests_total", tenant="comfyui", outcome="completed") == 1, "the first prompt"
    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="completed") == 1
    assert value(m, "hyperswap_inflight_requests", tenant="ollama") == 0
    assert value(m, "hyperswap_gpu_memory_total_bytes") == demo.box.gpu.total_bytes
    used, free = value(m, "hyperswap_gpu_memory_used_bytes"), value(m, "hyperswap_gpu_memory_free_bytes")
    assert used > 16 * GIB and free < 8 * GIB
    assert value(m, "hyperswap_tenant_vram_bytes", tenant="ollama") > 16 * GIB
    assert value(m, "hyperswap_tenant_vram_bytes", tenant="comfyui") < 0.5 * GIB
    assert value(m, "hyperswap_gpu_snapshot_source_info", source="simulated", device=demo.box.gpu.name) == 1
    assert all("pid" not in dict(labels) for _, labels in m), "pid labels would churn series"


async def test_unmanaged_vram_and_a_507_on_the_tight_box(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("tight")
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate", json=TOO_BIG)
    assert r.status_code == 507, r.text

    m = await scrape(http, demo)

    assert value(m, "hyperswap_unmanaged_vram_bytes") == pytest.approx(0.84 * GIB, rel=0.01), "the speech relay"
    assert value(m, "hyperswap_rejections_total", tenant="ollama") == 1
    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="rejected") == 1
    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="completed") == 0
    assert value(m, "hyperswap_handoff_seconds_count") == 0, "a 507 is not a handoff"


async def test_first_scrape_reads_the_card_and_two_proxies_keep_separate_counters(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    a = await box("tight")
    b = await box("tight")
    assert proxy_of(a).broker.last_snapshot is None
    r = await http.post(proxy_of(a).url("ollama") + "/api/generate", json=TOO_BIG)
    assert r.status_code == 507

    mb = await scrape(http, b)
    ma = await scrape(http, a)

    assert value(mb, "hyperswap_gpu_memory_total_bytes") == b.box.gpu.total_bytes, "first scrape takes a snapshot"
    assert value(ma, "hyperswap_rejections_total", tenant="ollama") == 1
    assert value(mb, "hyperswap_rejections_total", tenant="ollama") == 0, "counters leaked between proxies"


async def test_history_has_the_release_with_freed_bytes_and_the_507(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await protected(box)
    await handoff_then_507(demo, http)
    base = proxy_of(demo).url("admin")

    rows = (await http.get(base + "/api/history", params={"since": 0})).json()["rows"]

    releases = rows["releases"]
    assert [(r["tenant"], r["requester"], r["confirmed"]) for r in releases] == [("comfyui", "ollama", True)]
    assert releases[0]["freed_bytes"] > 11 * GIB and releases[0]["duration_s"] > 0
    assert [(r["tenant"], r["trigger"]) for r in rows["rejections"]] == [("comfyui", "request POST /prompt")]
    # the chat's swap away from ComfyUI, used just before, is held a moment first (proxy.swap_hold_s): it queued
    assert {d["kind"] for d in rows["decisions"]} == {"queued", "plan", "rejection"}
    only = (await http.get(base + "/api/history", params={"kind": "releases", "since": releases[0]["at"] + 1})).json()
    assert only["kinds"] == ["releases"] and only["rows"] == {"releases": []}
    bad = await http.get(base + "/api/history", params={"kind": "nope"})
    assert bad.status_code == 400 and "nope" in bad.json()["error"]


async def test_history_survives_a_restart_and_vram_samples_and_loads_are_written(
        box: DemoFactory, http: httpx.AsyncClient, _telemetry_file: Path) -> None:
    demo = await protected(box)
    await handoff_then_507(demo, http)
    tel = extension(demo, Telemetry)
    assert tel.healthy()[0], tel.healthy()
    assert tel.min_vram("ollama", 3600.0) is not None
    await demo.stop()  # flushes open windows, drains the queue

    from proxy.admin.telemetry import TelemetryStore
    store = TelemetryStore(_telemetry_file)
    vram = store.query("vram", tenant="ollama")
    assert vram and max(r["max_bytes"] for r in vram) > 16 * GIB
    loads = store.query("model_loads", tenant="ollama")
    assert loads and loads[-1]["grown_bytes"] > 16 * GIB, "gemma's load was seen as VRAM growth"
    assert store.count("releases") == 1 and store.count("rejections") == 1


async def test_telemetry_off_answers_503_and_stays_healthy(box: DemoFactory, http: httpx.AsyncClient,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERSWAP_TELEMETRY", "off")
    demo = await box("tight")
    r = await http.get(proxy_of(demo).url("admin") + "/api/history")
    assert r.status_code == 503 and r.json()["error"] == "telemetry is off"
    assert extension(demo, Telemetry).healthy()[0]
    assert isinstance(extension(demo, Metrics), Metrics)


async def test_the_demo_box_writes_its_own_file_not_the_real_cards_history(box: DemoFactory,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYPERSWAP_TELEMETRY")
    demo = await box("tight")
    tel = extension(demo, Telemetry)
    assert tel.path is not None and demo.workdir is not None and tel.path.parent == demo.workdir, \
        f"a demo run keeps its history in its own folder, not {tel.path}"
    assert not tel.path.is_relative_to(Path.home()), "the demo wrote into the user's state folder"


async def test_requests_are_counted_by_the_status_their_client_got_a_500_is_not_completed(
        box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default"))
    ollama_of(demo).fail_next_load_with("llama runner process has terminated: exit status 2")
    failed = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                             json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
    unknown = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                              json={"model": "no-such-model", "prompt": "hi", "stream": False})
    fine = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                           json={"model": "llama3.2:3b", "prompt": "hi", "stream": False})
    assert (failed.status_code, unknown.status_code, fine.status_code) == (500, 404, 200), (failed.text, unknown.text)

    m = await scrape(http, demo)

    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="server_error") == 1, "the runner's 500"
    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="client_error") == 1, "the unknown model's 404"
    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="completed") == 1, "only the 200"


async def test_a_retry_that_succeeded_counts_as_a_retry_not_an_error(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box(fast("default", tenants={"comfyui": {"priority": 60, "needs_vram_gb": 1.0}}))
    oom = "llama runner process has terminated: cudaMalloc failed: out of memory"
    ollama_of(demo).fail_next_load_with(oom)
    r = await http.post(proxy_of(demo).url("ollama") + "/api/generate",
                        json={"model": "gemma3:27b", "prompt": "hi", "stream": False})
    assert r.status_code == 200, r.text
    comfyui_of(demo).fail_next_prompt_with_oom()  # its retry releases Ollama and runs under the client's own id
    msgs = await run_prompt(proxy_of(demo).url("comfyui"), "sd_xl_base_1.0.safetensors", http)
    assert [x["type"] for x in msgs if x["type"].startswith("execution_")][-1] == "execution_success"

    m = await scrape(http, demo)

    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="retried") == 1
    assert value(m, "hyperswap_requests_total", tenant="ollama", outcome="oom_error") == 0
    assert value(m, "hyperswap_requests_total", tenant="comfyui", outcome="completed") == 1, "its POST /prompt"
    assert value(m, "hyperswap_requests_total", tenant="comfyui", outcome="oom_error") == 0
    assert value(m, "hyperswap_oom_retries_total", tenant="ollama", result="succeeded") == 1
    assert value(m, "hyperswap_oom_retries_total", tenant="comfyui", result="requeued") == 1
    assert value(m, "hyperswap_oom_retries_total", tenant="comfyui", result="succeeded") == 1
