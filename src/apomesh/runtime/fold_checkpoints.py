"""Folded-state checkpoints in the daemon's state store: written by a session's writer, loaded to
fold a session from where one stands instead of from its first event.

A session's writer (``SessionRuntime``) stores the ``SessionState`` it holds every
``[snapshots] fold_checkpoint_every`` events it appended (``core.state_codec.FoldCheckpoint``: the
state at an index the log has acknowledged, that envelope's event id and, on JetStream, its stream
sequence), one record per session in the store's ``checkpoints`` database, replaced each time. The
write runs as a task of its own after the step that crossed the threshold has been applied and
answered: it never delays an append or a report. When the session ends the record is removed, and
retention removes it with the session's other records.

Reading (``fold``; the boot scan's one pass reads ``load_all``): a checkpoint is trusted only if
the log's envelope at its index still carries its event id, read with the envelopes after it in
the same request (from its stream sequence on when the log can, ``ReadsFromSequence``); then only
those later envelopes are folded onto it. A checkpoint that does not decode, of another fold
format, or that the log contradicts (purged, restored, replaced) is ignored with a warning and the
session is folded from its first event: deleting every checkpoint changes nothing but speed.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.stream_fold import ResumePoint
from apomesh.core.envelope import Envelope
from apomesh.core.errors import CodecError, FoldError, LogError, LogUnavailable, StoreError
from apomesh.core.ports import EventLog
from apomesh.core.state import SessionState, apply, fold
from apomesh.core.state_codec import (
    FOLD_FORMAT,
    FoldCheckpoint,
    checkpoint_state,
    decode_checkpoint,
    encode_checkpoint,
)

log = logging.getLogger("apomesh.daemon")

CHECKPOINT_DB = "checkpoints"
"""The store database of fold checkpoints, keyed by session id."""

CHECKPOINT_EVERY = 10_000
"""Events a writer appends between two checkpoints of its session, by default."""


@runtime_checkable
class ReadsFromSequence(Protocol):
    """A log that can read a session from a known stream sequence (``JetStreamLog``)."""

    async def read_from_sequence(self, session_id: str, index: int, seq: int) -> list[Envelope]: ...


@runtime_checkable
class KnowsSequences(Protocol):
    """A log that knows the stream sequence of a session's last event (``JetStreamLog``)."""

    def known_sequence(self, session_id: str, index: int) -> int | None: ...


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

    async def write(self, checkpoint: FoldCheckpoint) -> None:
        """Store ``checkpoint`` as its session's (replacing the one before)."""
        await self.store.write_batch(
            [(CHECKPOINT_DB, checkpoint.session_id, encode_checkpoint(checkpoint))]
        )

    async def delete(self, session_id: str) -> None:
        await self.store.write_batch([], [(CHECKPOINT_DB, session_id)])

    async def load(self, session_id: str) -> ResumePoint | None:
        """The session's checkpoint as a resume point, or None (none stored, not usable, or the
        store cannot be read now: the log then says everything)."""
        try:
            raw = await self.store.get(CHECKPOINT_DB, session_id)
        except StoreError as exc:
            self.log.warning("session %s: fold checkpoint not read (%s)", session_id, exc)
            return None
        return None if raw is None else self._usable(session_id, raw)

    async def load_all(self) -> dict[str, ResumePoint]:
        """Every usable checkpoint, by session (none when the store cannot be read now)."""
        points = {}
        try:
            stored = await self.store.scan(CHECKPOINT_DB, "")
        except StoreError as exc:
            self.log.warning("fold checkpoints not read (%s); sessions fold from their start", exc)
            return {}
        for session_id, raw in stored:
            point = self._usable(session_id, raw)
            if point is not None:
                points[session_id] = point
        return points

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
            state = checkpoint_state(checkpoint)
        except CodecError as exc:
            self.log.warning(
                "session %s: its fold checkpoint cannot be decoded (%s); folding its log from the"
                " start",
                session_id,
                exc.message,
            )
            self.stats.ignored += 1
            return None
        return ResumePoint(state, checkpoint.event_id, checkpoint.seq)

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
                envelopes = await log_adapter.read_from_sequence(session_id, at, point.seq)
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
