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
from collections.abc import AsyncIterator

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

    async def follow(self, session_id: str) -> AsyncIterator[TurnDelta]:
        """The deltas of ``session_id`` published from now on, until the caller stops."""
        queue: asyncio.Queue[TurnDelta] = asyncio.Queue(self.backlog)
        readers = self._readers.setdefault(session_id, set())
        readers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            readers.discard(queue)
            if not readers and self._readers.get(session_id) is readers:
                del self._readers[session_id]
