"""Cursor pagination of the API's listings: ``?limit=N`` rows at most, and ``next_cursor`` in the
answer when more follow; ``?cursor=`` that value asks for the next page.

A cursor is the sort key of the last row a page returned (URL-safe base64 of its JSON), so the
next page starts right after that row even when rows were added or removed in between: no row is
served twice, and none that stayed is skipped. It is opaque to clients; one that cannot be decoded
is refused with ``InvalidCursor``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

T = TypeVar("T")
SortKey = tuple[float | int | str, ...]


class InvalidCursor(ValueError):
    """A ``cursor`` that no page of this listing returned."""


def encode_cursor(key: SortKey) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(list(key))).decode().rstrip("=")


def decode_cursor(cursor: str, width: int | None) -> SortKey:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = msgspec.json.decode(raw, type=list[float | int | str])
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise InvalidCursor("cursor is not one this listing returned") from None
    if width is not None and len(values) != width:
        raise InvalidCursor("cursor is not one this listing returned")
    return tuple(values)


def page(
    rows: Sequence[T], key: Callable[[T], SortKey], *, limit: int, cursor: str | None
) -> tuple[list[T], str | None]:
    """The page of ``rows`` (sorted by ``key``) after ``cursor``, at most ``limit`` long, and the
    cursor of the page after it (None when this one is the last)."""
    ordered = sorted(rows, key=key)
    if cursor:
        after = decode_cursor(cursor, len(key(ordered[0])) if ordered else None)
        try:
            ordered = [row for row in ordered if key(row) > after]
        except TypeError:  # a cursor of another listing: its keys do not compare
            raise InvalidCursor("cursor is not one this listing returned") from None
    chosen = ordered[:limit]
    more = len(ordered) > limit
    return chosen, encode_cursor(key(chosen[-1])) if more else None
