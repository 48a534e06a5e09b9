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


def test_what_serve_imports_is_kept_out_of_the_collectors_walks() -> None:
    """``serve`` and ``worker`` import the runtime with the collector off and freeze what it
    imported: the collector runs again after, and its first walk does not take in them all."""
    from apomesh.cli import _runtime_import

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with _runtime_import():
            assert not gc.isenabled()
            imported = [[n] for n in range(1000)]  # long-lived containers, as a module's are
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(imported)
    finally:
        gc.unfreeze()
