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


def test_a_load_of_another_variant_of_a_model_ends_the_one_on_the_card() -> None:
    """Ollama holds one runner per model and reloads it for other load options: a num_ctx 32768 load
    answered means the default one is gone, and an unload of the model forgets every variant."""
    r = Residency(ManualClock())
    r.loaded("ollama", "ollama:gemma3:27b?d=aaa")
    r.loaded("ollama", "ollama:phi3:mini")
    r.loaded("ollama", "ollama:gemma3:27b?d=aaa&num_ctx=32768")
    assert sorted(r.keys("ollama")) == ["ollama:gemma3:27b?d=aaa&num_ctx=32768", "ollama:phi3:mini"]
    r.forget("ollama", "ollama:gemma3:27b")
    assert r.keys("ollama") == ["ollama:phi3:mini"]
