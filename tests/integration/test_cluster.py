"""bench/cluster.py's claim, small and fast: on two demo boxes, the picker that scores the nodes' exported
signals as the Inference Extension's endpoint picker does makes fewer model loads than round robin on the
same stream (chats for three models that do not all fit on one card, sent one after another)."""

from __future__ import annotations

import asyncio

from bench.cluster import Request, ResidencyPicker, RoundRobin, empty_cards, node_scenario, run_arm, weights_from_manifest
from tests.integration.boxes import DemoFactory

MODELS = ("llama3.1:8b", "qwen2.5:14b", "gemma3:27b")  # 4.9 + 9 + 16.2 GB: never all three on a 24 GB card
STREAM = [Request("C", MODELS[i % 3], 0.0) for i in range(6)]


async def test_the_residency_aware_picker_loads_fewer_models_than_round_robin(box: DemoFactory) -> None:
    scenario = node_scenario(load_gbps=0, watchdog_s=0.05, fast=True)
    nodes = list(await asyncio.gather(*(box(scenario, watchdog=True) for _ in range(2))))
    rr = await run_arm(RoundRobin(), nodes, STREAM, paced=False)
    await empty_cards(nodes)
    picked = await run_arm(ResidencyPicker(weights_from_manifest(), seed=35), nodes, STREAM, paced=False)
    for arm in (rr, picked):
        assert not arm.not_ok, f"{arm.router}: {arm.not_ok}"
        assert arm.chats == len(STREAM)
    assert picked.loads < rr.loads, f"picker {picked.loads} loads, round robin {rr.loads}"
    assert picked.loads <= 4, f"three models, two cards: {picked.loads} loads ({picked.chats_per_node} chats per node)"
