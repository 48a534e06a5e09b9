"""Folded-state checkpoints: a session's ``SessionState`` as bytes, and back, exactly.

A ``FoldCheckpoint`` is the fold of a session's log up to ``index`` (the event id of the
envelope there, and its stream sequence when the log adapter knew it), so a reader can start from
it and fold only what follows. It is an accelerator and nothing more: the log stays the one source
of truth, and a reader checks the envelope at ``index`` still carries ``event_id`` before
trusting it. ``FOLD_FORMAT`` names the fold's semantics and the state's layout; it is bumped
whenever either changes, and a checkpoint of another format is ignored (folded from the log
again). The codec is msgpack through msgspec, which round-trips the state's Structs, the
events they hold and their tuple-keyed maps exactly. Pure: no I/O, no clock.

A checkpoint may leave the session's pinned shape out of its state (``shape_key``): the shape is
most of a small session's state and the same for every session of one definition, so it is kept
once, by ``shape_key``, beside the checkpoints; the agents that run with one of the shape's configs
name it (``CheckpointBootstrap.pinned``) instead of holding a copy. A reader puts them back
(``checkpoint_state`` with the stored shapes). Reading a checkpoint of a small session is then
about as cheap as a tenth of folding its events, not as dear as all of it.

``messages`` and ``log_id`` let a reader know a checkpoint is current without reading the log:
the log's own count of the session's messages (JetStream: its subject's) still equal to the
count the checkpoint was taken at, on the same log, means nothing was appended after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec

from apomesh.core.errors import CodecError
from apomesh.core.events import SessionShape
from apomesh.core.state import BootstrapView, SessionState

FOLD_FORMAT: Final = 2
"""The fold-format version a checkpoint is written in; bump it whenever ``core.state``'s fold or
the layout of ``SessionState`` (with the events and configs it holds) or of ``FoldCheckpoint``
changes (tests/unit/test_state_codec.py keeps a digest of the layouts per format and fails on a
change). 2: a checkpoint may leave its state's bootstrap out (a reader of format 1 would take
such a state for one without a bootstrap)."""


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
    """The ``SessionState`` at ``index``, encoded by ``encode_state`` (without its bootstrap when
    ``bootstrap`` is set)."""
    messages: int | None = None
    """How many messages of the session the log held up to the one holding ``index``, when the
    writer knew: a log that holds as many now holds nothing after it."""
    log_id: str | None = None
    """The identity of the log ``messages`` counts on (JetStream: the stream's creation time);
    a count is only compared on the same log."""
    bootstrap: CheckpointBootstrap | None = None
    """The state's bootstrap, its shape left out (kept once by its key beside the checkpoints)."""


class CheckpointBootstrap(msgspec.Struct, frozen=True):
    """A checkpointed state's bootstrap without its shape: the shape's key, and which agents run
    with one of its configs (agent -> ``""`` for the root's, else the role's name)."""

    goal: str
    root: str
    shape_key: str
    pinned: dict[str, str]


_T = TypeVar("_T")

_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(SessionState)
_checkpoint_decoder = msgspec.msgpack.Decoder(FoldCheckpoint)
_shape_decoder = msgspec.msgpack.Decoder(SessionShape)


def encode_state(state: SessionState) -> bytes:
    return _encoder.encode(state)


def decode_state(data: bytes) -> SessionState:
    """The state ``encode_state`` wrote; ``CodecError`` for bytes that are not one."""
    return _decoded(_state_decoder, data, "an encoded session state")


def _decoded(decoder: msgspec.msgpack.Decoder[_T], data: bytes, what: str) -> _T:
    try:
        return decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise CodecError(f"not {what}: {exc}") from None


def shape_key(shape: SessionShape) -> str:
    """The key a shape is kept by beside the checkpoints: a digest of its encoding (two shapes
    with one key are equal)."""
    return hashlib.sha256(_encoder.encode(shape)).hexdigest()[:32]


def encode_shape(shape: SessionShape) -> bytes:
    return _encoder.encode(shape)


def decode_shape(data: bytes) -> SessionShape:
    """The shape ``encode_shape`` wrote; ``CodecError`` for bytes that are not one."""
    return _decoded(_shape_decoder, data, "an encoded session shape")


def make_checkpoint(
    state: SessionState,
    event_id: str,
    seq: int | None = None,
    *,
    messages: int | None = None,
    log_id: str | None = None,
    shape: str | None = None,
) -> FoldCheckpoint:
    """The checkpoint of ``state`` at its last index, whose envelope has ``event_id``; with
    ``shape`` (the ``shape_key`` of the state's pinned shape, which the caller keeps) the shape
    is left out of it."""
    if state.last_index < 0:
        raise ValueError("an empty state has no checkpoint")
    bootstrap = None
    stored = state
    if shape is not None and state.bootstrap is not None:
        bootstrap, stored = _without_shape(state, shape)
    return FoldCheckpoint(
        session_id=state.session_id,
        index=state.last_index,
        event_id=event_id,
        seq=seq,
        fold_format=FOLD_FORMAT,
        state=encode_state(stored),
        messages=messages,
        log_id=log_id,
        bootstrap=bootstrap,
    )


def _without_shape(state: SessionState, key: str) -> tuple[CheckpointBootstrap, SessionState]:
    """The state's bootstrap as a ``CheckpointBootstrap`` and a copy of the state without it,
    whose agents running with one of the shape's configs hold none (the state is not changed)."""
    view = state.bootstrap
    assert view is not None
    shape = view.shape
    pinned: dict[str, str] = {}
    agents = dict(state.agents)
    for name, agent in state.agents.items():
        config = agent.config
        if config is None:
            continue
        if config is shape.root:
            pinned[name] = ""
        elif shape.roles.get(config.role) is config:
            pinned[name] = config.role
        else:
            continue
        agents[name] = msgspec.structs.replace(agent, config=None)
    stored = msgspec.structs.replace(state, bootstrap=None, agents=agents)
    return CheckpointBootstrap(view.goal, view.root, key, pinned), stored


def encode_checkpoint(checkpoint: FoldCheckpoint) -> bytes:
    return _encoder.encode(checkpoint)


def decode_checkpoint(data: bytes) -> FoldCheckpoint:
    """The checkpoint ``encode_checkpoint`` wrote (its state still encoded); ``CodecError`` for
    bytes that are not one."""
    return _decoded(_checkpoint_decoder, data, "a fold checkpoint")


def checkpoint_state(
    checkpoint: FoldCheckpoint, shapes: Mapping[str, SessionShape] | None = None
) -> SessionState:
    """The checkpoint's state, checked against its header, its shape put back from ``shapes``
    (by key) when it was left out: ``CodecError`` when the state does not decode, names another
    session or index, or its shape or a pinned config is not there (a fold format other than
    ``FOLD_FORMAT`` is the caller's to refuse first)."""
    state = decode_state(checkpoint.state)
    if state.session_id != checkpoint.session_id or state.last_index != checkpoint.index:
        raise CodecError(
            f"a fold checkpoint of session {checkpoint.session_id} at index {checkpoint.index}"
            f" holds the state of session {state.session_id} at index {state.last_index}"
        )
    bootstrap = checkpoint.bootstrap
    if bootstrap is None:
        return state
    shape = (shapes or {}).get(bootstrap.shape_key)
    if shape is None:
        raise CodecError(f"its session shape {bootstrap.shape_key} is not stored")
    state.bootstrap = BootstrapView(state.session_id, bootstrap.goal, bootstrap.root, shape)
    agents = state.agents
    for name, role in bootstrap.pinned.items():
        agent = agents.get(name)
        config = shape.root if role == "" else shape.roles.get(role)
        if agent is None or config is None:
            raise CodecError(f"agent {name}'s pinned config ({role or 'root'}) is not in its shape")
        agent.config = config
    return state
