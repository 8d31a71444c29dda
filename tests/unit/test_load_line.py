"""A load's progress line (issue 41): smooth between card readings, said as an estimate, never
going back, never claiming the load done before the engine answers."""

from __future__ import annotations

import re

from proxy.relay.load_line import GIB, LoadEstimate, Reading

NEED = int(16.2 * GIB)


def reading(on_card_gib: float, read_at: float) -> Reading:
    return Reading("gemma3:27b", int(on_card_gib * GIB), NEED, 0.0, read_at)


def figure(line: str | None) -> float:
    assert line is not None
    match = re.match(r"loading gemma3:27b: (\d+\.\d) of 16\.2 GiB, ", line)
    assert match, line
    return float(match[1])


def test_between_readings_that_show_nothing_new_the_figure_moves_on_at_the_expected_rate() -> None:
    est = LoadEstimate(default_rate=2 * GIB)
    est.observe(reading(0, 0.0))
    est.observe(reading(0, 1.0))  # the engine has not allocated yet: the card still shows nothing
    assert figure(est.line(1.0)) == 2.0, "a load told '0.0 of 16.2 GiB' while the card had not moved yet"
    est.observe(reading(0, 2.0))
    assert figure(est.line(2.0)) == 4.0


def test_the_rate_is_what_the_card_showed_so_far_once_it_moved() -> None:
    est = LoadEstimate(default_rate=2 * GIB)
    est.observe(reading(0, 0.0))
    est.observe(reading(8, 2.0))  # 4 GiB/s so far
    assert figure(est.line(2.0)) == 8.0
    assert figure(est.line(3.0)) == 12.0
    assert est.line(3.0) == "loading gemma3:27b: 12.0 of 16.2 GiB, about 1 s left"


def test_the_figure_never_goes_back_nor_reads_done_before_the_engine_answers() -> None:
    est = LoadEstimate(default_rate=2 * GIB)
    est.observe(reading(0, 0.0))
    assert figure(est.line(3.0)) == 6.0
    est.observe(reading(4, 3.0))  # the card shows less than the estimate: the estimate holds
    assert figure(est.line(3.0)) == 6.0
    line = est.line(60.0)
    assert figure(line) < 16.2 and line is not None and "taking longer than expected (60 s so far)" in line, line


def test_no_reading_no_line() -> None:
    assert LoadEstimate().line(1.0) is None


def test_a_reading_that_grew_by_a_sliver_does_not_stop_the_estimate() -> None:
    est = LoadEstimate(default_rate=2 * GIB)
    est.observe(reading(0, 0.0))
    est.observe(reading(4, 2.0))  # 2 GiB/s so far
    est.observe(reading(4.01, 3.0))  # the engine allocated a few MiB more: the load did not stop
    assert figure(est.line(3.0)) > 5.0, "a sliver of growth restarted the estimate from the card"


def test_on_a_plateau_between_allocations_the_time_left_does_not_jump_up() -> None:
    est = LoadEstimate(default_rate=2 * GIB)
    est.observe(reading(0, 0.0))
    est.observe(reading(4, 4.0))  # the card moves in 4 GiB steps, a step every 4 s
    lefts = []
    for t in (4.0, 5.0, 6.0, 7.0):
        est.observe(reading(4, t))
        line = est.line(t)
        assert line is not None
        left = re.search(r"about (\d+) s left", line)
        assert left is not None, line
        lefts.append(int(left[1]))
    assert lefts == sorted(lefts, reverse=True), f"the time left rose while the card stood between steps: {lefts}"
