"""The HTTP API of a real daemon: event-stream latency under many tails, and reading a long session.

Starts its own nats-server and an ``apomesh serve`` process (no workers: the sessions measured
here are written straight to the event log by this script, which is what the daemon serves to
clients whoever wrote them), then measures:

- **SSE latency with N concurrent tails** (default 100): N clients follow one session over
  ``GET /v1/sessions/{id}/events`` while this script appends events to its log one at a time,
  every few milliseconds. The latency of an event at a client is the time from just before its
  append was sent to the moment that client parsed its frame (wall-clock times, one machine).
  The clients run in a process of their own (``--client-processes N`` spreads them over N; on a
  two-core machine more client processes only take CPU from the daemon and raise the figures).
  Printed: p50, p99 and max over every (event, client) pair, and how many frames arrived.
- **REST ``GET /v1/sessions/{id}`` of a 10k-event session**: the first request (which folds the
  whole log), then sequential requests while the session is still open (each reads only what was
  appended since: one direct get) and once it has ended (answered from the fold cache without
  touching the log), and the same with 8 concurrent clients.

Run ``python bench/bench_api.py`` (``--quick`` for smaller counts; ``--tails``, ``--events``).
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.nats_connect import NATS, connect
from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.core.definition import parse_definition
from apomesh.core.envelope import Envelope, make
from apomesh.core.events import (
    AgentLifecycle,
    AgentSnapshotted,
    Event,
    SessionEnded,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.composition import compose_shape
from apomesh.testing import DaemonProcess

AGENT = {
    "name": "bench",
    "version": "1.0.0",
    "coordination": "solo",
    "tools": ["fs.append"],
    "model": {"provider": "scripted", "turns": [{"final": "done"}]},
}


def opening(session_id: str) -> list[Envelope]:
    """A session's first two events, with a real pinned shape."""
    shape = compose_shape(parse_definition(AGENT), host=PluginHost(), skills=[], source="inline")
    events: list[Event] = [
        SessionStarted(goal="bench", root="root", shape=shape),
        AgentLifecycle("root", "born", config=shape.root, task="bench", task_index=0),
        AgentLifecycle("root", "dispatched", worker="bench-worker", epoch=1),
        AgentLifecycle("root", "running", worker="bench-worker"),
    ]
    return [wrap(session_id, i, e) for i, e in enumerate(events)]


OPENING = 4


def step_event(index: int) -> Event:
    """The event at ``index`` (after the opening) of a long session: tool calls with their
    results, and node snapshots."""
    n = index - OPENING
    kind = n % 3
    key = f"k{n // 3:08d}"
    if kind == 0:
        return ToolCallIntent("root", key, "fs.append", {"path": "log.txt", "line": f"line {n}"})
    if kind == 1:
        return ToolCallRecorded("root", key, "fs.append", "ok", "1 line")
    return AgentSnapshotted("root", snapshot_id=n, source="node", step=n // 3 + 1, size=900)


def wrap(session_id: str, index: int, event: Event) -> Envelope:
    return make(session_id, index, time.time(), uuid.uuid4().hex, event)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


# --- SSE latency ------------------------------------------------------------------------------


async def _client_tails(
    url: str, session_id: str, after: int, last: int, count: int, ready: Any
) -> list[tuple[int, float]]:
    """``count`` event streams of one session in this process: (index, wall time received)."""
    received: list[tuple[int, float]] = []
    connected = 0

    async def tail(client: httpx.AsyncClient) -> None:
        nonlocal connected
        headers = {"Last-Event-ID": str(after), "Accept": "text/event-stream"}
        path = f"/v1/sessions/{session_id}/events"
        async with client.stream("GET", path, headers=headers) as response:
            assert response.status_code == 200, response.status_code
            connected += 1
            if connected == count:
                ready.put("ready")
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    index = int(line[4:])
                    received.append((index, time.time()))
                    if index == last:
                        return

    limits = httpx.Limits(max_connections=count + 5, max_keepalive_connections=count + 5)
    timeout = httpx.Timeout(30, read=120)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(tail(client) for _ in range(count)))
    return received


def client_process(
    url: str, session_id: str, after: int, last: int, count: int, ready: Any, results: Any
) -> None:
    """One client process (so parsing frames on the client side does not queue on one core)."""
    results.put(asyncio.run(_client_tails(url, session_id, after, last, count, ready)))


async def sse_latency(
    url: str, log: JetStreamLog, tails: int, events: int, gap: float, processes: int
) -> None:
    session_id = uuid.uuid4().hex
    await log.append(session_id, opening(session_id))
    first = OPENING
    last = first + events  # the SessionEnded appended last
    sent_at: dict[int, float] = {}
    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    shares = [tails // processes + (1 if i < tails % processes else 0) for i in range(processes)]
    clients = [
        context.Process(
            target=client_process, args=(url, session_id, first - 1, last, n, ready, results)
        )
        for n in shares
        if n
    ]
    for proc in clients:
        proc.start()
    try:
        for _ in clients:
            await asyncio.to_thread(ready.get, True, 60)
        await asyncio.sleep(0.5)  # every stream past its replay, waiting live
        for index in range(first, last + 1):
            event = SessionEnded("completed", output="done") if index == last else step_event(index)
            envelope = wrap(session_id, index, event)
            sent_at[index] = time.time()
            await log.append(session_id, [envelope])
            await asyncio.sleep(gap)
        received: list[float] = []
        for _ in clients:
            for index, at in await asyncio.to_thread(results.get, True, 120):
                received.append(at - sent_at[index])
    finally:
        for proc in clients:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    expected = tails * (events + 1)
    print(
        f"  {tails} tails in {len(clients)} client processes x {events + 1} events "
        f"({gap * 1000:.0f} ms apart): {len(received)}/{expected} frames; append -> client "
        f"latency p50 {ms(statistics.median(received))}, p99 {ms(percentile(received, 0.99))}, "
        f"max {ms(max(received))}"
    )


# --- GET of a long session -----------------------------------------------------------------------


async def write_long_session(log: JetStreamLog, session_id: str, events: int) -> int:
    envelopes = opening(session_id)
    index = len(envelopes)
    await log.append(session_id, envelopes)
    batch: list[Envelope] = []
    while index < events:
        batch.append(wrap(session_id, index, step_event(index)))
        index += 1
        if len(batch) == 200:
            await log.append(session_id, batch)
            batch = []
    if batch:
        await log.append(session_id, batch)
    return index - 1


async def timed_gets(
    client: httpx.AsyncClient, session_id: str, count: int, concurrency: int = 1
) -> list[float]:
    timings: list[float] = []

    async def worker(share: int) -> None:
        for _ in range(share):
            started = time.perf_counter()
            response = await client.get(f"/v1/sessions/{session_id}")
            timings.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text

    await asyncio.gather(*(worker(count // concurrency) for _ in range(concurrency)))
    return timings


def report(label: str, timings: list[float]) -> None:
    print(
        f"  {label}: p50 {ms(statistics.median(timings))}, p99 {ms(percentile(timings, 0.99))} "
        f"({len(timings)} requests)"
    )


async def long_session_gets(url: str, log: JetStreamLog, events: int, requests: int) -> None:
    session_id = uuid.uuid4().hex
    started = time.perf_counter()
    last = await write_long_session(log, session_id, events)
    print(f"  wrote a {last + 1}-event session to the log in {time.perf_counter() - started:.1f} s")
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = time.perf_counter()
        first = await client.get(f"/v1/sessions/{session_id}")
        cold = time.perf_counter() - started
        body = msgspec.json.decode(first.content)
        assert first.status_code == 200 and body["last_index"] == last, first.text[:300]
        print(f"  first GET (reads and folds the whole log): {ms(cold)}")
        report(
            "GET while open (folds only what is new)",
            await timed_gets(client, session_id, requests),
        )
        report(
            "GET while open, 8 concurrent clients",
            await timed_gets(client, session_id, requests, concurrency=8),
        )
        await log.append(session_id, [wrap(session_id, last + 1, SessionEnded("completed"))])
        report(
            "GET once ended (fold cache, no log read)",
            await timed_gets(client, session_id, requests),
        )
        report(
            "GET once ended, 8 concurrent clients",
            await timed_gets(client, session_id, requests, concurrency=8),
        )
        small = uuid.uuid4().hex
        await log.append(small, opening(small))
        report("GET of a 4-event session, for scale", await timed_gets(client, small, requests))


# --- main ----------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, url: str, nats_url: str) -> None:
    nc: NATS = await connect([nats_url])
    try:
        log = JetStreamLog(nc)
        await log.ensure()
        print(f"SSE: append to a client receiving the event (daemon at {url})")
        await sse_latency(url, log, args.tails, args.events, args.gap, args.client_processes)
        print(f"REST: GET /v1/sessions/{{id}} of a {args.long_events}-event session")
        await long_session_gets(url, log, args.long_events, args.requests)
    finally:
        await nc.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tails, events and requests")
    parser.add_argument("--tails", type=int, default=100, help="concurrent event-stream clients")
    parser.add_argument("--events", type=int, default=200, help="events appended while tailing")
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between those appends")
    parser.add_argument(
        "--client-processes", type=int, default=1, help="processes the tails are spread over"
    )
    parser.add_argument(
        "--long-events", type=int, default=10_000, help="events of the long session"
    )
    parser.add_argument("--requests", type=int, default=400, help="GETs per measurement")
    args = parser.parse_args()
    if args.quick:
        args.tails, args.events, args.requests = min(args.tails, 20), min(args.events, 50), 80
        args.long_events = min(args.long_events, 2000)
    with tempfile.TemporaryDirectory(prefix="apomesh-bench-api-") as tmp:
        base = Path(tmp)
        server = NatsServer(single_node(base, name="nats"))
        server.start()
        daemon = DaemonProcess([server.url], base / "daemon", workers=0)
        try:
            daemon.start()
            asyncio.run(run(args, daemon.url, server.url))
        finally:
            daemon.stop()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
