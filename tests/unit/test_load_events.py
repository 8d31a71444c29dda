"""Loads as events (proxy/handoff/load_events.py): one load is begun once however many requests wait
on it, a listener hears it begin and end, and a listener that fails never breaks the request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from proxy.admin import views
from proxy.clock import ManualClock
from proxy.config.units import GIB
from proxy.handoff.broker import GpuBroker
from proxy.handoff.load_events import Load, LoadEvents, progress


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.heard: list[tuple[object, ...]] = []
        self.fail = fail

    def load_ahead(self, tenant: str, model: str) -> None:
        self.heard.append(("ahead", tenant, model))
        if self.fail:
            raise RuntimeError("broken listener")

    async def load_starting(self, load: Load) -> None:
        self.heard.append(("starting", load.model))
        if self.fail:
            raise RuntimeError("broken listener")

    def load_ended(self, load: Load, tail: bytes | None) -> None:
        self.heard.append(("ended", load.model, tail))
        if self.fail:
            raise RuntimeError("broken listener")

    def engine_frame(self, tenant: str, text: str) -> None:
        self.heard.append(("frame", tenant, text))


async def test_a_second_request_for_a_load_under_way_joins_it_and_is_not_told_as_a_load() -> None:
    events = LoadEvents(ManualClock())
    heard = Recorder()
    events.subscribe(heard)
    first = await events.begin("ollama", "gemma3:27b", "ollama:gemma3:27b", 17 << 30, b"{}", 7)
    second = await events.begin("ollama", "gemma3:27b", "ollama:gemma3:27b", 17 << 30, b"{}", 8)
    assert first is not None and second is None, "the same load under way is joined, not begun again"
    assert [load.model for load in events.underway()] == ["gemma3:27b"] and events.underway_of("ollama") is first
    events.arrived(first)
    assert events.underway() == [], "on the card once the engine answers"
    events.ended(first, b'{"load_duration":1}')
    assert heard.heard == [("starting", "gemma3:27b"), ("ended", "gemma3:27b", b'{"load_duration":1}')]
    again = await events.begin("ollama", "gemma3:27b", "ollama:gemma3:27b", 17 << 30, b"{}", 9)
    assert again is not None and again.id != first.id, "a load after the first one ended is a new load"


async def test_a_failing_listener_never_breaks_a_load_and_others_still_hear_it() -> None:
    events = LoadEvents(ManualClock())
    broken, fine = Recorder(fail=True), Recorder()
    events.subscribe(broken)
    unsubscribe = events.subscribe(fine)
    events.ahead("ollama", "m")
    load = await events.begin("ollama", "m", "ollama:m", 1, b"", None)
    assert load is not None
    events.ended(load, None)
    assert fine.heard == [("ahead", "ollama", "m"), ("starting", "m"), ("ended", "m", None)]
    unsubscribe()
    events.frame("comfyui", "{}")
    assert ("frame", "comfyui", "{}") in broken.heard and not any(h[0] == "frame" for h in fine.heard)


def _load(held_before: int | None, need: int = 16 * GIB) -> Load:
    return Load(1, "ollama", "gemma3:27b", "ollama:gemma3:27b", need, 0.0, 0.0, None, b"", held_before)


def test_a_loads_figure_is_what_its_tenant_gained_and_exact_only_when_it_held_nothing_else() -> None:
    floor = GIB // 2
    alone = progress(_load(held_before=floor), 8 * GIB + floor, floor, card_estimated=False)
    assert (alone.on_card_bytes, alone.estimated) == (8 * GIB, False), alone
    beside = progress(_load(held_before=5 * GIB), 13 * GIB, floor, card_estimated=False)
    assert (beside.on_card_bytes, beside.estimated) == (8 * GIB, True), "another model shares the figure: estimated"
    assert progress(_load(floor), 8 * GIB, floor, card_estimated=True).estimated, "the engines' own reports: estimated"
    unread = progress(_load(None), 20 * GIB, floor, card_estimated=False)
    assert unread.on_card_bytes == 16 * GIB and unread.estimated, "never more than the need; unknown start: estimated"
    assert progress(_load(6 * GIB), 2 * GIB, floor, card_estimated=False).on_card_bytes == 0, "never negative"


def test_each_waiter_has_its_place_in_line_by_priority_then_arrival() -> None:
    entries = [{"id": 3, "tenant": "a", "priority": 10}, {"id": 4, "tenant": "b", "priority": 50},
               {"id": 5, "tenant": "a", "priority": 10}]
    broker = SimpleNamespace(scheduler=SimpleNamespace(waiting=lambda: entries))
    placed = views.queue(cast(GpuBroker, broker))
    assert [(w["id"], w["position"]) for w in placed] == [(3, 2), (4, 1), (5, 3)], placed


async def test_a_load_that_evicts_its_tenants_other_model_first_counts_from_the_least_it_held() -> None:
    events = LoadEvents(ManualClock())
    floor = GIB // 2
    load = await events.begin("ollama", "qwen2.5:14b", "ollama:qwen2.5:14b", 10 * GIB, b"", None, 16 * GIB + floor)
    assert load is not None
    assert events.progress(load, 16 * GIB + floor, floor, False).on_card_bytes == 0
    assert events.progress(load, floor, floor, False).on_card_bytes == 0, "gemma left the card first"
    figure = events.progress(load, 4 * GIB + floor, floor, False)
    assert (figure.on_card_bytes, figure.estimated) == (4 * GIB, True), figure
