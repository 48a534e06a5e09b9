"""``ProgressLog``: a long task's progress line at most once every few seconds, and its last;
``Waiting``: how many wait for one thing, and their one warning every few seconds."""

from __future__ import annotations

import logging

import pytest

from apomesh.runtime.progress import ProgressLog, Waiting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_every_few_seconds_and_the_last_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    logger = logging.getLogger("apomesh.test.progress")
    progress = ProgressLog(logger, "boot scan", "log messages read", every=2.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=logger.name):
        progress(1_000, 1_000_000)  # under two seconds in: nothing
        clock.now += 2.5
        progress(412_000, 1_000_000)
        clock.now += 1.0
        progress(500_000, 1_000_000)  # one second after the last line: nothing
        clock.now += 1.5
        progress(999_999, 1_000_000)
        progress.finish(1_000_000)
        progress.finish(1_000_000)  # said already
    assert [r.getMessage() for r in caplog.records] == [
        "boot scan: 412,000 of 1,000,000 log messages read (41%)",
        "boot scan: 999,999 of 1,000,000 log messages read (99%)",
        "boot scan: 1,000,000 of 1,000,000 log messages read (100%)",
    ]


def test_a_short_task_says_nothing_and_an_empty_one_is_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    logger = logging.getLogger("apomesh.test.progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        short = ProgressLog(logger, "retention", "sessions purged", clock=clock)
        short(5, 10)
        short.finish(10)
        assert caplog.records == []
        empty = ProgressLog(logger, "resuming", "sessions started", every=0, clock=clock)
        empty(0, 0)
    assert [r.getMessage() for r in caplog.records] == ["resuming: 0 of 0 sessions started (100%)"]


def test_many_waiters_share_one_warning_every_few_seconds() -> None:
    clock = Clock()
    waiting = Waiting(every=10.0, clock=clock)
    for _ in range(3):
        waiting.enter()
    assert waiting.due() and waiting.others(counted=True) == " (with 2 others)"
    assert not waiting.due()  # the others' turn comes with the next warning
    clock.now += 10.0
    assert waiting.due()
    for _ in range(3):
        waiting.leave()
    assert waiting.count == 0 and waiting.others(counted=False) == ""
