"""A session's events as server-sent events: the frame format, where a stream starts, and the
streaming response that replays the log, continues live and sends keep-alive comments.

Each event is one frame::

    id: <index in the session's log>
    event: <event name, e.g. AgentLifecycle>
    data: {"v":1,"session_id":...,"index":...,"ts":...,"event_id":...,"kind":...,"event":{...}}

(bytes fields in ``event`` are base64 strings). A client resumes with ``Last-Event-ID: <index>``
(or ``?after=<index>``) and gets exactly the events after it.

With ``?deltas=true``, while a streaming model writes an agent's turn, the live part of the
stream interleaves the pieces as they come, each a frame *without* an ``id`` (so a client's
``Last-Event-ID`` stays the last event's index)::

    event: ModelDelta
    data: {"session_id":...,"agent":"root","step":3,"delta":{"kind":"text","text":"Hel"}}

``delta`` is a ``ModelDelta`` (``kind`` ``start``, ``text`` or ``tool_call`` with ``call``,
``tool`` and ``arguments``). They are a preview: never replayed, dropped for a client that falls
behind; the turn itself arrives as events like any other, after its pieces. ``: keep-alive`` comment lines keep
idle connections open through proxies. The stream ends after the terminal ``SessionEnded`` event.
The token a stream was opened with is checked again every ``AUTH_RECHECK_SECONDS``: once it is
revoked or expired the stream sends one ``event: error`` frame (``{"error": "unauthorized",
"message": ...}``, no ``id``) and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from apomesh.api.service import DaemonService
from apomesh.core.envelope import Envelope
from apomesh.core.events import SessionEnded, event_name
from apomesh.runtime.protocol import TurnDelta

log = logging.getLogger("apomesh.api.sse")

KEEPALIVE_FRAME = b": keep-alive\n\n"
DEFAULT_KEEPALIVE_SECONDS = 15.0
AUTH_RECHECK_SECONDS = 1.0
REVOKED_FRAME = (
    b"event: error\n"
    b'data: {"error":"unauthorized","message":"the token of this stream was revoked or expired"}'
    b"\n\n"
)


def envelope_json(env: Envelope) -> bytes:
    """The JSON form of an envelope: its fields by name plus ``kind``, the event's name."""
    return msgspec.json.encode(
        {
            "v": env.v,
            "session_id": env.session_id,
            "index": env.index,
            "ts": env.ts,
            "event_id": env.event_id,
            "kind": event_name(env.event),
            "event": env.event,
        }
    )


FRAME_CACHE_BYTES = 16 * 1024 * 1024
"""Recently sent frames kept for other streams of the same events (by total size)."""
_frames: OrderedDict[tuple[str, int, str], bytes] = OrderedDict()
_frames_bytes = 0


def frame(env: Envelope) -> bytes:
    """One SSE frame for an envelope. Encoded once for all the streams that send it (a hundred
    clients following one session get the same envelope each), from a small recent-frames cache
    keyed by the envelope's identity in the log."""
    global _frames_bytes
    key = (env.session_id, env.index, env.event_id)
    cached = _frames.get(key)
    if cached is not None:
        return cached
    name = event_name(env.event).encode()
    encoded = b"id: %d\nevent: %s\ndata: %s\n\n" % (env.index, name, envelope_json(env))
    _frames[key] = encoded
    _frames_bytes += len(encoded)
    while _frames_bytes > FRAME_CACHE_BYTES and _frames:
        _frames_bytes -= len(_frames.popitem(last=False)[1])
    return encoded


DELTA_EVENT = "ModelDelta"
"""The SSE event name of a frame carrying a piece of a model turn."""
LIVE_QUEUE = 256
"""Live items (events and deltas) a stream holds for its client; deltas beyond it are dropped."""


def delta_frame(delta: TurnDelta) -> bytes:
    """The frame of a piece of a model turn: no ``id`` line (it is not in the log)."""
    data = msgspec.json.encode(
        {
            "session_id": delta.session_id,
            "agent": delta.agent,
            "step": delta.step,
            "delta": delta.delta,
        }
    )
    return b"event: %s\ndata: %s\n\n" % (DELTA_EVENT.encode(), data)


class InvalidStart(ValueError):
    """A ``Last-Event-ID`` header or ``after`` parameter that is not an index."""


def start_after(headers: Mapping[str, str], query: Mapping[str, str]) -> int:
    """The index a stream starts after: ``Last-Event-ID`` wins over ``?after=``; -1 by default."""
    raw = headers.get("last-event-id")
    source = "Last-Event-ID"
    if raw is None or not raw.strip():
        raw = query.get("after")
        source = "after"
    if raw is None or not raw.strip():
        return -1
    try:
        after = int(raw.strip())
    except ValueError:
        raise InvalidStart(f"{source} must be an event index, not {raw[:40]!r}") from None
    if after < -1:
        raise InvalidStart(f"{source} must be -1 or more")
    return after


async def session_frames(
    service: DaemonService,
    session_id: str,
    after: int,
    replay: list[Envelope],
    *,
    deltas: bool = False,
) -> AsyncIterator[bytes]:
    """Frames of ``replay`` (read before the response started, so an unknown session was a 404),
    then of the live tail, without repeats or gaps, ending after ``SessionEnded``. With
    ``deltas`` the live tail is interleaved with the pieces of model turns, followed from before
    the first frame (pieces written during the replay come after it)."""
    pieces = service.live_deltas(session_id) if deltas else None
    try:
        last = after
        for env in replay:
            if env.index <= last:
                continue
            yield frame(env)
            last = env.index
            if isinstance(env.event, SessionEnded):
                return
        view = await service.get_session(session_id)
        if view.terminal and view.last_index <= last:
            return
        async for item in live_items(service, session_id, last, pieces):
            if isinstance(item, TurnDelta):
                yield delta_frame(item)
                continue
            if item.index <= last:
                continue
            yield frame(item)
            last = item.index
            if isinstance(item.event, SessionEnded):
                return
    finally:
        closer = getattr(pieces, "aclose", None)
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()


async def live_items(
    service: DaemonService,
    session_id: str,
    after: int,
    pieces: AsyncIterator[TurnDelta] | None,
) -> AsyncIterator[Envelope | TurnDelta]:
    """The session's live tail after ``after``, interleaved with ``pieces`` (the pieces of model
    turns) as they arrive when given; ends with the tail (an error of the tail is raised here)."""
    if pieces is None:
        tail = service.tail_events(session_id, after)
        try:
            async for env in tail:
                yield env
        finally:
            closer = getattr(tail, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()
        return
    queue: asyncio.Queue[Envelope | TurnDelta | BaseException | None] = asyncio.Queue(LIVE_QUEUE)

    async def events() -> None:
        tail = service.tail_events(session_id, after)
        try:
            async for env in tail:
                await queue.put(env)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)
        finally:
            closer = getattr(tail, "aclose", None)
            if closer is not None:
                await closer()

    async def forward(source: AsyncIterator[TurnDelta]) -> None:
        async for delta in source:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(delta)

    tasks = [asyncio.create_task(events()), asyncio.create_task(forward(pieces))]
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class EventStreams:
    """The app's open event streams, so a stopping server can end them cleanly at once (clients
    see the stream end and resume with ``Last-Event-ID``) instead of waiting on them."""

    def __init__(self) -> None:
        self._open: set[anyio.CancelScope] = set()
        self.closing = False

    def __len__(self) -> int:
        return len(self._open)

    def add(self, scope: anyio.CancelScope) -> None:
        if self.closing:
            scope.cancel()
        self._open.add(scope)

    def discard(self, scope: anyio.CancelScope) -> None:
        self._open.discard(scope)

    def close_all(self) -> None:
        """End every open stream and every stream opened from now on."""
        self.closing = True
        for scope in list(self._open):
            scope.cancel()


class EventStreamResponse(Response):
    """Streams SSE frames from ``source`` with a keep-alive comment every ``keepalive`` seconds.

    One task pumps frames, one sends keep-alives and one watches for the client leaving; writes
    are serialised by a lock, so no frame is ever cut by a keep-alive or lost to a timeout."""

    media_type = "text/event-stream"

    def __init__(
        self,
        source: AsyncIterator[bytes],
        *,
        keepalive: float = DEFAULT_KEEPALIVE_SECONDS,
        streams: EventStreams | None = None,
        still_authorized: Callable[[], bool] | None = None,
    ) -> None:
        # Not Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.source = source
        self.keepalive = keepalive
        self.streams = streams if streams is not None else EventStreams()
        self.still_authorized = still_authorized

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = anyio.Lock()
        client_gone = False

        async def emit(chunk: bytes) -> None:
            async with lock:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def pump(group: anyio.abc.TaskGroup) -> None:
            nonlocal client_gone
            try:
                async for chunk in self.source:
                    await emit(chunk)
            except OSError:
                client_gone = True
            except Exception:
                # Headers are sent: the status cannot change. End the stream; the client
                # reconnects with Last-Event-ID and loses nothing.
                log.exception("event stream failed")
            finally:
                closer: Any = getattr(self.source, "aclose", None)
                if closer is not None:
                    with anyio.CancelScope(shield=True):
                        await closer()
                group.cancel_scope.cancel()

        async def keep_alive(group: anyio.abc.TaskGroup) -> None:
            nonlocal client_gone
            while True:
                await anyio.sleep(self.keepalive)
                try:
                    await emit(KEEPALIVE_FRAME)
                except OSError:
                    client_gone = True
                    group.cancel_scope.cancel()
                    return

        async def watch_credentials(group: anyio.abc.TaskGroup) -> None:
            nonlocal client_gone
            assert self.still_authorized is not None
            while True:
                await anyio.sleep(AUTH_RECHECK_SECONDS)
                if not self.still_authorized():
                    try:
                        await emit(REVOKED_FRAME)
                    except OSError:
                        client_gone = True
                    group.cancel_scope.cancel()
                    return

        async def watch_disconnect(group: anyio.abc.TaskGroup) -> None:
            nonlocal client_gone
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    client_gone = True
                    group.cancel_scope.cancel()
                    return

        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        with anyio.CancelScope() as stream_scope:
            self.streams.add(stream_scope)
            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(watch_disconnect, group)
                    group.start_soon(keep_alive, group)
                    if self.still_authorized is not None:
                        group.start_soon(watch_credentials, group)
                    group.start_soon(pump, group)
            finally:
                self.streams.discard(stream_scope)
        if not client_gone:
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
