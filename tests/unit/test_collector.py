"""A daemon or worker process collects its young generation less often than CPython's default
(``runtime.node.tune_collector``), and never more often than the process asked for itself."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from apomesh.runtime.node import YOUNG_COLLECTIONS_AFTER, tune_collector


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*before)


def test_the_default_young_threshold_is_raised_and_the_older_ones_kept(thresholds: None) -> None:
    gc.set_threshold(700, 10, 10)
    tune_collector()
    assert gc.get_threshold() == (YOUNG_COLLECTIONS_AFTER, 10, 10)


def test_a_higher_threshold_the_process_set_is_kept(thresholds: None) -> None:
    gc.set_threshold(YOUNG_COLLECTIONS_AFTER * 4, 5, 7)
    tune_collector()
    assert gc.get_threshold() == (YOUNG_COLLECTIONS_AFTER * 4, 5, 7)
