"""bench/cluster.py's picker: the scorers follow the endpoint picker's documented formulas, the weights are
the shipped EndpointPickerConfig's, and a scrape of /metrics reads into what the picker scores."""

from __future__ import annotations

import random

from bench.cluster import (
    Endpoint,
    Weights,
    affinity_scores,
    endpoint_from_metrics,
    memory_scores,
    mixed_stream,
    pick,
    queue_scores,
    weights_from_manifest,
)

SCRAPE = """# HELP hyperswap_tenant_requests_waiting x
# TYPE hyperswap_tenant_requests_waiting gauge
hyperswap_tenant_requests_waiting{tenant="ollama"} 2.0
hyperswap_tenant_requests_waiting{tenant="comfyui"} 5.0
# HELP hyperswap_tenant_requests_running x
# TYPE hyperswap_tenant_requests_running gauge
hyperswap_tenant_requests_running{tenant="ollama"} 1.0
# HELP hyperswap_tenant_memory_cost x
# TYPE hyperswap_tenant_memory_cost gauge
hyperswap_tenant_memory_cost{tenant="ollama"} 0.375
# HELP hyperswap_tenant_models_info x
# TYPE hyperswap_tenant_models_info gauge
hyperswap_tenant_models_info{max_lora="2",running_lora_adapters="llama3.1:8b",tenant="ollama",\
waiting_lora_adapters="qwen2.5:14b"} 1.7e9
"""


def test_a_scrape_reads_into_the_ollama_tenants_endpoint() -> None:
    e = endpoint_from_metrics(SCRAPE)
    assert e == Endpoint(2, 1, 0.375, frozenset({"llama3.1:8b"}), frozenset({"qwen2.5:14b"}), 2)
    assert endpoint_from_metrics("").memory_cost is None, "no sample: the attribute is missing, not 0"


def test_the_scorers_follow_the_pickers_documented_formulas() -> None:
    assert queue_scores([Endpoint(waiting=0), Endpoint(waiting=2), Endpoint(waiting=4)]) == [1.0, 0.5, 0.0]
    assert queue_scores([Endpoint(waiting=3), Endpoint(waiting=3)]) == [1.0, 1.0], "all equal: neutral 1"
    on_card = Endpoint(active=frozenset({"m"}), max_models=1)
    room = Endpoint(active=frozenset({"x"}), max_models=2)
    coming = Endpoint(loading=frozenset({"m"}), max_models=1)
    full = Endpoint(active=frozenset({"x"}), max_models=1)
    assert affinity_scores("m", [on_card, room, coming, full]) == [1.0, 0.8, 0.6, 0.0]
    assert memory_scores([Endpoint(memory_cost=0.25), Endpoint(memory_cost=1.0), Endpoint()]) == [0.75, 0.0, 0.0]


def test_the_model_on_a_card_outweighs_a_cheaper_load_elsewhere() -> None:
    w = weights_from_manifest()
    assert w.affinity > w.memory_cost > 0 and w.queue > 0
    busy_with_model = Endpoint(memory_cost=1.0, active=frozenset({"m"}), max_models=1)
    empty = Endpoint(memory_cost=0.25)
    assert pick("m", [empty, busy_with_model], w, random.Random(1)) == 1
    assert pick("other", [empty, busy_with_model], w, random.Random(1)) == 0, "a new load goes where it is cheap"
    ties = {pick("m", [empty, empty], Weights(1, 1, 1), random.Random(seed)) for seed in range(20)}
    assert ties == {0, 1}, "ties are broken at random"


def test_the_stream_is_seeded_and_mixed() -> None:
    a, b = mixed_stream(40, 35, 0.4, 0.25), mixed_stream(40, 35, 0.4, 0.25)
    assert a == b
    assert {r.kind for r in a} == {"C", "R"} and len({r.model for r in a if r.kind == "C"}) == 3
    assert [r.at_s for r in a] == sorted(r.at_s for r in a)
