"""Folded-state checkpoints in the daemon's state store: written by a session's writer, loaded to
fold a session from where one stands instead of from its first event.

A session's writer (``SessionRuntime``) stores the ``SessionState`` it holds
(``core.state_codec.FoldCheckpoint``: the state at an index the log has acknowledged, that
envelope's event id and, on JetStream, its stream sequence and the session's message count there),
one record per session in the store's ``checkpoints`` database, replaced each time. Two things
make it write one, neither of them in a step's way:

- every ``[snapshots] fold_checkpoint_every`` events it appended, as a task of its own after the
  step that crossed the threshold was answered (a long session resumes from near its end);
- ``[snapshots] fold_checkpoint_interval`` seconds at most after any append (``keep_current``:
  every session that appended since is written then, all in one store write), and once more when
  the daemon stops. So a daemon that stops, or dies, leaves every session it drove with a
  checkpoint that is current, or that many seconds behind; the boot scan after it reads the
  current ones and not their events (``adapters.stream_fold``: the log's message counts confirm
  them).

A checkpoint leaves its session's pinned shape out (``core.state_codec``): the shape is stored
once by its key in the ``shapes`` database. When the session ends the record is removed, and
retention removes it with the session's other records (shapes stay: one per definition version).

Reading (``fold``; the boot scan's one pass reads ``load_all``): a checkpoint is trusted only if
the log's envelope at its index still carries its event id, read with the envelopes after it in
the same request (from its stream sequence on when the log can, ``ReadsFromSequence``); then only
those later envelopes are folded onto it. A checkpoint that does not decode, of another fold
format, or that the log contradicts (purged, restored, replaced) is ignored with a warning and the
session is folded from its first event: deleting every checkpoint changes nothing but speed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.stream_fold import ResumePoint
from apomesh.core.envelope import Envelope
from apomesh.core.errors import CodecError, FoldError, LogError, LogUnavailable, StoreError
from apomesh.core.events import SessionShape
from apomesh.core.ports import EventLog
from apomesh.core.state import SessionState, apply, fold
from apomesh.core.state_codec import (
    FOLD_FORMAT,
    FoldCheckpoint,
    checkpoint_state,
    decode_checkpoint,
    decode_shape,
    encode_checkpoint,
    encode_shape,
    make_checkpoint,
    shape_key,
)

log = logging.getLogger("apomesh.daemon")

CHECKPOINT_DB = "checkpoints"
"""The store database of fold checkpoints, keyed by session id."""
SHAPES_DB = "shapes"
"""The store database of the session shapes checkpoints leave out, keyed by ``shape_key``."""

CHECKPOINT_EVERY = 10_000
"""Events a writer appends between two checkpoints of its session, by default."""

WRITTEN_TOGETHER = 1_000
"""The most checkpoints ``write_changed`` makes and stores in one go (thousands of sessions
resumed together all change at once: the event loop turns between two goes)."""
SHAPE_KEYS_KEPT = 4_096
"""Shapes whose ``shape_key`` is remembered (by identity: the sessions of one definition share
one shape)."""


@runtime_checkable
class ReadsFromSequence(Protocol):
    """A log that can read a session from a known stream sequence (``JetStreamLog``)."""

    async def read_from_sequence(
        self, session_id: str, index: int, seq: int, counted: int | None = None
    ) -> list[Envelope]: ...


@runtime_checkable
class KnowsSequences(Protocol):
    """A log that knows the stream sequence of a session's last event, and how many messages
    the session holds there, on the log ``log_id`` names (``JetStreamLog``)."""

    log_id: str | None

    def known_end(self, session_id: str, index: int) -> tuple[int, int | None] | None: ...


class Checkpointed(Protocol):
    """A session's writer, as ``keep_current`` sees it."""

    session_id: str

    def current_checkpoint(self) -> tuple[FoldCheckpoint, SessionShape | None] | None:
        """The checkpoint of the state it holds now, and the shape the checkpoint left out
        (None when there is nothing to store: an ended session, or no append yet)."""
        ...

    def checkpoint_lost(self) -> None:
        """The last checkpoint it made was not stored."""
        ...


Folded = tuple[SessionState, str, int, int | None]
"""A session's state folded from the log, the event id and stream sequence of its last
envelope, and how many messages the session holds (None: not counted)."""


class CheckpointStats(msgspec.Struct):
    """What the folds from checkpoints did, since the daemon started."""

    used: int = 0
    """Sessions folded on from a checkpoint."""
    ignored: int = 0
    """Checkpoints that did not decode or that the log contradicted."""
    events_after: int = 0
    """Envelopes folded onto checkpoints (the tails read)."""
    events_whole: int = 0
    """Envelopes folded from a session's start (no usable checkpoint)."""


class FoldCheckpoints:
    """Fold checkpoints in one state store; see the module docstring."""

    def __init__(self, store: AsyncStore, *, logger: logging.Logger | None = None) -> None:
        self.store = store
        self.log = logger or log
        self.stats = CheckpointStats()
        self._changed: dict[str, Checkpointed] = {}
        """The writers that appended since ``keep_current`` last wrote their checkpoint."""
        self._shapes: dict[str, SessionShape] = {}
        """The shapes stored (or being stored), by key."""
        self._keys: dict[int, tuple[SessionShape, str]] = {}
        """``shape_key`` of the shapes seen lately, by identity (the shape held, so the
        identity stays its)."""

    def shape_key(self, shape: SessionShape) -> str:
        """``core.state_codec.shape_key(shape)``, computed once per shape object."""
        known = self._keys.get(id(shape))
        if known is not None and known[0] is shape:
            return known[1]
        if len(self._keys) >= SHAPE_KEYS_KEPT:
            self._keys.clear()
        key = shape_key(shape)
        self._keys[id(shape)] = (shape, key)
        return key

    def changed(self, writer: Checkpointed) -> None:
        """Note that ``writer`` appended: its checkpoint is written at the next ``write_changed``."""
        self._changed[writer.session_id] = writer

    def forget(self, session_id: str) -> None:
        """The session's writer stops: nothing of it is to be written any more."""
        self._changed.pop(session_id, None)

    async def keep_current(self, interval: float) -> None:
        """Every ``interval`` seconds, write the checkpoint of every session that appended since
        (runs until cancelled)."""
        while True:
            await asyncio.sleep(interval)
            await self.write_changed()

    async def write_changed(self) -> int:
        """Write the checkpoints of the sessions that appended since the last call, one store
        write per ``WRITTEN_TOGETHER``; answers how many were stored. A failed write is logged,
        and its sessions and those not written yet are written at the next call."""
        changed, self._changed = self._changed, {}
        writers = list(changed.values())
        stored = 0
        for first in range(0, len(writers), WRITTEN_TOGETHER):
            if first:
                await asyncio.sleep(0)
            group = writers[first : first + WRITTEN_TOGETHER]
            made = [made for w in group if (made := w.current_checkpoint()) is not None]
            if not made:
                continue
            try:
                await self.write_many(made)
            except Exception as exc:  # only an accelerator: written again at the next call
                # The rest would most likely fail the same way (a store out of reach answers
                # each write only after its timeout): they wait for the next call too.
                left = writers[first:]
                self.log.warning("%d fold checkpoints not stored: %s", len(left), exc)
                for writer in left:
                    writer.checkpoint_lost()
                    self._changed.setdefault(writer.session_id, writer)
                break
            stored += len(made)
        return stored

    async def write_folded(self, folded: Sequence[Folded], log_id: str | None) -> int:
        """Store the checkpoints of sessions folded from the log that no writer here drives (a
        boot scan's stranded sessions: the next start then reads them from their checkpoint, not
        their events), ``WRITTEN_TOGETHER`` to a store write; answers how many were stored (a
        failed write is logged and skipped: only an accelerator)."""
        stored = 0
        for first in range(0, len(folded), WRITTEN_TOGETHER):
            if first:
                await asyncio.sleep(0)
            made = []
            for state, event_id, seq, messages in folded[first : first + WRITTEN_TOGETHER]:
                bootstrap = state.bootstrap
                shape = None if bootstrap is None else bootstrap.shape
                checkpoint = make_checkpoint(
                    state,
                    event_id,
                    seq,
                    messages=messages,
                    log_id=log_id,
                    shape=None if shape is None else self.shape_key(shape),
                )
                made.append((checkpoint, shape))
            try:
                await self.write_many(made)
            except Exception as exc:
                self.log.warning("%d fold checkpoints not stored: %s", len(made), exc)
                continue
            stored += len(made)
        return stored

    async def write(self, checkpoint: FoldCheckpoint, shape: SessionShape | None = None) -> None:
        """Store ``checkpoint`` as its session's (replacing the one before), with the shape it
        left out when that is not stored yet."""
        await self.write_many([(checkpoint, shape)])

    async def write_many(self, made: Sequence[tuple[FoldCheckpoint, SessionShape | None]]) -> None:
        """Store each checkpoint (and each shape one left out, once, when given: a checkpoint
        whose shape is not stored is ignored when read) in one store write."""
        puts = []
        new_shapes = {}
        for checkpoint, shape in made:
            key = checkpoint.bootstrap.shape_key if checkpoint.bootstrap is not None else None
            if (
                key is not None
                and shape is not None
                and key not in self._shapes
                and key not in new_shapes
            ):
                new_shapes[key] = shape
                puts.append((SHAPES_DB, key, encode_shape(shape)))
            puts.append((CHECKPOINT_DB, checkpoint.session_id, encode_checkpoint(checkpoint)))
        await self.store.write_batch(puts)
        self._shapes.update(new_shapes)

    async def delete(self, session_id: str) -> None:
        self.forget(session_id)
        await self.store.write_batch([], [(CHECKPOINT_DB, session_id)])

    async def _load_shapes(self) -> None:
        """Read the stored shapes the checkpoints name (those that decode)."""
        for key, raw in await self.store.scan(SHAPES_DB, ""):
            if key in self._shapes:
                continue
            try:
                self._shapes[key] = decode_shape(raw)
            except CodecError as exc:
                self.log.warning("stored session shape %s cannot be decoded (%s)", key, exc.message)

    async def load(self, session_id: str) -> ResumePoint | None:
        """The session's checkpoint as a resume point, or None (none stored, not usable, or the
        store cannot be read now: the log then says everything)."""
        try:
            raw = await self.store.get(CHECKPOINT_DB, session_id)
            if raw is not None and self._names_unknown_shape(raw):
                await self._load_shapes()
        except StoreError as exc:
            self.log.warning("session %s: fold checkpoint not read (%s)", session_id, exc)
            return None
        return None if raw is None else self._usable(session_id, raw)

    async def load_all(self) -> dict[str, ResumePoint]:
        """Every usable checkpoint this host's store holds, by session (none when the store
        cannot be read now)."""
        points = {}
        try:
            await self._load_shapes()
            # This host's copy: a checkpoint is checked against the log before it is used, and
            # one a peer wrote since is only missed (its session is read from the log).
            stored = await self.store.scan_here(CHECKPOINT_DB, "")
        except StoreError as exc:
            self.log.warning("fold checkpoints not read (%s); sessions fold from their start", exc)
            return {}
        for session_id, raw in stored:
            point = self._usable(session_id, raw)
            if point is not None:
                points[session_id] = point
        return points

    def _names_unknown_shape(self, raw: bytes) -> bool:
        try:
            bootstrap = decode_checkpoint(raw).bootstrap
        except CodecError:
            return False  # ``_usable`` says why
        return bootstrap is not None and bootstrap.shape_key not in self._shapes

    def _usable(self, session_id: str, raw: bytes) -> ResumePoint | None:
        try:
            checkpoint = decode_checkpoint(raw)
            if checkpoint.fold_format != FOLD_FORMAT:
                self.log.info(
                    "session %s: its fold checkpoint has fold format %d (this build folds %d);"
                    " folding its log from the start",
                    session_id,
                    checkpoint.fold_format,
                    FOLD_FORMAT,
                )
                self.stats.ignored += 1
                return None
            if checkpoint.session_id != session_id:
                raise CodecError(f"it names session {checkpoint.session_id}")
            state = checkpoint_state(checkpoint, self._shapes)
        except CodecError as exc:
            self.log.warning(
                "session %s: its fold checkpoint cannot be decoded (%s); folding its log from the"
                " start",
                session_id,
                exc.message,
            )
            self.stats.ignored += 1
            return None
        return ResumePoint(
            state, checkpoint.event_id, checkpoint.seq, checkpoint.messages, checkpoint.log_id
        )

    def stale(self, session_id: str) -> None:
        """Count and report a checkpoint the log contradicts (the one pass found it so)."""
        self.stats.ignored += 1
        self.log.warning(
            "session %s: the log does not hold its fold checkpoint's event (purged, restored or"
            " replaced?); folding its log from the start",
            session_id,
        )

    async def fold(self, log_adapter: EventLog, session_id: str) -> SessionState:
        """The session's state as its log holds it: from its checkpoint when the log confirms
        it, else from its first event. Raises what ``fold(log.read(session_id))`` raises; an
        empty log answers an empty state (``last_index`` -1)."""
        point = await self.load(session_id)
        if point is not None:
            state = await self._fold_on(log_adapter, session_id, point)
            if state is not None:
                return state
        envelopes = await log_adapter.read(session_id)
        self.stats.events_whole += len(envelopes)
        return fold(envelopes, session_id)

    async def _fold_on(
        self, log_adapter: EventLog, session_id: str, point: ResumePoint
    ) -> SessionState | None:
        """The checkpoint's state with the log's later envelopes folded on, or None when the log
        does not confirm it (or the rest does not fold onto it: the whole log then says why)."""
        at = point.state.last_index
        try:
            if isinstance(log_adapter, ReadsFromSequence) and point.seq is not None:
                envelopes = await log_adapter.read_from_sequence(
                    session_id, at, point.seq, point.messages
                )
            else:
                envelopes = await log_adapter.read(session_id, at - 1)
            if not envelopes or envelopes[0].index != at or envelopes[0].event_id != point.event_id:
                self.stale(session_id)
                return None
            state = point.state
            for env in envelopes[1:]:
                apply(state, env)
        except LogUnavailable:
            raise
        except (CodecError, FoldError, LogError) as exc:
            self.stats.ignored += 1
            self.log.warning(
                "session %s: its log does not continue its fold checkpoint (%s); folding it from"
                " the start",
                session_id,
                exc.message,
            )
            return None
        self.stats.used += 1
        self.stats.events_after += len(envelopes) - 1
        return state
