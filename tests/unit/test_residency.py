"""Which loads go straight through: resident only while something keeps confirming it."""

from __future__ import annotations

from proxy.clock import ManualClock
from proxy.handoff.residency import Residency


async def test_an_answered_load_is_resident_until_it_goes_unconfirmed_for_fresh_s() -> None:
    clock = ManualClock()
    r = Residency(clock, fresh_s=2.0)
    assert not r.holds("ollama", "ollama:a")
    r.loaded("ollama", "ollama:a")
    assert r.holds("ollama", "ollama:a") and not r.holds("ollama", "ollama:b")
    await clock.advance(1.9)
    assert r.holds("ollama", "ollama:a")
    await clock.advance(0.2)
    assert not r.holds("ollama", "ollama:a"), "unloaded behind the proxy's back: planned for again"


async def test_the_engines_own_list_replaces_ours_and_its_deadline_counts() -> None:
    clock = ManualClock()
    r = Residency(clock, fresh_s=2.0)
    r.loaded("ollama", "ollama:a")
    r.observe("ollama", {"ollama:b": clock.now() + 0.5})  # Ollama unloads b in half a second, a is gone
    assert not r.holds("ollama", "ollama:a") and r.holds("ollama", "ollama:b")
    await clock.advance(0.6)
    assert not r.holds("ollama", "ollama:b"), "past the engine's own keep-alive deadline"
    r.observe("ollama", {"ollama:b": clock.now() + 3600})
    await clock.advance(2.1)
    assert not r.holds("ollama", "ollama:b"), "a reading is only good for fresh_s, however far the deadline"


def test_a_release_or_an_unload_forgets_at_once() -> None:
    r = Residency(ManualClock())
    r.loaded("ollama", "ollama:a")
    r.loaded("ollama", "ollama:b")
    r.forget("ollama", "ollama:a")
    assert r.keys("ollama") == ["ollama:b"]
    r.forget("ollama")
    assert r.keys("ollama") == []
