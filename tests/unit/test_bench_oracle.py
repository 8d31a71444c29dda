"""bench/oracle.py: the best makespan of a small burst, the yardstick bench/mixed.py divides by."""

import random

import pytest

from bench.oracle import Service, best_schedule, conserving

GIB = 2**30
CARD = 23 * GIB
# The default demo box's shape: a render and a chat never fit on the card together.
SERVICES = {
    "R": Service(run_s=0.1, load_s=1.6, release_s=0.5, peak_bytes=8 * GIB, floor_bytes=GIB // 2),
    "C": Service(run_s=0.1, load_s=8.7, release_s=0.8, peak_bytes=16 * GIB),
}


def test_interleaved_burst_is_served_kind_by_kind_with_one_handoff() -> None:
    best = best_schedule("RCRC", [0.0, 0.15, 0.3, 0.45], frozenset(), SERVICES, CARD)
    # The card is empty: both renders (load once), release ComfyUI, both chats (load once).
    assert best.order == "RRCC", best
    assert best.handoffs == 1, best
    assert best.makespan_s == pytest.approx(1.6 + 0.1 + 0.1 + 0.5 + 8.7 + 0.1 + 0.1), best


def test_resident_model_goes_first_when_it_saves_a_load() -> None:
    best = best_schedule("RC", [0.0, 0.15], frozenset({"C"}), SERVICES, CARD)
    assert best.order == "CR" and best.handoffs == 1, best
    assert best.makespan_s == pytest.approx(0.15 + 0.1 + 0.8 + 1.6 + 0.1), best


def test_nobody_is_released_before_the_request_that_needs_the_room_arrives() -> None:
    best = best_schedule("RC", [0.0, 5.0], frozenset({"R"}), SERVICES, CARD)
    assert best.makespan_s == pytest.approx(5.0 + 0.5 + 8.7 + 0.1), best


def test_tenants_that_fit_together_run_at_the_same_time_but_not_beside_one_that_does_not_fit() -> None:
    services = {"R": Service(0.1, 3.5, 0.5, 14 * GIB, GIB // 2), "C": Service(1.0, 4.5, 0.8, 9 * GIB),
                "S": Service(1.0, 1.8, 0.1, 3 * GIB)}
    together = best_schedule("CS", [0.0, 0.0], frozenset({"C", "S"}), services, 15 * GIB)
    assert together.makespan_s == pytest.approx(1.0) and together.handoffs == 0, together
    # The render is on the card: the transcription cannot load beside it, whatever the order.
    best = best_schedule("RS", [0.0, 0.1], frozenset({"R"}), services, 15 * GIB)
    assert best.makespan_s == pytest.approx(0.1 + 0.5 + 1.8 + 1.0), best  # R done at 0.1, S sent then


def test_first_come_first_served_within_a_kind_loses_nothing_against_every_permutation() -> None:
    rng = random.Random(32)
    for _ in range(40):
        n = rng.randint(2, 6)
        kinds = "".join(rng.choice("RC") for _ in range(n))
        arrivals = sorted(round(rng.uniform(0, 12), 2) for _ in range(n))
        resident = frozenset(rng.choice([(), ("R",), ("C",)]))
        fifo = best_schedule(kinds, arrivals, resident, SERVICES, CARD)
        every = best_schedule(kinds, arrivals, resident, SERVICES, CARD, fifo=False)
        assert fifo.makespan_s == pytest.approx(every.makespan_s), (kinds, arrivals, resident, fifo, every)


def test_a_kind_that_cannot_fit_alone_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        best_schedule("C", [0.0], frozenset(), SERVICES, 10 * GIB)


def test_work_conserving_oracle_swaps_at_once_for_the_first_request() -> None:
    # The chat model is on the card; a render comes first, two chats right after. Knowing the chats
    # come, the best order serves them first (the render waits on an idle card); a scheduler that
    # serves what has arrived swaps at once and swaps back.
    arrivals = [0.0, 0.15, 0.3]
    clairvoyant = best_schedule("RCC", arrivals, frozenset({"C"}), SERVICES, CARD)
    assert clairvoyant.order == "CCR" and clairvoyant.handoffs == 1, clairvoyant
    online = best_schedule("RCC", arrivals, frozenset({"C"}), SERVICES, CARD, work_conserving=True)
    assert online.order == "RCC" and online.handoffs == 2, online
    assert online.makespan_s == pytest.approx(0.8 + 1.6 + 0.1 + 0.5 + 8.7 + 0.1 + 0.1), online


def test_conserving_sees_an_idle_card_under_a_waiting_request() -> None:
    assert conserving([0.0, 1.0], [0.0, 1.0], [1.0, 2.0])
    assert not conserving([0.0, 0.1], [0.5, 0.1], [1.0, 0.4])  # the first waits 0.4-0.5 s on an idle card
    assert conserving([0.0, 0.0], [0.3, 0.0], [1.0, 0.3])  # it waits while the other is served


def test_an_idle_checkpoint_stays_beside_a_model_that_fits_only_while_it_does_not_render() -> None:
    # The lifecycle box: flux idle holds 12.3 GiB, 13.8 while sampling; the relay 3 GiB; 15.5 GiB card.
    services = {"R": Service(0.1, 3.0, 0.5, int(13.8 * GIB), int(0.4 * GIB), rest_bytes=int(12.3 * GIB)),
                "S": Service(0.25, 1.5, 0.02, 3 * GIB)}
    best = best_schedule("SR", [0.0, 0.15], frozenset({"R"}), services, int(15.5 * GIB))
    # The relay starts beside the idle checkpoint; the render then stops the relay (not a reload).
    assert best.order == "SR" and best.handoffs == 1, best
    assert best.makespan_s == pytest.approx(1.5 + 0.25 + 0.02 + 0.1), best
