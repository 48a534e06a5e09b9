"""Presence records put in parts (``adapters.kv.PresenceTable``): a head names its parts, a
record put whole is never taken for a head, and parts that are not all there are never taken
for a record."""

from __future__ import annotations

import msgspec

from apomesh.adapters.kv import _joined, _parts_head, presence_part_bytes
from apomesh.runtime.presence import DaemonRecord


def test_a_record_put_whole_is_not_a_head() -> None:
    record = msgspec.msgpack.encode(
        DaemonRecord(id="d1", host="h", url="", incarnation="d1", sessions=["a", "b"])
    )
    assert _parts_head(record) is None
    head = msgspec.msgpack.encode(["parts", "g7", 3, 2560])
    assert _parts_head(head) == ("g7", 3, 2560)


def test_parts_join_only_when_all_are_there_and_add_up() -> None:
    record = bytes(range(256)) * 10
    pieces = [record[at : at + 1000] for at in range(0, len(record), 1000)]
    assert _joined(pieces, 3, len(record)) == record
    assert _joined(pieces[:2], 3, len(record)) is None  # one was deleted meanwhile
    assert _joined([pieces[0], b"short", pieces[2]], 3, len(record)) is None


def test_parts_stay_well_under_the_connections_max_payload() -> None:
    assert presence_part_bytes(None) == 256 * 1024
    assert presence_part_bytes(1024 * 1024) == 256 * 1024
    assert presence_part_bytes(64 * 1024) == 16 * 1024
