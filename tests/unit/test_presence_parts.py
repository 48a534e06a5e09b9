"""Presence records put in parts (``adapters.kv.PresenceTable``): a head names its parts, a
record put whole is never taken for a head, and a head whose parts are not all there is read
again rather than taken short."""

from __future__ import annotations

import msgspec

from apomesh.adapters.kv import _assemble, _part_key, _parts_head, encode_key, presence_part_bytes
from apomesh.runtime.presence import DaemonRecord


def test_a_record_put_whole_is_not_a_head_and_reads_as_it_is() -> None:
    record = msgspec.msgpack.encode(
        DaemonRecord(id="d1", host="h", url="", incarnation="d1", sessions=["a", "b"])
    )
    assert _parts_head(record) is None
    assert _assemble({encode_key("d1"): record}) == ({"d1": record}, True)


def test_a_head_reads_as_its_parts_joined_and_a_missing_part_asks_for_a_new_read() -> None:
    record = bytes(range(256)) * 10
    key = encode_key("daemon@2")
    pieces = [record[at : at + 1000] for at in range(0, len(record), 1000)]
    head = msgspec.msgpack.encode(["parts", "g7", len(pieces), len(record)])
    values = {key: head} | {_part_key(key, "g7", n): piece for n, piece in enumerate(pieces)}
    assert _assemble(values) == ({"daemon@2": record}, True)
    del values[_part_key(key, "g7", 1)]
    assert _assemble(values)[1] is False
    values[_part_key(key, "g7", 1)] = b"short"
    assert _assemble(values)[1] is False  # a part of another put under the same name


def test_parts_stay_well_under_the_connections_max_payload() -> None:
    assert presence_part_bytes(None) == 256 * 1024
    assert presence_part_bytes(1024 * 1024) == 256 * 1024
    assert presence_part_bytes(64 * 1024) == 16 * 1024
