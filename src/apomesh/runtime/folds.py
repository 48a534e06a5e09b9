"""Folded states of sessions the daemon does not drive, kept so that reading one again costs what
was appended since, not the whole log.

``GET /v1/sessions/{id}`` and every event stream ask for a session's folded view. For a live
session the daemon has it in memory; for any other (ended, stranded elsewhere, or driven by another
daemon) it would read and fold the whole log at every request: for a 10k-event session that is
tens of milliseconds each time. ``FoldCache`` keeps the last folded state per session (a bounded,
least-recently-used set) and brings it up to date by folding only the events after its last index;
an ended session's state never changes, so it is answered without touching the log at all. A view
is rebuilt only when the state moved on. The first fold of a session starts from its fold
checkpoint when the cache is given ``start`` (``FoldCheckpoints.fold``): a long session driven by
another daemon costs the events after its checkpoint, not its whole log.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import msgspec

from apomesh.core.envelope import Envelope
from apomesh.core.errors import NotFound
from apomesh.core.state import SessionState, apply, fold
from apomesh.core.views import SessionView, session_view

ReadLog = Callable[[str, int], Awaitable[list[Envelope]]]
"""``read(session_id, after)``: the session's envelopes with index > ``after``, in order."""

FoldLog = Callable[[str], Awaitable[SessionState]]
"""``start(session_id)``: the session's state as its log holds it now (an empty state, index -1,
for a session with no events), folded by the caller's means (from a fold checkpoint)."""

DEFAULT_CAPACITY = 512


class _Entry(msgspec.Struct):
    lock: asyncio.Lock = msgspec.field(default_factory=asyncio.Lock)
    state: SessionState | None = None
    view: SessionView | None = None
    view_index: int = -2


class FoldCache:
    """Folded states of sessions read from the log, updated incrementally.

    The states are the cache's own, folded from the log (and the fold checkpoints ``start``
    reads) alone: callers read them (and build views from them) without awaiting in between, and
    never append through them."""

    def __init__(
        self, read: ReadLog, *, capacity: int = DEFAULT_CAPACITY, start: FoldLog | None = None
    ) -> None:
        self._read = read
        self._start = start
        self._capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.full_folds = 0
        self.incremental_folds = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, session_id: str) -> _Entry:
        entry = self._entries.get(session_id)
        if entry is None:
            entry = self._entries[session_id] = _Entry()
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(session_id)
        return entry

    def forget(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    def keep_ended(self, state: SessionState) -> None:
        """Keep an ended session's final state as its writer folded it from what it appended
        (it never changes again), so reading the session costs no log read, even while NATS is
        out of reach."""
        if not state.terminal:
            raise ValueError(f"session {state.session_id} has not ended")
        entry = self._entry(state.session_id)
        entry.state, entry.view = state, None

    async def state(self, session_id: str) -> SessionState:
        """The session's state as the log holds it now. ``NotFound`` for a session with no
        events; a log that cannot be folded raises its ``CodecError``/``FoldError`` (and is not
        kept)."""
        entry = self._entry(session_id)
        async with entry.lock:
            current = entry.state
            if current is None:
                try:
                    state = await self._fold_whole(session_id)
                except Exception:
                    self._entries.pop(session_id, None)
                    raise
                if state.last_index < 0:
                    self._entries.pop(session_id, None)
                    raise NotFound(f"session {session_id}")
                entry.state = state
                self.full_folds += 1
                return state
            if current.terminal:
                return current
            newer = await self._read(session_id, current.last_index)
            if newer:
                try:
                    for env in newer:
                        apply(current, env)
                except Exception:
                    # Half folded: drop it, so the next read folds the whole log and fails
                    # (or not) on its own.
                    self._entries.pop(session_id, None)
                    raise
                self.incremental_folds += 1
            return current

    async def _fold_whole(self, session_id: str) -> SessionState:
        if self._start is not None:
            return await self._start(session_id)
        return fold(await self._read(session_id, -1), session_id)

    async def view(self, session_id: str) -> SessionView:
        """The session's view (``session_view`` of ``state``), rebuilt only when it moved on."""
        state = await self.state(session_id)
        entry = self._entries.get(session_id)
        if entry is None:
            return session_view(state)
        if entry.view is None or entry.view_index != state.last_index:
            entry.view = session_view(state)
            entry.view_index = state.last_index
        return entry.view
