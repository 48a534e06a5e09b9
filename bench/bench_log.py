"""Event log throughput on a single nats-server: the JetStream adapter against bare nats-py.

Starts its own nats-server (JetStream on, a tmp store, a free 127.0.0.1 port) and measures, for
300-byte events, as medians over several runs (p99 where a per-call latency makes sense):

- awaited appends, one event per call: ``JetStreamLog.append`` vs a bare ``js.publish`` loop with
  the same headers (``Nats-Msg-Id`` and ``Nats-Expected-Last-Subject-Sequence`` chained from each
  acknowledgement);
- batched appends of ``--batch`` events (and of 50): the adapter (the append's events as one
  message, see log_messages.py) vs bare ``publish_async`` + ``gather`` of one message per event
  with the same message ids, where only the first event can carry the expected sequence (so that
  bare figure is not safe against a stale writer), one session and then eight sessions at once;
- reading back one 10k-event session: ``read_raw`` (bytes) and ``read`` (decoded envelopes) vs a
  bare ordered consumer, plus the adapter's two read paths (batched direct get and ordered
  consumer) at several session sizes, which is how the read path was chosen;
- the adapter's append by step size with a message per event (``run_bytes=1``: each awaited
  and chained, as releases before runs stored them) and with the step's events as one message,
  one session and eight at once;
- listing sessions with 10k and 100k sessions in the stream (filled with pipelined publishes).

Run ``python bench/bench_log.py`` (``--quick`` for smaller counts, ``--runs N``). Figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from nats.js.api import ConsumerConfig, DeliverPolicy

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.nats_connect import NATS, connect
from apomesh.core.envelope import Envelope, encode, make
from apomesh.core.events import CoordinatorCheckpoint

EVENT_BYTES = 300
STEP_EVENTS = 2
"""Events per append where the benchmark stores a session as the daemon would."""
BARE_ACK_TIMEOUT = 60.0
"""nats-py's publish_async futures never resolve when the server answers with an error (its
reply handler raises instead of failing the future), so the bare loops bound their waits."""


def event(session_id: str, index: int, tag: str = "e") -> Envelope:
    """An envelope of ``session_id`` whose encoding is about ``EVENT_BYTES`` long."""
    base = make(
        session_id,
        index,
        1_700_000_000.0 + index,
        f"{tag}-{index}",
        CoordinatorCheckpoint("p", b""),
    )
    padding = max(0, EVENT_BYTES - len(encode(base)) - 2)
    return make(
        session_id, index, base.ts, base.event_id, CoordinatorCheckpoint("p", bytes(padding))
    )


# -- a server of our own ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def running_server() -> Iterator[str]:
    """A nats-server for the bench: the project's launcher when it is there, else started here."""
    store = tempfile.mkdtemp(prefix="apomesh-bench-log-")
    try:
        server = _project_server(store)
        if server is None:
            yield from _server_by_hand(store)
            return
        server.start()
        try:
            yield str(server.url)
        finally:
            server.stop()
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _project_server(store: str) -> Any:
    """``apomesh.adapters.natsserver``'s single node, or None when that launcher is absent."""
    try:
        natsserver = importlib.import_module("apomesh.adapters.natsserver")
        return natsserver.NatsServer(natsserver.single_node(Path(store)))
    except (ImportError, AttributeError, TypeError):
        return None


def _server_by_hand(store: str) -> Iterator[str]:
    binary = shutil.which("nats-server") or str(Path(sys.executable).with_name("nats-server"))
    port = _free_port()
    process = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- measuring -------------------------------------------------------------------------------------


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def timed(body: Callable[[], Awaitable[list[float] | None]]) -> tuple[float, list[float]]:
    started = time.perf_counter()
    latencies = await body()
    return time.perf_counter() - started, latencies or []


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def line(self, what: str, adapter: str, bare: str, ratio: str) -> None:
        self.rows.append((what, adapter, bare, ratio))
        print(f"  {what:<46} {adapter:>22} {bare:>22} {ratio:>8}", flush=True)


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f}/s"


# -- the benchmarks --------------------------------------------------------------------------------


async def bench_awaited(nc: NATS, log: JetStreamLog, count: int, runs: int, report: Report) -> None:
    js = nc.jetstream()
    adapter_rates, bare_rates, adapter_lat, bare_lat = [], [], [], []
    for run in range(runs):
        session = f"awaited-a-{run}"
        envelopes = [event(session, index) for index in range(count)]

        async def adapter_loop(
            session: str = session, envelopes: list[Envelope] = envelopes
        ) -> list[float]:
            latencies = []
            for envelope in envelopes:
                started = time.perf_counter()
                await log.append(session, [envelope])
                latencies.append(time.perf_counter() - started)
            return latencies

        seconds, latencies = await timed(adapter_loop)
        adapter_rates.append(count / seconds)
        adapter_lat += latencies

        bare_session = f"awaited-b-{run}"
        subject = log.subject(bare_session)
        payloads = [encode(event(bare_session, index)) for index in range(count)]

        async def bare_loop(
            bare_session: str = bare_session,
            subject: str = subject,
            payloads: list[bytes] = payloads,
        ) -> list[float]:
            latencies = []
            last_seq = 0
            for index, payload in enumerate(payloads):
                started = time.perf_counter()
                ack = await js.publish(
                    subject,
                    payload,
                    headers={
                        "Nats-Msg-Id": f"{bare_session}:{index}",
                        "Nats-Expected-Last-Subject-Sequence": str(last_seq),
                    },
                )
                last_seq = ack.seq
                latencies.append(time.perf_counter() - started)
            return latencies

        seconds, latencies = await timed(bare_loop)
        bare_rates.append(count / seconds)
        bare_lat += latencies
    adapter, bare = statistics.median(adapter_rates), statistics.median(bare_rates)
    report.line(
        "awaited append, 1 event per call",
        f"{adapter:,.0f}/s",
        f"{bare:,.0f}/s",
        f"{adapter / bare:.2f}",
    )
    report.line(
        "  p99 latency per append",
        f"{p99(adapter_lat) * 1e3:.2f} ms",
        f"{p99(bare_lat) * 1e3:.2f} ms",
        f"{p99(adapter_lat) / p99(bare_lat):.2f}",
    )


async def bench_batched(
    nc: NATS, log: JetStreamLog, count: int, batch: int, sessions: int, runs: int, report: Report
) -> None:
    js = nc.jetstream()
    adapter_rates, bare_rates, adapter_lat, bare_lat = [], [], [], []
    per_session = count // sessions
    for run in range(runs):
        names = [f"batched-a-{batch}-{sessions}-{run}-{number}" for number in range(sessions)]

        async def adapter_session(session: str, latencies: list[float]) -> None:
            for start in range(0, per_session, batch):
                step = [event(session, index) for index in range(start, start + batch)]
                started = time.perf_counter()
                await log.append(session, step)
                latencies.append(time.perf_counter() - started)

        async def adapter_all(names: list[str] = names) -> list[float]:
            latencies: list[float] = []
            await asyncio.gather(*(adapter_session(name, latencies) for name in names))
            return latencies

        seconds, latencies = await timed(adapter_all)
        adapter_rates.append(per_session * sessions / seconds)
        adapter_lat += latencies

        bare_names = [f"batched-b-{batch}-{sessions}-{run}-{number}" for number in range(sessions)]

        async def bare_session(session: str, latencies: list[float]) -> None:
            subject = log.subject(session)
            last_seq = 0
            payloads = [encode(event(session, index)) for index in range(per_session)]
            for start in range(0, per_session, batch):
                started = time.perf_counter()
                futures = []
                for index in range(start, start + batch):
                    headers = {"Nats-Msg-Id": f"{session}:{index}"}
                    if index == start:
                        headers["Nats-Expected-Last-Subject-Sequence"] = str(last_seq)
                    futures.append(
                        await js.publish_async(subject, payloads[index], headers=headers)
                    )
                acks = await asyncio.wait_for(asyncio.gather(*futures), BARE_ACK_TIMEOUT)
                last_seq = acks[-1].seq
                latencies.append(time.perf_counter() - started)

        async def bare_all(bare_names: list[str] = bare_names) -> list[float]:
            latencies: list[float] = []
            await asyncio.gather(*(bare_session(name, latencies) for name in bare_names))
            return latencies

        seconds, latencies = await timed(bare_all)
        bare_rates.append(per_session * sessions / seconds)
        bare_lat += latencies
    adapter, bare = statistics.median(adapter_rates), statistics.median(bare_rates)
    label = f"batched append, {batch}/call, {sessions} session{'s' if sessions > 1 else ''}"
    report.line(label, f"{adapter:,.0f}/s", f"{bare:,.0f}/s", f"{adapter / bare:.2f}")
    report.line(
        "  p99 latency per batch",
        f"{p99(adapter_lat) * 1e3:.2f} ms",
        f"{p99(bare_lat) * 1e3:.2f} ms",
        f"{p99(adapter_lat) / p99(bare_lat):.2f}",
    )


async def fill_session(nc: NATS, log: JetStreamLog, session: str, count: int) -> None:
    """Store ``count`` events of one session as the daemon does, two to an append (a step's
    intent and pointer, its result and pointer), interleaved with another session's."""
    for start in range(0, count, STEP_EVENTS):
        await log.append(
            session, [event(session, i) for i in range(start, min(count, start + STEP_EVENTS))]
        )
    noise = f"{session}-noise"
    await log.append(noise, [event(noise, index) for index in range(50)])


async def bare_ordered_read(nc: NATS, log: JetStreamLog, session: str) -> int:
    """Read a session's messages through a bare ordered consumer; answer how many there were."""
    js = nc.jetstream()
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, filter_subject=log.subject(session))
    subscription = await js.subscribe(
        log.subject(session), stream=log.stream, ordered_consumer=True, config=config
    )
    received = 0
    try:
        while True:
            msg = await subscription.next_msg(timeout=10)
            received += 1
            if msg.metadata.num_pending == 0:
                return received
    finally:
        await subscription.unsubscribe()


async def bench_read(nc: NATS, log: JetStreamLog, count: int, runs: int, report: Report) -> None:
    session = f"read-{count}"
    await fill_session(nc, log, session, count)
    raw_times, decoded_times, bare_times = [], [], []
    for _ in range(runs):
        fresh = JetStreamLog(nc, ensure_heartbeats=False)  # no remembered positions
        started = time.perf_counter()
        raw = await fresh.read_raw(session)
        raw_times.append(time.perf_counter() - started)
        assert len(raw) == count
        started = time.perf_counter()
        decoded = await fresh.read(session)
        decoded_times.append(time.perf_counter() - started)
        assert len(decoded) == count
        started = time.perf_counter()
        assert await bare_ordered_read(nc, log, session) == -(-count // STEP_EVENTS)  # messages
        bare_times.append(time.perf_counter() - started)
    raw_s, decoded_s, bare_s = (
        statistics.median(t) for t in (raw_times, decoded_times, bare_times)
    )
    report.line(
        f"read one {count:,}-event session (bytes)",
        f"{raw_s * 1e3:.1f} ms",
        f"{bare_s * 1e3:.1f} ms",
        f"{raw_s / bare_s:.2f}",
    )
    report.line(
        f"read one {count:,}-event session (decoded)",
        f"{decoded_s * 1e3:.1f} ms",
        f"{bare_s * 1e3:.1f} ms",
        f"{decoded_s / bare_s:.2f}",
    )


async def bench_read_paths(nc: NATS, log: JetStreamLog, sizes: list[int], runs: int) -> None:
    print("\n  read path by session size (median ms): batched direct get vs ordered consumer")
    for size in sizes:
        session = f"paths-{size}"
        await fill_session(nc, log, session, size)
        direct, consumer = [], []
        subject = log.subject(session)
        for _ in range(runs):
            started = time.perf_counter()
            run = await log._read_direct(subject, session, 0, 1, time.monotonic() + 60)
            direct.append(time.perf_counter() - started)
            assert len(run.payloads) == size
            started = time.perf_counter()
            run = await log._read_by_consumer(subject, session, 0, 1, size, time.monotonic() + 60)
            consumer.append(time.perf_counter() - started)
            assert len(run.payloads) == size
        d, c = statistics.median(direct), statistics.median(consumer)
        print(
            f"    {size:>7,} events: direct {d * 1e3:8.2f}   consumer {c * 1e3:8.2f}   direct/consumer {d / c:.2f}"
        )


async def bench_append_paths(nc: NATS, sizes: list[int], runs: int) -> None:
    print("\n  append by step size (median events/s): a message per event vs one message per step")
    chained = JetStreamLog(nc, ensure_heartbeats=False, timeout=60, run_bytes=1)
    packed = JetStreamLog(nc, ensure_heartbeats=False, timeout=60)
    for size in sizes:
        for sessions in (1, 8):
            figures = []
            for name, log in (("chained", chained), ("packed", packed)):
                rates = []
                for run in range(runs):
                    steps = max(4, 400 // size)
                    names = [f"paths-{name}-{size}-{sessions}-{run}-{n}" for n in range(sessions)]

                    async def one(
                        session: str, log: JetStreamLog = log, steps: int = steps, size: int = size
                    ) -> None:
                        for start in range(0, steps * size, size):
                            await log.append(
                                session, [event(session, i) for i in range(start, start + size)]
                            )

                    started = time.perf_counter()
                    await asyncio.gather(*(one(session) for session in names))
                    rates.append(steps * size * sessions / (time.perf_counter() - started))
                figures.append(statistics.median(rates))
            print(
                f"    steps of {size:>3}, {sessions} session{'s' if sessions > 1 else ' '}:"
                f" a message per event {figures[0]:>8,.0f}   one per step {figures[1]:>8,.0f}"
            )


async def bench_listing(nc: NATS, counts: list[int], runs: int, report: Report) -> None:
    js = nc.jetstream()
    for count in counts:
        stream = f"BENCH_LIST_{count}"
        log = JetStreamLog(
            nc,
            stream=stream,
            subject_prefix=f"benchlist{count}",
            ensure_heartbeats=False,
            timeout=60,
        )
        await log.ensure()
        payload = bytes(EVENT_BYTES)
        started = time.perf_counter()
        for start in range(0, count, 5000):
            futures = [
                await js.publish_async(log.subject(f"s{number:07d}"), payload)
                for number in range(start, min(count, start + 5000))
            ]
            await asyncio.wait_for(asyncio.gather(*futures), BARE_ACK_TIMEOUT)
        fill = time.perf_counter() - started
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            sessions = await log.list_sessions()
            times.append(time.perf_counter() - started)
            assert len(sessions) == count, len(sessions)
        median = statistics.median(times)
        report.line(
            f"list {count:,} sessions (fill {rate(count, fill)})", f"{median * 1e3:.0f} ms", "", ""
        )
        await js.delete_stream(stream)


async def main(arguments: argparse.Namespace) -> None:
    quick = arguments.quick
    runs = arguments.runs or (3 if quick else 5)
    with running_server() as url:
        nc = await connect(url)
        try:
            log = JetStreamLog(nc, timeout=60)
            await log.ensure()
            info = nc.connected_server_version
            print(
                f"nats-server {info.major}.{info.minor}.{info.patch}, {EVENT_BYTES}-byte events, {runs} runs, {os.cpu_count()} cores"
            )
            print(f"  {'':<46} {'adapter':>22} {'bare nats-py':>22} {'ratio':>8}")
            report = Report()
            await bench_awaited(nc, log, 500 if quick else 2000, runs, report)
            await bench_batched(
                nc, log, 2000 if quick else 10_000, arguments.batch, 1, runs, report
            )
            await bench_batched(
                nc, log, 4000 if quick else 20_000, arguments.batch, 8, runs, report
            )
            await bench_batched(nc, log, 5000 if quick else 10_000, 50, 1, runs, report)
            await bench_read(nc, log, 2000 if quick else 10_000, runs, report)
            await bench_listing(nc, [1000, 10_000] if quick else [10_000, 100_000], 3, report)
            await bench_append_paths(nc, [2, 10, 20, 50, 100], 3 if quick else runs)
            await bench_read_paths(
                nc, log, [10, 100, 1000] if quick else [10, 100, 1000, 10_000, 50_000], runs
            )
            print(json.dumps({"rows": report.rows}) if arguments.json else "", end="")
        finally:
            await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts, fewer runs")
    parser.add_argument("--runs", type=int, default=0, help="repeats per figure (median)")
    parser.add_argument("--batch", type=int, default=10, help="events per batched append")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    asyncio.run(main(parser.parse_args()))
