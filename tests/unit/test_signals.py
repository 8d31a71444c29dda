"""proxy/handoff/signals.py: the memory-cost formula on plans built by hand, the model names in load keys,
and the split of work into waiting and running."""

from __future__ import annotations

import pytest

from proxy.handoff.plan import Plan, Release, unplanned_plan
from proxy.handoff.signals import memory_cost, model_names, work_counts

G = 2**30


def plan(need: int, free: int, held: int = 0, *, idle: int = 0, promised: int = 0, possible: bool = True,
         wait_for: tuple[str, ...] = ()) -> Plan:
    releases = (Release("comfyui", idle, (1,), "idle"),) if idle else ()
    feasible = need - held - (free - promised) <= idle
    return Plan("ollama", need, free, held, feasible, False, releases, (), "", False, possible=possible,
                wait_for=wait_for, promised_bytes=promised)


@pytest.mark.parametrize(("p", "cost", "why"), [
    (plan(8 * G, 20 * G, held=8 * G), 0.0, "it holds its need: its model is on the card"),
    (plan(8 * G, 20 * G), 0.25, "a load into free memory"),
    (plan(8 * G, 0, idle=10 * G), 0.5, "all of it from idle tenants released"),
    (plan(8 * G, 0, wait_for=("comfyui",)), 1.0, "all of it from a busy tenant"),
    (plan(8 * G, 4 * G, wait_for=("comfyui",)), 0.625, "half free, half from a busy tenant"),
    (plan(8 * G, 4 * G, idle=2 * G, wait_for=("comfyui",)), 0.5, "free, idle, then busy: (1 + 1 + 2) / 8"),
    (plan(8 * G, 8 * G, promised=4 * G, idle=8 * G), 0.375, "free memory promised to another load is not free"),
    (plan(30 * G, 20 * G, possible=False), 1.0, "no plan can ever fit it"),
])
def test_the_memory_cost_weighs_free_idle_and_busy_bytes(p: Plan, cost: float, why: str) -> None:
    assert memory_cost(p) == cost, why


def test_an_engine_that_sizes_each_model_counts_its_own_models_as_memory_to_give_up() -> None:
    # Ollama could reach the whole 24 GiB: 8 it holds (its other models), 16 free
    empty, own = plan(24 * G, 24 * G), plan(24 * G, 16 * G, held=8 * G)
    assert memory_cost(empty, 0.5) == 0.25
    assert memory_cost(own, 0.5) == round((0.25 * 16 + 0.5 * 8) / 24, 4)
    assert memory_cost(own, 1.0) == 0.5, "while it is busy, its models are a busy tenant's"
    assert memory_cost(plan(24 * G, 0, held=24 * G), 0.5) == 0.5, "a card full of its own idle models"


def test_an_unknown_card_has_no_cost_rather_than_zero() -> None:
    assert memory_cost(unplanned_plan("ollama", 8 * G)) is None


def test_a_busy_tenant_costs_more_than_the_same_memory_idle() -> None:
    busy, idle = memory_cost(plan(8 * G, 2 * G, wait_for=("comfyui",))), memory_cost(plan(8 * G, 2 * G, idle=6 * G))
    assert busy is not None and idle is not None and busy > idle, (busy, idle)


def test_model_names_come_from_the_tenants_load_keys_and_latest_is_also_the_bare_name() -> None:
    keys = ["ollama:llama3.1:8b", "ollama:nomic-embed-text:latest", "comfyui:flux.safetensors", "ollama"]
    assert model_names("ollama", keys) == ("llama3.1:8b", "nomic-embed-text", "nomic-embed-text:latest")
    assert model_names("stt", ["stt"]) == (), "a generic tenant's one load names no model"


def test_an_engines_queued_jobs_beyond_the_first_wait() -> None:
    assert work_counts(0, 0, 0) == (0, 0)
    assert work_counts(2, 1, 0) == (2, 1)
    assert work_counts(1, 0, 3) == (3, 1), "one job runs, two wait in the engine's queue, one in the proxy's"
