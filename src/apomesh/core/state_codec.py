"""Folded-state checkpoints: a session's ``SessionState`` as bytes, and back, exactly.

A ``FoldCheckpoint`` is the fold of a session's log up to ``index`` (the event id of the
envelope there, and its stream sequence when the log adapter knew it), so a reader can start from
it and fold only what follows. It is an accelerator and nothing more: the log stays the one source
of truth, and a reader checks the envelope at ``index`` still carries ``event_id`` before
trusting it. ``FOLD_FORMAT`` names the fold's semantics and the state's layout; it is bumped
whenever either changes, and a checkpoint of another format is ignored (folded from the log
again). The codec is msgpack through msgspec, which round-trips the state's Structs, the
events they hold and their tuple-keyed maps exactly. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Final

import msgspec

from apomesh.core.errors import CodecError
from apomesh.core.state import SessionState

FOLD_FORMAT: Final = 1
"""The fold-format version a checkpoint is written in; bump it whenever ``core.state``'s fold or
the layout of ``SessionState`` (with the events and configs it holds) changes
(tests/unit/test_state_codec.py keeps a digest of the layout per format and fails on a change)."""


class FoldCheckpoint(msgspec.Struct, frozen=True):
    """The folded state of one session at ``index`` of its log."""

    session_id: str
    index: int
    event_id: str
    """The id of the envelope at ``index``: a reader checks the log still holds it there."""
    seq: int | None
    """The stream sequence of that envelope, when the log adapter knew it (JetStream)."""
    fold_format: int
    state: bytes
    """The ``SessionState`` at ``index``, encoded by ``encode_state``."""


_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(SessionState)
_checkpoint_decoder = msgspec.msgpack.Decoder(FoldCheckpoint)


def encode_state(state: SessionState) -> bytes:
    return _encoder.encode(state)


def decode_state(data: bytes) -> SessionState:
    """The state ``encode_state`` wrote; ``CodecError`` for bytes that are not one."""
    try:
        return _state_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise CodecError(f"not an encoded session state: {exc}") from None


def make_checkpoint(state: SessionState, event_id: str, seq: int | None = None) -> FoldCheckpoint:
    """The checkpoint of ``state`` at its last index, whose envelope has ``event_id``."""
    if state.last_index < 0:
        raise ValueError("an empty state has no checkpoint")
    return FoldCheckpoint(
        session_id=state.session_id,
        index=state.last_index,
        event_id=event_id,
        seq=seq,
        fold_format=FOLD_FORMAT,
        state=encode_state(state),
    )


def encode_checkpoint(checkpoint: FoldCheckpoint) -> bytes:
    return _encoder.encode(checkpoint)


def decode_checkpoint(data: bytes) -> FoldCheckpoint:
    """The checkpoint ``encode_checkpoint`` wrote (its state still encoded); ``CodecError`` for
    bytes that are not one."""
    try:
        return _checkpoint_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise CodecError(f"not a fold checkpoint: {exc}") from None


def checkpoint_state(checkpoint: FoldCheckpoint) -> SessionState:
    """The checkpoint's state, checked against its header: ``CodecError`` when the state does
    not decode or names another session or index (a fold format other than ``FOLD_FORMAT`` is
    the caller's to refuse first)."""
    state = decode_state(checkpoint.state)
    if state.session_id != checkpoint.session_id or state.last_index != checkpoint.index:
        raise CodecError(
            f"a fold checkpoint of session {checkpoint.session_id} at index {checkpoint.index}"
            f" holds the state of session {state.session_id} at index {state.last_index}"
        )
    return state
