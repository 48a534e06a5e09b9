"""The folded-state codec (``core.state_codec``): a checkpoint's state decodes to exactly the state
it was made from (with its pinned shape kept in it, or left out and put back from the stored
shapes), and folding the rest of the log onto it equals folding the whole log."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.golden.make_golden import GOLDEN_DIR, read_log
from tests.strategies import GeneratedSession, valid_sessions

from apomesh.core import envelope
from apomesh.core.envelope import Envelope
from apomesh.core.errors import CodecError
from apomesh.core.state import SessionState, apply, fold
from apomesh.core.state_codec import (
    FOLD_FORMAT,
    FoldCheckpoint,
    checkpoint_state,
    decode_checkpoint,
    decode_state,
    encode_checkpoint,
    encode_state,
    make_checkpoint,
    shape_key,
)


def as_logged(envelopes: list[Envelope]) -> list[Envelope]:
    """The envelopes as a reader gets them back from the log (encoded, then decoded)."""
    return [envelope.decode(envelope.encode(env)) for env in envelopes]


def resumed_from_checkpoint(envs: list[Envelope], split: int) -> object:
    folded = fold(envs[:split])
    checkpoint = make_checkpoint(folded, envs[split - 1].event_id)
    state = checkpoint_state(decode_checkpoint(encode_checkpoint(checkpoint)))
    assert state == folded
    if folded.bootstrap is not None:  # the shape left out, and put back
        shape = folded.bootstrap.shape
        key = shape_key(shape)
        compact = make_checkpoint(folded, envs[split - 1].event_id, shape=key)
        assert compact.bootstrap is not None and len(compact.state) < len(checkpoint.state)
        back = checkpoint_state(decode_checkpoint(encode_checkpoint(compact)), {key: shape})
        assert back == folded
        assert fold(envs[:split]) == folded  # making it did not touch the state
    for env in envs[split:]:
        apply(state, env)
    return state


@settings(max_examples=150, deadline=None)
@given(valid_sessions(), st.data())
def test_a_checkpoint_then_the_rest_equals_folding_the_whole(
    session: GeneratedSession, data: st.DataObject
) -> None:
    envs = as_logged(session.envelopes)
    split = data.draw(st.integers(1, len(envs)), label="split")
    assert resumed_from_checkpoint(envs, split) == fold(envs)


@pytest.mark.parametrize("stem", ["solo_completed", "fanout_resumed", "hitl_answered"])
def test_every_prefix_of_the_golden_logs_round_trips(stem: str) -> None:
    envs = [envelope.decode(r) for r in read_log(GOLDEN_DIR / f"{stem}.msgpack")]
    whole = fold(envs)
    for split in range(1, len(envs) + 1):
        assert resumed_from_checkpoint(envs, split) == whole


def test_a_checkpoint_records_where_it_stands() -> None:
    envs = [envelope.decode(r) for r in read_log(GOLDEN_DIR / "solo_completed.msgpack")]
    checkpoint = make_checkpoint(fold(envs[:3]), envs[2].event_id, seq=42)
    assert (checkpoint.session_id, checkpoint.index, checkpoint.seq) == (envs[0].session_id, 2, 42)
    assert checkpoint.event_id == envs[2].event_id
    assert checkpoint.fold_format == FOLD_FORMAT


def test_bytes_that_are_not_a_checkpoint_are_a_codec_error() -> None:
    with pytest.raises(CodecError, match="not a fold checkpoint"):
        decode_checkpoint(b"\x93garbage")
    with pytest.raises(CodecError, match="not an encoded session state"):
        decode_state(b"\x01")


def test_a_state_of_another_index_than_its_header_is_refused() -> None:
    envs = [envelope.decode(r) for r in read_log(GOLDEN_DIR / "solo_completed.msgpack")]
    checkpoint = make_checkpoint(fold(envs[:3]), envs[2].event_id)
    lying = msgspec.structs.replace(checkpoint, state=encode_state(fold(envs[:4])))
    with pytest.raises(CodecError, match="holds the state of session"):
        checkpoint_state(lying)


LAYOUTS = {
    1: "bfa7c324cdb9b69a18b68b42c141a495548d70ec659dbc6847c266b03814824e",  # the state alone
    2: "c68151d4f4112071e5b39e7e3c7877c06855b2639d9608b4fb5aaa9d47ae1fc2",  # with the checkpoint
}
"""The digest of the layouts of ``SessionState`` (the state, and every event and config it holds)
and of ``FoldCheckpoint`` that each ``FOLD_FORMAT`` was written in."""


def layout_digest() -> str:
    def shape_only(node: Any) -> Any:  # docstrings are not layout
        if isinstance(node, dict):
            return {k: shape_only(v) for k, v in node.items() if k not in ("title", "description")}
        if isinstance(node, list):
            return [shape_only(v) for v in node]
        return node

    schema = shape_only(msgspec.json.schema_components((SessionState, FoldCheckpoint)))
    return hashlib.sha256(msgspec.json.encode(schema, order="sorted")).hexdigest()


def test_a_change_to_the_state_layout_bumps_the_fold_format() -> None:
    # A checkpoint written in another layout must not decode as this one: bump FOLD_FORMAT in
    # core/state_codec.py and record the new digest here (a change of the fold's semantics
    # bumps it too, which no digest can see).
    assert LAYOUTS.get(FOLD_FORMAT) == layout_digest(), (
        f"SessionState's or FoldCheckpoint's layout changed: bump FOLD_FORMAT and add {layout_digest()!r}"
    )


def test_a_checkpoint_whose_shape_is_not_stored_is_a_codec_error() -> None:
    envs = [envelope.decode(r) for r in read_log(GOLDEN_DIR / "solo_completed.msgpack")]
    state = fold(envs[:3])
    assert state.bootstrap is not None
    key = shape_key(state.bootstrap.shape)
    checkpoint = make_checkpoint(state, envs[2].event_id, messages=2, log_id="L", shape=key)
    assert (checkpoint.messages, checkpoint.log_id) == (2, "L")
    with pytest.raises(CodecError, match="is not stored"):
        checkpoint_state(checkpoint, {})
    assert checkpoint_state(checkpoint, {key: state.bootstrap.shape}) == state
