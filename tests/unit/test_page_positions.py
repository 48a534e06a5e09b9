"""Where the boot scan's pass places a page's messages in the stream (``stream_fold._positions``):
a page with no gaps by count, one with gaps by the stream's list of deleted sequences, and none
when that list does not account for every gap."""

from __future__ import annotations

from apomesh.adapters.nats_connect import DirectGetPage
from apomesh.adapters.stream_fold import _positions


def page(count: int, last_sequence: int) -> DirectGetPage:
    """A header-less page of ``count`` messages ending at ``last_sequence``."""
    return DirectGetPage([], 0, last_sequence, [b"envelope"] * count)


def test_a_page_without_gaps_is_placed_by_count() -> None:
    assert list(_positions(page(5, 14), 10, frozenset()) or []) == [10, 11, 12, 13, 14]


def test_a_page_with_gaps_is_placed_by_the_deleted_sequences() -> None:
    assert _positions(page(3, 14), 10, frozenset({11, 13})) == [10, 12, 14]
    assert _positions(page(3, 14), 10, frozenset({2, 11, 13, 99})) == [10, 12, 14]
    assert _positions(page(2, 14), 11, frozenset({11, 12, 13})) is None  # 14 alone is left


def test_a_gap_the_list_does_not_account_for_places_nothing() -> None:
    assert _positions(page(3, 14), 10, frozenset()) is None  # no list (too many deleted)
    assert _positions(page(3, 14), 10, frozenset({11})) is None  # one deleted after the list
