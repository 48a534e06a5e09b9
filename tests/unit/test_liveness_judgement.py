"""When the daemon judges its workers' liveness next (``workers.next_judgement``): every tick, and
just past a silent worker's threshold when that comes sooner, so a lost worker is declared at its
threshold of missed beats instead of up to a tick later."""

from __future__ import annotations

import pytest

from apomesh.runtime.workers import JUDGED_PAST_THRESHOLD, next_judgement

TICK = 0.25
THRESHOLD = 3.0


def test_without_workers_the_next_judgement_is_a_tick_away() -> None:
    assert next_judgement(100.0, TICK, [], THRESHOLD) == TICK


def test_a_worker_heard_lately_leaves_the_tick_as_it_is() -> None:
    assert next_judgement(100.0, TICK, [99.5], THRESHOLD) == TICK


def test_a_threshold_passed_before_the_next_tick_is_judged_just_past_it() -> None:
    # Silent since 97.1: its silence reaches 3 s at 100.1, before the tick at 100.25.
    wait = next_judgement(100.0, TICK, [97.1], THRESHOLD)
    assert wait == pytest.approx(0.1 + JUDGED_PAST_THRESHOLD)
    assert 100.0 + wait - 97.1 > THRESHOLD  # silent longer than the threshold when judged


def test_the_earliest_threshold_among_workers_sets_the_wake() -> None:
    wait = next_judgement(100.0, TICK, [99.9, 97.2, 97.05, 98.0], THRESHOLD)
    assert wait == pytest.approx(0.05 + JUDGED_PAST_THRESHOLD)


def test_a_threshold_already_passed_waits_a_tick() -> None:
    # Its judgement was deferred (beats still unread, a reconnection's grace): no busy wake-ups.
    assert next_judgement(100.0, TICK, [96.0], THRESHOLD) == TICK
    assert next_judgement(100.0, TICK, [96.0, 97.1], THRESHOLD) == pytest.approx(
        0.1 + JUDGED_PAST_THRESHOLD
    )
