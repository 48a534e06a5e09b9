"""Live event streams of sessions, one log tail per session shared by all its readers.

Every ``GET /v1/sessions/{id}/events`` client follows a session live. Giving each its own tail on
the log would cost a JetStream consumer, a delivery and a decode per client for every event; with
a hundred clients watching one session that is a hundred of each. ``SessionTails`` keeps one tail
per followed session (a ``_Feed``) and fans its envelopes out to the readers' queues in-process.

No gap and no repeat: a reader joins the feed first, waits until the feed knows where it starts
(the log's last index when it began, ``start``), and only then reads the history it asked for from
the log. That read ends at or after ``start``, and the feed delivers everything after ``start``,
so the two overlap and the reader skips what it already yielded. A feed whose tail fails (NATS
gone) ends its readers with that error; a reader too slow to keep up is ended rather than allowed
to hold an unbounded backlog. Either way the client reconnects with ``Last-Event-ID`` and loses
nothing. A feed ends after the session's terminal event and goes away with its last reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from apomesh.core.envelope import Envelope
from apomesh.core.errors import LogError, LogUnavailable
from apomesh.core.events import SessionEnded

log = logging.getLogger("apomesh.tails")

DEFAULT_BACKLOG = 10_000
"""Envelopes a reader may fall behind its feed before it is ended (and reconnects)."""


class _Ended:
    """Put in a reader's queue when its feed ended: ``error`` is why (None after the terminal
    event, which the reader has already been given)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Feed:
    """The one tail of one session, and the queues of the readers following it."""

    def __init__(self, tails: SessionTails, session_id: str) -> None:
        self.tails = tails
        self.session_id = session_id
        self.readers: set[asyncio.Queue[Envelope | _Ended]] = set()
        self.started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._run(), name=f"tail-{session_id}")

    def join(self) -> asyncio.Queue[Envelope | _Ended]:
        queue: asyncio.Queue[Envelope | _Ended] = asyncio.Queue()
        self.readers.add(queue)
        return queue

    def leave(self, queue: asyncio.Queue[Envelope | _Ended]) -> None:
        self.readers.discard(queue)
        if not self.readers:
            self.tails._drop(self)
            self.task.cancel()

    def _publish(self, item: Envelope | _Ended) -> None:
        for queue in list(self.readers):
            if isinstance(item, Envelope) and queue.qsize() >= self.tails.backlog:
                # Too far behind: end this reader; its client resumes from the log.
                self.readers.discard(queue)
                _drain(queue)
                queue.put_nowait(_Ended(LogUnavailable("event stream reader fell too far behind")))
                continue
            queue.put_nowait(item)

    async def _run(self) -> None:
        error: BaseException | None = None
        try:
            start = await self.tails.log.last_index(self.session_id)
            self.started.set_result(start)
            async for envelope in self.tails.log.tail(self.session_id, start):
                self._publish(envelope)
                if isinstance(envelope.event, SessionEnded):
                    break
        except asyncio.CancelledError:
            error = LogUnavailable("the event stream was stopped")
            raise
        except Exception as exc:
            log.warning("tail of session %s ended: %s", self.session_id, exc)
            error = exc
        finally:
            self.tails._drop(self)
            if not self.started.done():
                self.started.set_exception(error or LogUnavailable("the tail stopped"))
                with contextlib.suppress(BaseException):
                    self.started.exception()  # retrieved here; readers see their own error
            self._publish(_Ended(error))


def _drain(queue: asyncio.Queue[Any]) -> None:
    with contextlib.suppress(asyncio.QueueEmpty):
        while True:
            queue.get_nowait()


class SessionTails:
    """Shared live tails over an event log (``read``, ``last_index`` and ``tail`` of
    ``apomesh.core.ports.EventLog``)."""

    def __init__(self, log: Any, *, backlog: int = DEFAULT_BACKLOG) -> None:
        self.log = log
        self.backlog = backlog
        self._feeds: dict[str, _Feed] = {}

    def __len__(self) -> int:
        """Sessions followed right now (one log tail each)."""
        return len(self._feeds)

    def readers(self, session_id: str) -> int:
        feed = self._feeds.get(session_id)
        return len(feed.readers) if feed is not None else 0

    def _drop(self, feed: _Feed) -> None:
        if self._feeds.get(feed.session_id) is feed:
            del self._feeds[feed.session_id]

    async def follow(self, session_id: str, after: int) -> AsyncIterator[Envelope]:
        """Every envelope with index > ``after``: the log's first, then live ones, in order and
        without gaps, ending after ``SessionEnded``. Raises the feed's error if its tail fails
        (``LogUnavailable``) or this reader fell too far behind."""
        feed = self._feeds.get(session_id)
        if feed is None or feed.task.done():
            feed = self._feeds[session_id] = _Feed(self, session_id)
        queue = feed.join()
        try:
            await asyncio.shield(feed.started)
            last = after
            for envelope in await self.log.read(session_id, after):
                yield envelope
                last = envelope.index
                if isinstance(envelope.event, SessionEnded):
                    return
            while True:
                item = await queue.get()
                if isinstance(item, _Ended):
                    if item.error is not None:
                        raise item.error
                    return
                if item.index <= last:
                    continue
                if item.index != last + 1:
                    raise LogError(
                        f"session {session_id}: the live tail skipped from {last} to {item.index}"
                    )
                yield item
                last = item.index
                if isinstance(item.event, SessionEnded):
                    return
        finally:
            feed.leave(queue)

    async def aclose(self) -> None:
        feeds = list(self._feeds.values())
        self._feeds.clear()
        for feed in feeds:
            feed.task.cancel()
        await asyncio.gather(*(f.task for f in feeds), return_exceptions=True)
