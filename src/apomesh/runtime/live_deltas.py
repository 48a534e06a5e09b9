"""The pieces of model turns being written, handed from the control plane to the session's live
event streams in this process.

A streaming model's worker publishes each piece (``TurnDelta``) to the daemon that dispatched
the agent; the control plane checks it belongs to a dispatch in flight on that worker and
``publish``es it here, and every reader ``follow``ing the session gets it. Nothing here is
durable or replayed: a delta is a preview of a turn the log records whole, so a reader that
joins late, falls behind (``DEFAULT_BACKLOG``) or reconnects misses previews, never events.
"""

from __future__ import annotations

import asyncio
import contextlib

from apomesh.runtime.protocol import TurnDelta

DEFAULT_BACKLOG = 1000
"""Deltas a reader may fall behind by; more are dropped for that reader (its events are not)."""


class LiveDeltas:
    """Who follows which session's deltas, and the fan-out to them."""

    def __init__(self, backlog: int = DEFAULT_BACKLOG) -> None:
        self.backlog = backlog
        self._readers: dict[str, set[asyncio.Queue[TurnDelta]]] = {}

    def followers(self, session_id: str) -> int:
        """How many readers follow ``session_id``'s deltas now."""
        return len(self._readers.get(session_id, ()))

    def publish(self, delta: TurnDelta) -> None:
        """Hand ``delta`` to every reader of its session (never blocks)."""
        for queue in self._readers.get(delta.session_id, ()):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(delta)

    def follow(self, session_id: str) -> DeltaReader:
        """A reader of the deltas of ``session_id`` published from now on (it follows from this
        call, not from its first read), until it is closed."""
        queue: asyncio.Queue[TurnDelta] = asyncio.Queue(self.backlog)
        self._readers.setdefault(session_id, set()).add(queue)
        return DeltaReader(self, session_id, queue)

    def _forget(self, session_id: str, queue: asyncio.Queue[TurnDelta]) -> None:
        readers = self._readers.get(session_id)
        if readers is not None:
            readers.discard(queue)
            if not readers:
                del self._readers[session_id]


class DeltaReader:
    """One reader's deltas of one session, in order: ``async for``, then ``aclose()``."""

    def __init__(self, hub: LiveDeltas, session_id: str, queue: asyncio.Queue[TurnDelta]) -> None:
        self._hub = hub
        self._session_id = session_id
        self._queue = queue

    def __aiter__(self) -> DeltaReader:
        return self

    async def __anext__(self) -> TurnDelta:
        return await self._queue.get()

    async def aclose(self) -> None:
        self._hub._forget(self._session_id, self._queue)
