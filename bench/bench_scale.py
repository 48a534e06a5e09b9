"""Scale: many parked sessions in one daemon, the boot scan of many stored sessions, the resume of
one very long session, and worker loss to all sessions done.

**Parked sessions.** A ``Node`` (what ``apomesh serve`` runs: embedded nats-server, the daemon,
LMDB, two in-process workers, the ``apomesh-benchtools`` plugin), in a freshly started child
process as ``apomesh serve`` is one, first runs the standard workload of ``bench_workload.py`` (S
= 20 sessions x N = 50 steps, its ``apomesh_run``) unloaded, then takes ``--parked`` (10,000)
sessions created through the service the REST API uses, each a ``solo`` agent whose first call
is ``ask_human``: every one ends up ``paused``, its pause open, held by the daemon. The figures:
the process's resident set (after a garbage collection) before and after, per parked session;
the messages a second the daemon's NATS connection sends while they sit parked and nothing else
runs (what holding them costs); and the S = 20 workload with all of them parked against
unloaded twins (the same ``Node`` in other child processes, holding nothing). ``--daemons`` (2)
daemons hold parked sessions and as many twins hold none: two processes of the very same daemon
run at different speeds for their whole lives (two twins with nothing parked came out 0.92x and
1.11x of each other), so one of each would measure the two processes as much as the parked
sessions. Every daemon first runs the workload ``--reps`` (7) times on its own; then it runs on
all of them in turn, ``--reps`` rounds, the order alternating, and a round's ratio is the
geometric mean of the loaded daemons' rates over the twins': the machine moving between one run
and the next moves every figure of a round alike (measured before as one daemon's own runs
before it parked against its runs after, some 40 s later, one figure moved from 0.63x to 1.21x
between runs of the same code). The figure is the median of the rounds' ratios, printed with
the spread between processes of the same kind and the daemons' own runs before the parking.

**Boot scan.** ``--stored`` (10,000 and 100,000) stored sessions of 20 events each (the sessions
of ``bench_recovery.py``: half auto-resumable, three in ten with a logged side effect, two in ten
ended without their completed record) are published straight to the log stream, in the envelope
format the log writes, 2,000 messages at a time with their acknowledgements checked (no
message-id headers: the log reads an event's index from its envelope when the header is absent;
plain publishes were dropped by the server's stream ingest queue when it filled, which left the
seeding waiting forever for messages that never came). Then an in-process daemon starts on
that log with a worker that acknowledges every dispatch and runs nothing (``bench_recovery``'s
``SinkWorker``); the figure is the daemon's ``start``: list, read, fold and classify every session,
auto-resume the safe ones and strand the others. That daemon runs in a freshly started child
process (as ``apomesh serve`` is one), not a fork of this one, whose heap held every seeded session
until the fork (one run each at 100,000: 14.1 s forked, 12.8 s started afresh), SIGKILLed
as its start returns; the second figure is the same daemon's start again on its data dir: the
leases of its auto-resumed sessions still held by itself, the completed records of the ended
ones written, and those (ended in 2023) past the default retention, so its sweep purges them
before its boot scan. The third figure, printed first as it is a daemon's restart, is the first
start again, each on the store as seeded, with the fold checkpoints a daemon that drove the
sessions leaves (``seed_checkpoints``, through the daemon's own checkpoint code): each current at
its session's last message, but the last one in a hundred, which stand for the sessions that
appended in its last second: half of those a step behind, half (started in that second) with
none.

**Resume of a long session.** One session of ``--long-events`` (100,000) events (its bootstrap, a
running root agent and node snapshot pointers) is published the same way to a fresh log; a daemon
starts on it and the figure is start to the session's agent dispatched (acknowledged by the sink):
read, fold, classify, lease, ``SessionRecovered``/``AgentResuming``/``dispatched`` appended. It
starts three times on the same data dir: with no fold checkpoint (the whole log folded; the
session's writer stores one at its first append after the resume), then from the checkpoint that
daemon wrote, then from one ``--long-tail`` (9,999) events behind the log's end, the most a writer
at the default ``fold_checkpoint_every`` leaves, stored through the daemon's own checkpoint code.

**Worker loss.** A nats-server, an ``apomesh serve`` process and two ``apomesh worker`` processes
(``bench_recovery.py``'s setup) run ``--loss-sessions`` (6) long sessions whose agents take 0.05 s
a step; once all run, the worker running the first one's agent is SIGKILLed (a fresh worker
replaces it), and for each agent it ran the figures are, from the events' own timestamps, kill to
the agent re-dispatched to a live worker and kill to its first node done there (the session
running again), p50 and p99 over ``--rounds`` (5) kills, against the heartbeat threshold + one
beat at the default heartbeat (1 s beats, lost after 3 missed: 4 s). After each of those kills
the standard workload (S = 20 x N = 50, ``bench_workload.py``'s sessions and side effect) runs on
the two worker processes, and at half its effects the worker running the first session's agent
is SIGKILLed: the figure is the kill to every session ended, with the effects duplicated, never
run and the sessions lost.

**Takeover.** ``--takeover-sessions`` (10,000) stored auto-resumable sessions; daemon A (a child
process, lease TTL 3 s) adopts them all and is SIGKILLed once its peer B (in this process, the
same TTL) has started and watches them; the figures are kill to the first, half and every
session's agent dispatched again by B (acknowledged by B's sink worker): the TTL, up to one
takeover sweep, then the adoption and start.

Durability: LMDB synced on every commit, JetStream's default ``sync_interval``. Run ``python
bench/bench_scale.py`` (``--quick``: 1,000 parked, 10,000 stored only, a 20,000-event session, 2
kills, a takeover of 2,000). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_recovery import boot, sink_daemon
from bench_runtime import RssSampler, percentile, scratch
from bench_workload import (
    BENCHTOOLS,
    Recovery,
    _with_benchtools,
    apomesh_run,
    audit_lines,
    lines_in,
    make_config,
    workload_definition,
)
from tests.e2e.chaos_kit import shape_of, stored_session, thinker

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.log_messages import pack
from apomesh.adapters.memory_log import OutgoingEvent
from apomesh.adapters.nats_connect import connect, request_many
from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.core import envelope
from apomesh.core.state import fold
from apomesh.core.state_codec import FoldCheckpoint, decode_checkpoint, make_checkpoint, shape_key
from apomesh.core.views import TERMINAL_STATUSES
from apomesh.plugins.manager import BUILTIN_DISTRIBUTION, ENV_ALLOW
from apomesh.runtime.fold_checkpoints import CHECKPOINT_DB, CHECKPOINT_EVERY, FoldCheckpoints
from apomesh.runtime.node import Node
from apomesh.sdk.client import ApiError, Client
from apomesh.testing import Mesh, install_plugin_package

# --- parked sessions ------------------------------------------------------------------------------


def parked_definition() -> dict[str, Any]:
    """A solo agent that asks a human first: it parks on its open pause until answered."""
    return {
        "name": "bench-parked",
        "version": "1.0.0",
        "instructions": "Ask, then answer.",
        "coordination": "solo",
        "tools": ["ask_human"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"tool_calls": [{"tool": "ask_human", "args": {"question": "Go on?"}}]},
                {"final": "done"},
            ],
        },
    }


def rss() -> int:
    gc.collect()
    return RssSampler.current()


async def park(node: Node, count: int) -> tuple[list[str], float]:
    """Create ``count`` parked sessions, sixty at a time (each wave parked before the next is
    created: the two workers take 32 agents each at once, and sessions waiting for room would poll for
    it); answer their ids and the seconds it took."""
    assert node.service is not None and node.daemon is not None
    registry = node.daemon.registry
    definition = parked_definition()
    started = time.perf_counter()
    ids: list[str] = []
    batch = 60
    for first in range(0, count, batch):
        wave = await asyncio.gather(
            *(
                node.service.create_session(f"p{n}", agent=None, definition=definition, by="bench")
                for n in range(first, min(count, first + batch))
            )
        )
        ids += wave
        deadline = time.monotonic() + 120
        while not all(
            (runtime := registry.live.get(sid)) is not None and runtime.state.hitl_pending
            for sid in wave
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sessions of wave {first // batch} not parked within 120 s")
            await asyncio.sleep(0.02)
    return ids, time.perf_counter() - started


STEP_EVENTS = 2
"""Events per stored message: a step's two appends each carry two (intent and pointer, result
and pointer)."""
IDLE_SECONDS = 15.0


async def idle_messages(node: Node) -> float:
    """Messages a second the daemon's NATS connection sends while nothing runs (what holding the
    parked sessions costs: presence, leases, liveness), over ``IDLE_SECONDS``."""
    assert node.daemon is not None
    stats = node.daemon.nc.stats
    first = stats["out_msgs"]
    await asyncio.sleep(IDLE_SECONDS)
    return (stats["out_msgs"] - first) / IDLE_SECONDS


SESSIONS, STEPS = 20, 50
"""The S = 20 x N = 50 workload: run beside the parked sessions and on the unloaded twins, and
under a worker's SIGKILL."""


async def _daemon_for_runs(conn: Any, parked: int, reps: int) -> None:
    """A child process's daemon (a ``Node``): it runs the workload ``reps`` times, parks
    ``parked`` sessions (none for the unloaded twin), says what that took, then runs the workload
    each time it is asked. Parked daemons and twins go through the same runs and the same
    collections before the rounds: they differ in the parked sessions only."""
    with scratch("apomesh-scale-parked-") as base:
        config = _with_benchtools(make_config(base, workers=2, sync_always=False))
        async with Node(config, http=False) as node:
            for _, worker in node.workers:
                await worker.wait_registered()
            await apomesh_run(node, 2, 3)  # warm up
            figures: dict[str, Any] = {
                "own_unloaded": [
                    (await apomesh_run(node, SESSIONS, STEPS)).rate for _ in range(reps)
                ],
                "before": rss(),
            }
            ids: list[str] = []
            if parked:
                ids, figures["seconds"] = await park(node, parked)
            figures["after"] = rss()
            if parked:
                figures["idle_rate"] = await idle_messages(node)
            conn.send(figures)
            while await asyncio.to_thread(conn.recv) == "run":
                conn.send((await apomesh_run(node, SESSIONS, STEPS)).rate)
            live = node.daemon.registry.live  # type: ignore[union-attr]
            conn.send(sum(1 for sid in ids if sid in live))


def _daemon_child(conn: Any, parked: int, reps: int) -> None:
    asyncio.run(_daemon_for_runs(conn, parked, reps))


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def measure_parked(parked: int, reps: int, daemons: int) -> None:
    """``daemons`` daemons holding ``parked`` sessions each and as many unloaded twins holding
    none, each in a freshly started child process as ``apomesh serve`` is one. Two processes
    of the very same daemon run at different speeds, each its own way for its whole life (its
    memory layout, its hash seed: two twins with nothing parked came out 0.92x and 1.11x of
    each other in seven pairs), so one daemon of each kind would measure the two processes as
    much as the parked sessions; several of each average that out. The workload runs on all of
    them in turn, ``reps`` rounds, the order alternating, so a machine that speeds up or slows
    down meanwhile moves every figure of a round alike. A round's ratio is the geometric mean
    of the loaded daemons' rates over the twins'; the figure is the median of the rounds'
    ratios. The spread between processes of the same kind is printed beside it, and the
    daemons' own runs before the parking."""
    spawn = multiprocessing.get_context("spawn")
    loaded: list[Any] = []
    twins: list[Any] = []
    procs: list[Any] = []
    figures: list[dict[str, Any]] = []
    for count, ends in [(parked, loaded)] * daemons + [(0, twins)] * daemons:
        end, child = spawn.Pipe()
        proc = spawn.Process(target=_daemon_child, args=(child, count, reps))
        proc.start()
        procs.append(proc)
        ends.append(end)
        figures.append(end.recv())
    rates: dict[Any, list[float]] = {end: [] for end in loaded + twins}
    for rep in range(reps):
        order = twins + loaded if rep % 2 == 0 else loaded + twins
        for end in order:
            end.send("run")
            rates[end].append(end.recv())
    for end in loaded + twins:
        end.send("stop")
    still = [end.recv() for end in loaded]
    for end in twins:
        end.recv()
    for proc in procs:
        proc.join()
    held = figures[:daemons]
    for n, figs in enumerate(held):
        before, after, seconds = figs["before"], figs["after"], figs["seconds"]
        print(
            f"  daemon {n + 1}: {parked:,} sessions parked on a HITL pause in {seconds:.1f} s "
            f"({parked / seconds:,.0f}/s), {still[n]:,} still held after the runs; process RSS "
            f"{before / 2**20:,.0f} MiB before, {after / 2**20:,.0f} MiB after: "
            f"**{(after - before) / parked / 1024:,.1f} KiB per parked session**"
        )
    print(
        f"    the first one's NATS connection, {IDLE_SECONDS:.0f} s with all of them parked and "
        f"nothing else running: {held[0]['idle_rate']:,.1f} messages sent a second"
    )
    ratios = [
        _geomean([rates[end][rep] for end in loaded]) / _geomean([rates[end][rep] for end in twins])
        for rep in range(reps)
    ]
    loaded_rate = statistics.median(r for end in loaded for r in rates[end])
    twin_rate = statistics.median(r for end in twins for r in rates[end])
    print(
        f"    S={SESSIONS} x N={STEPS} beside the parked sessions against the unloaded twins, "
        f"{daemons} + {daemons} daemons, {reps} rounds: {loaded_rate:,.0f} against "
        f"{twin_rate:,.0f} steps/s, ratios {', '.join(f'{r:.2f}' for r in ratios)}: "
        f"**{statistics.median(ratios):.2f}x** (aim >= 0.80x)"
    )

    def spread(ends: list[Any]) -> str:
        medians = [statistics.median(rates[end]) for end in ends]
        return f"{max(medians) / min(medians):.2f}x" if len(medians) > 1 else "-"

    print(
        "    between processes of the same kind (the fastest's median over the slowest's): "
        f"parked {spread(loaded)}, twins {spread(twins)}"
    )
    own = statistics.median(r for figs in held for r in figs["own_unloaded"])
    twin_own = statistics.median(r for figs in figures[daemons:] for r in figs["own_unloaded"])
    print(
        f"    their own runs before the parking: {own:,.0f} steps/s (the twins' {twin_own:,.0f}); "
        f"beside the parked sessions {loaded_rate / own:.2f}x of that"
    )


# --- stored sessions, published straight to the log ----------------------------------------------


SEED_WINDOW = 2_000
"""Messages a seeding publishes before it waits for their acknowledgements: fewer than the
server's stream ingest queue holds (it drops plain publishes beyond it)."""


async def publish_stored(
    url: str,
    sessions: list[list[envelope.Envelope]],
    seqs: dict[str, list[int]] | None = None,
) -> tuple[int, float]:
    """Publish the sessions' envelopes to the log stream in the messages the log writes:
    ``STEP_EVENTS`` consecutive events to a message, as a step's appends are
    (``adapters.log_messages``), ``SEED_WINDOW`` at a time, each window's acknowledgements
    awaited together (``request_many``) and checked: a message the server did not store stops
    the bench with the server's reason instead of leaving a session short. Answer
    (events, seconds); ``seqs`` is given each session's messages' stream sequences."""
    nc = await connect([url])
    log = JetStreamLog(nc)
    await log.ensure()
    started = time.perf_counter()
    total = 0
    window: list[tuple[str, bytes, dict[str, str] | None]] = []

    async def send() -> None:
        answers = await request_many(nc, window, timeout=60)
        for (subject, _, _), answer in zip(window, answers, strict=True):
            reply = json.loads(answer.data) if answer is not None else {"error": "no answer"}
            if "error" in reply:
                raise RuntimeError(f"seeding {subject}: not stored: {reply['error']}")
            if seqs is not None:
                seqs.setdefault(subject.rsplit(".", 1)[1], []).append(int(reply["seq"]))
        window.clear()

    for envelopes in sessions:
        session_id = envelopes[0].session_id
        subject = log.subject(session_id)
        outgoing = [OutgoingEvent(e.index, envelope.encode(e), e.event_id) for e in envelopes]
        for first in range(0, len(outgoing), STEP_EVENTS):
            (run,) = pack(session_id, outgoing[first : first + STEP_EVENTS], 1 << 20)
            window.append((subject, run.payload, None))
            if len(window) >= SEED_WINDOW:
                await send()
        total += len(envelopes)
    if window:
        await send()
    seconds = time.perf_counter() - started
    await nc.close()
    return total, seconds


def mixed_sessions(count: int, rng: random.Random) -> tuple[list[list[Any]], dict[str, int]]:
    """``count`` stored sessions of 20 events, mixed as in ``bench_recovery.seed``."""
    shape = shape_of(thinker(2))
    kinds = {"auto": 0, "side_effects": 0, "terminal": 0}
    out = []
    for n in range(count):
        draw = rng.random()
        session_id = uuid.uuid4().hex
        if draw < 0.5:
            kinds["auto"] += 1
            out.append(stored_session(session_id, shape, goal=f"s{n}"))
        elif draw < 0.8:
            kinds["side_effects"] += 1
            effect = ("fs.append", {"path": f"f{n}.txt", "line": "x"}, False)
            out.append(stored_session(session_id, shape, goal=f"s{n}", side_effect=effect))
        else:
            kinds["terminal"] += 1
            out.append(stored_session(session_id, shape, goal=f"s{n}", terminal=True))
    return out, kinds


async def seed_checkpoints(
    url: str,
    data: Path,
    sessions: list[list[envelope.Envelope]],
    seqs: dict[str, list[int]],
    recent: int,
) -> None:
    """Store in the daemon data dir ``data`` the fold checkpoints a daemon that drove the stored
    sessions leaves at the default ``fold_checkpoint_interval``, through the daemon's own
    checkpoint code: each at the session's last message, counting its messages on this stream.
    The last ``recent`` sessions seeded stand for those that appended in the daemon's last
    second: the first half of them with a checkpoint one step (two messages) short of their
    end, the rest (started in that second) with none yet."""
    nc = await connect([url])
    log = JetStreamLog(nc)
    await log.ensure()
    await nc.close()
    store = AsyncStore(LmdbStore(data / "lmdb"))
    checkpoints = FoldCheckpoints(store)
    keys: dict[int, str] = {}
    made = []
    for n, envelopes in enumerate(sessions):
        stored_at = seqs[envelopes[0].session_id]
        if n >= len(sessions) - recent // 2:
            continue
        messages = len(stored_at) - (2 if n >= len(sessions) - recent else 0)
        at = min(messages * STEP_EVENTS, len(envelopes)) - 1
        state = fold(envelopes[: at + 1])
        assert state.bootstrap is not None
        shape = state.bootstrap.shape
        key = keys.setdefault(id(shape), shape_key(shape))
        checkpoint = make_checkpoint(
            state,
            envelopes[at].event_id,
            stored_at[messages - 1],
            messages=messages,
            log_id=log.log_id,
            shape=key,
        )
        made.append((checkpoint, shape))
        if len(made) >= 5_000:
            await checkpoints.write_many(made)
            made.clear()
    await checkpoints.write_many(made)
    await store.aclose()


def _start_then_die(url: str, data: Path, figures: Path) -> None:
    """A child process: a daemon's start on the stored sessions, its figures written, SIGKILL."""
    asyncio.run(boot(url, data, 0, wait=0, die=figures))


def _first_start(url: str, data: Path, figures: Path) -> dict[str, Any]:
    """A daemon's first start on the stored sessions, in a freshly started child process."""
    child = multiprocessing.get_context("spawn").Process(
        target=_start_then_die, args=(url, data, figures)
    )
    child.start()
    child.join(900)
    result: dict[str, Any] = json.loads(figures.read_text())
    return result


def measure_scan(count: int, rng: random.Random, starts: int) -> None:
    """The boot scan of ``count`` stored sessions, by a daemon killed as its start returns (in a
    child process), ``starts`` times, each on the stored sessions as seeded (the server's store
    put back from a copy, the daemon's data dir new): the figure is their median, a slow spell
    of the machine or a slow process moving one start, not the figure. Then the start of the
    last daemon again on its data dir: its auto-resumed sessions' leases held by itself, its
    ended sessions' completed records written, and those (ended in 2023) past the default
    retention, so its sweep purges them before its scan.

    Then ``starts`` starts more on the same stored sessions with the fold checkpoints a daemon
    that drove them leaves (``seed_checkpoints``: one in two hundred a step behind, and as many
    with none yet), each on a copy of that data dir."""
    recent = max(2, count // 100)
    with scratch("apomesh-scale-scan-") as base:
        server = NatsServer(single_node(base / "nats", name="nats"))
        server.start()
        try:
            sessions, kinds = mixed_sessions(count, rng)
            seqs: dict[str, list[int]] = {}
            events, seeded = asyncio.run(publish_stored(server.url, sessions, seqs))
            asyncio.run(seed_checkpoints(server.url, base / "checkpointed", sessions, seqs, recent))
            del sessions, seqs
            server.stop()
            shutil.copytree(base / "nats", base / "seeded")
            server.start()

            def fresh(daemon: Path | None) -> None:
                server.stop()
                shutil.rmtree(base / "nats")
                shutil.rmtree(base / "daemon", ignore_errors=True)
                shutil.copytree(base / "seeded", base / "nats")
                if daemon is not None:
                    shutil.copytree(daemon, base / "daemon")
                server.start()

            results = []
            for start in range(starts):
                if start:
                    fresh(None)
                results.append(_first_start(server.url, base / "daemon", base / "first.json"))
            again = asyncio.run(boot(server.url, base / "daemon", 0, wait=600))
            current = []
            for _ in range(starts):
                fresh(base / "checkpointed")
                current.append(_first_start(server.url, base / "daemon", base / "first.json"))
        finally:
            server.stop()
    result = sorted(results, key=lambda r: float(r["scan"]))[len(results) // 2]
    report = result["report"]
    checked = sorted(current, key=lambda r: float(r["scan"]))[len(current) // 2]
    third = checked["report"]
    print(
        f"  {count:>7,} stored sessions ({events:,} events published in {seeded:.1f} s), a"
        f" daemon's restart on the fold checkpoints it leaves ({recent - recent // 2:,} a step"
        f" behind, {recent // 2:,} with none yet): boot scan **{checked['scan']:.2f} s** ("
        + _starts(current, starts)
        + f"; {count / checked['scan']:,.0f} sessions/s; {third.get('current_checkpoints')}"
        f" current, {third.get('from_checkpoints', 0) - third.get('current_checkpoints', 0)}"
        f" folded on from theirs, {third.get('events_folded')} events folded; auto"
        f" {third.get('auto_resume')} of {kinds['auto']}, recoverable"
        f" {third.get('recoverable')} of {kinds['side_effects']}, terminal"
        f" {third.get('terminal')} of {kinds['terminal']})",
        flush=True,
    )
    print(
        "    with no fold checkpoint (the whole log folded: a lost state store, a log restored"
        f" into a new stream, the first start after an upgrade): **{result['scan']:.2f} s** ("
        + _starts(results, starts)
        + f"; auto {report.get('auto_resume')}, recoverable {report.get('recoverable')},"
        f" terminal {report.get('terminal')})",
        flush=True,
    )
    second = again["report"]
    print(
        f"    that daemon SIGKILLed and started again on its data dir: **{again['scan']:.2f} s** "
        f"(its retention sweep purged {second.get('purged')} ended sessions, then its boot scan "
        f"took {second.get('seconds')} s: auto {second.get('auto_resume')} with their leases its"
        f" own, recoverable {second.get('recoverable')})",
        flush=True,
    )


def _starts(runs: list[dict[str, Any]], starts: int) -> str:
    """The starts' seconds, as the median's parenthesis says them."""
    if starts == 1:
        return "one start"
    return f"median of {starts}: " + ", ".join(f"{r['scan']:.2f}" for r in runs) + " s"


TAKEOVER_TTL = 3.0
"""The lease TTL of the takeover's two daemons (``[daemon] lease_ttl``; 30 s by default): the
takeover waits for it to run out, so a short one leaves the adoption's own time to see."""


def _adopt_then_die(url: str, data: Path, adopted: Path) -> None:
    """A child process: daemon A adopts the stored sessions, its presence record lists them, it
    writes how many it drives to ``adopted`` and is SIGKILLed once its peer has started (a file
    ``adopted`` with the suffix ``.peer``)."""

    async def run() -> None:
        async with sink_daemon(url, data, lease_ttl=TAKEOVER_TTL) as (daemon, _):
            await daemon.start()
            await asyncio.sleep(2 * TAKEOVER_TTL)  # renewed twice since: its record lists them
            adopted.write_text(str(len(daemon.registry.live)))
            while not adopted.with_suffix(".peer").exists():
                await asyncio.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(run())


async def _take_over(
    url: str, data: Path, adopted: Path, child: Any, count: int
) -> dict[str, float]:
    """Daemon B: started while A drives every session (so its boot scan leaves them to A), then
    A is killed; answers seconds from the kill to the first and to every session's agent
    dispatched again by B (acknowledged by B's sink worker): each running again. Only the
    dispatches after the kill count: A, still starting its sessions when B's worker registers
    (a slow run), sends some of them to B's worker too."""
    deadline = time.monotonic() + 900
    while not adopted.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    async with sink_daemon(url, data, lease_ttl=TAKEOVER_TTL) as (daemon, sink):
        await daemon.start()
        watched = daemon.boot_report.get("owned_by_peers", 0)
        adopted.with_suffix(".peer").write_text("")
        while child.is_alive():
            await asyncio.sleep(0.005)
        killed = time.perf_counter()
        from_a = sink.dispatches
        first = half = math.nan
        while sink.dispatches - from_a < count and time.perf_counter() - killed < 600:
            await asyncio.sleep(0.01)
            if sink.dispatches > from_a and math.isnan(first):
                first = time.perf_counter() - killed
            if sink.dispatches - from_a >= count / 2 and math.isnan(half):
                half = time.perf_counter() - killed
        return {
            "first": first,
            "half": half,
            "all": time.perf_counter() - killed,
            "taken": sink.dispatches - from_a,
            "from_a": from_a,
            "by_a": int(adopted.read_text()),
            "watched": watched,
        }


def measure_takeover(count: int) -> None:
    """``count`` stored auto-resumable sessions driven by daemon A (a child process) and watched
    by its peer B; A SIGKILLed; kill to B driving all of them, against the lease TTL."""
    with scratch("apomesh-scale-takeover-") as base:
        server = NatsServer(single_node(base / "nats", name="nats"))
        server.start()
        try:
            shape = shape_of(thinker(2))
            sessions = [stored_session(uuid.uuid4().hex, shape, goal=f"s{n}") for n in range(count)]
            asyncio.run(publish_stored(server.url, sessions))
            del sessions
            adopted = base / "adopted"
            child = multiprocessing.get_context("fork").Process(
                target=_adopt_then_die, args=(server.url, base / "a", adopted)
            )
            child.start()
            figures = asyncio.run(_take_over(server.url, base / "b", adopted, child, count))
            child.join(10)
        finally:
            server.stop()
    print(
        f"  {count:,} sessions driven by daemon A ({figures['by_a']:,.0f}; its peer B watching "
        f"{figures['watched']:,.0f}; {figures['from_a']:,.0f} of A's dispatches on B's worker "
        f"before the kill), A SIGKILLed: B dispatches the first session's agent again "
        f"{figures['first']:.2f} s after the kill, half of them at {figures['half']:.2f} s and "
        f"all {figures['taken']:,.0f} at **{figures['all']:.2f} s** (lease TTL {TAKEOVER_TTL:g} s:"
        f" the TTL, then up to one takeover sweep, then the adoption)",
        flush=True,
    )


async def stored_checkpoint(data: Path, session_id: str) -> FoldCheckpoint | None:
    """The fold checkpoint of the session in the daemon data dir ``data`` (read as it stores it)."""
    async with AsyncStore(LmdbStore(data / "lmdb")) as store:
        raw = await store.get(CHECKPOINT_DB, session_id)
    return None if raw is None else decode_checkpoint(raw)


async def checkpoint_behind(url: str, data: Path, session_id: str, tail: int) -> int:
    """Store the checkpoint the session's writer would have stored ``tail`` events before the
    log's end (as if it had run that far since its last one), through the daemon's own checkpoint
    code: the state folded up to there, that envelope's id and stream sequence. Answers its index."""
    nc = await connect([url])
    try:
        log = JetStreamLog(nc)
        envelopes = await log.read(session_id)
        # The session is alone on a fresh stream, published ``STEP_EVENTS`` events a message:
        # a writer's checkpoint covers the last event of an append, so ``at`` is the last of its
        # message, whose sequence counts messages from 1.
        at = len(envelopes) - 1 - tail
        at -= (at + 1) % STEP_EVENTS
        seq = at // STEP_EVENTS + 1
        assert (await log.read_from_sequence(session_id, at, seq))[0].index == at
    finally:
        await nc.close()
    checkpoint = make_checkpoint(fold(envelopes[: at + 1]), envelopes[at].event_id, seq)
    async with AsyncStore(LmdbStore(data / "lmdb")) as store:
        await FoldCheckpoints(store).write(checkpoint)
    return at


def measure_long(events: int, tail: int) -> None:
    session_id = uuid.uuid4().hex
    envelopes = stored_session(session_id, shape_of(thinker(2)), goal="long", events=events)
    with scratch("apomesh-scale-long-") as base:
        server = NatsServer(single_node(base / "nats", name="nats"))
        server.start()
        try:
            _, seeded = asyncio.run(publish_stored(server.url, [envelopes]))

            async def read_and_fold() -> tuple[float, float]:
                nc = await connect([server.url])
                try:
                    log = JetStreamLog(nc)
                    started = time.perf_counter()
                    got = await log.read(session_id)
                    read = time.perf_counter() - started
                    fold(got, session_id)
                    return read, time.perf_counter() - started - read
                finally:
                    await nc.close()

            read, folded = asyncio.run(read_and_fold())
            data = base / "daemon"
            # 1. No checkpoint yet: the whole log is folded. The daemon's writer stores one as
            #    soon as the session is resumed (its first append), which the next start uses.
            whole = asyncio.run(boot(server.url, data, 1, wait=600))
            written = asyncio.run(stored_checkpoint(data, session_id))
            # 2. The checkpoint the daemon itself wrote at the resume.
            own = asyncio.run(boot(server.url, data, 1, wait=600))
            # 3. One ``tail`` events behind the end (a session that ran that far since its last).
            at = asyncio.run(checkpoint_behind(server.url, data, session_id, tail))
            behind = asyncio.run(boot(server.url, data, 1, wait=600))
        finally:
            server.stop()
    print(
        f"  one session of {events:,} events (published in {seeded:.1f} s): read "
        f"{read:.3f} s + fold {folded:.3f} s; daemon start to the session dispatched:"
    )
    print(
        f"    no checkpoint (the whole log folded)      **{whole['dispatched']:.3f} s** "
        f"(boot scan {whole['scan']:.3f} s, {whole['report'].get('events_folded'):,} events folded)"
    )
    index = f"index {written.index:,}" if written is not None else "none stored"
    print(
        f"    the checkpoint the daemon wrote ({index})  **{own['dispatched']:.3f} s** "
        f"(boot scan {own['scan']:.3f} s, {own['report'].get('events_folded'):,} events folded, "
        f"{own['report'].get('from_checkpoints')} from a checkpoint)"
    )
    print(
        f"    a checkpoint {tail:,} events behind (index {at:,})  **{behind['dispatched']:.3f} s** "
        f"(boot scan {behind['scan']:.3f} s, {behind['report'].get('events_folded'):,} events "
        f"folded, {behind['report'].get('from_checkpoints')} from a checkpoint)"
    )


# --- worker loss ------------------------------------------------------------------------------


async def loss_round(mesh: Mesh, client: Client, sessions: int) -> list[tuple[float, float]]:
    """Start ``sessions`` long sessions, SIGKILL the worker running the first one's agent once
    every session runs, and answer (to re-dispatched, to the first node done after it) in seconds
    for every agent it ran."""
    definition = thinker(steps=400, delay=0.05)
    ids = [await client.start_session(f"loss-{n}", definition=definition) for n in range(sessions)]
    worker_of: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while len(worker_of) < sessions and time.monotonic() < deadline:
        for session_id in ids:
            view = await client.get_session(session_id)
            root = next((a for a in view.agents if a.ref == "root"), None)
            if root is not None and root.phase == "running" and root.worker:
                worker_of[session_id] = root.worker
        await asyncio.sleep(0.05)
    victim = next(iter(worker_of.values()))
    process = next(w for w in mesh.workers if w.name == victim.rsplit("-", 1)[0])
    killed_at = time.time()
    os.kill(process.pid, signal.SIGKILL)
    process.proc.wait(10)
    mesh.worker(f"w{len(mesh.workers)}")
    samples = []
    for session_id, worker in worker_of.items():
        if worker != victim:
            continue
        dispatched = stepped = None
        async for record in client.events(session_id):
            if record.ts < killed_at:
                continue
            phase = record.event.get("phase") if record.kind == "AgentLifecycle" else None
            if phase == "dispatched" and dispatched is None:
                dispatched = record.ts - killed_at
            elif dispatched is not None and record.kind == "AgentSnapshotted":
                stepped = record.ts - killed_at
                break
        if dispatched is not None and stepped is not None:
            samples.append((dispatched, stepped))
    for session_id in ids:
        with contextlib.suppress(ApiError):  # one that ended meanwhile is fine
            await client.cancel(session_id)
    return samples


async def workload_loss_round(mesh: Mesh, client: Client, n: int) -> Recovery:
    """The standard workload (S = 20 x N = 50) on the worker processes; at half its effects the
    worker running the first session's agent is SIGKILLed (a fresh one replaces it). Answers
    seconds from the kill to every session ended, and effects duplicated, never run, sessions
    lost."""
    folder = mesh.daemon.workspace / "bench"
    earlier = lines_in(folder)  # the lines of the rounds before this one
    definition = workload_definition(STEPS)
    ids = [await client.start_session(f"wl{n}-{k}", definition=definition) for k in range(SESSIONS)]
    victim = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if victim is None:
            agents = (await client.get_session(ids[0])).agents
            root = next((a for a in agents if a.ref == "root"), None)
            victim = root.worker if root is not None and root.phase == "running" else None
        if victim and lines_in(folder) - earlier >= SESSIONS * STEPS // 2:
            break
        await asyncio.sleep(0.005)
    assert victim, "the first session's agent never ran"
    process = next(w for w in mesh.workers if w.name == victim.rsplit("-", 1)[0])
    os.kill(process.pid, signal.SIGKILL)
    killed = time.perf_counter()
    process.proc.wait(10)
    mesh.worker(f"w{len(mesh.workers)}")
    while time.perf_counter() - killed < 120:
        rows = {row.session_id: row.status for row in await client.list_sessions()}
        if all(rows.get(sid) in TERMINAL_STATUSES for sid in ids):
            break
        await asyncio.sleep(0.02)
    seconds = time.perf_counter() - killed
    completed = {sid for sid in ids if rows.get(sid) == "completed"}
    audit = audit_lines(folder, ids, STEPS, completed)
    return Recovery(seconds, audit.duplicates, audit.never_run, audit.lost)


def measure_loss(rounds: int, sessions: int) -> None:
    interval = 1.0  # the default heartbeat: a beat a second, lost after 3 missed
    with scratch("apomesh-scale-loss-") as base:
        server = NatsServer(single_node(base, name="nats"))
        server.start()
        mesh = Mesh(server, base, env={ENV_ALLOW: f"{BUILTIN_DISTRIBUTION},apomesh-benchtools"})
        # The test mesh beats every 0.3 s; these figures are for the default heartbeat.
        mesh.daemon.env["APOMESH_LIVENESS_HEARTBEAT_INTERVAL"] = str(interval)
        mesh.daemon.env["APOMESH_LIVENESS_MISSED_BEATS"] = "3"
        try:
            mesh.daemon.start()
            mesh.worker()
            mesh.worker()
            mesh.wait_workers(2)

            async def run() -> tuple[list[tuple[float, float]], list[Recovery]]:
                samples: list[tuple[float, float]] = []
                ended: list[Recovery] = []
                async with Client(mesh.url) as client:
                    for n in range(rounds):
                        samples += await loss_round(mesh, client, sessions)
                        await asyncio.to_thread(mesh.wait_workers, 2)
                        ended.append(await workload_loss_round(mesh, client, n))
                        await asyncio.to_thread(mesh.wait_workers, 2)
                return samples, ended

            samples, ended = asyncio.run(run())
        finally:
            mesh.close()
            server.stop()
    bound = 3 * interval + interval
    dispatched = [s[0] for s in samples]
    stepped = [s[1] for s in samples]
    print(f"  {len(samples)} agents over {rounds} kills; threshold 3 s + one beat = {bound:g} s")
    for name, values in (("re-dispatched", dispatched), ("first node done after", stepped)):
        print(
            f"    SIGKILL -> {name:<22} p50 {statistics.median(values):.3f} s   "
            f"p99 **{percentile(values, 0.99):.3f} s**   ({percentile(values, 0.99) - bound:+.3f} s "
            "against the bound)"
        )
    done = [e.seconds for e in ended]
    print(
        f"  the standard workload (S = {SESSIONS} x N = {STEPS}) on the worker processes, a worker"
        f" SIGKILLed at half its effects, {len(ended)} kills:"
    )
    print(
        f"    SIGKILL -> every session ended    p50 {statistics.median(done):.3f} s   "
        f"p99 **{percentile(done, 0.99):.3f} s**   ({percentile(done, 0.99) - bound:+.3f} s "
        f"against the bound); duplicated {sum(e.duplicates for e in ended)}, never run "
        f"{sum(e.never_run for e in ended)}, sessions lost {sum(e.lost for e in ended)}"
    )


# --- the run --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--parked", type=int, default=10_000)
    parser.add_argument(
        "--reps", type=int, default=7, help="rounds of S = 20 runs on the parked daemons and twins"
    )
    parser.add_argument(
        "--daemons", type=int, default=2, help="daemons holding parked sessions, and as many twins"
    )
    parser.add_argument("--stored", default="10000,100000", help="stored session counts")
    parser.add_argument(
        "--scan-starts", type=int, default=3, help="first starts on each store (the median)"
    )
    parser.add_argument("--long-events", type=int, default=100_000)
    parser.add_argument(
        "--long-tail",
        type=int,
        default=CHECKPOINT_EVERY - 1,
        help="events after the checkpoint in the last long-session start (default: the most a"
        " writer at the default threshold leaves)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="worker kills")
    parser.add_argument("--loss-sessions", type=int, default=6)
    parser.add_argument("--takeover-sessions", type=int, default=10_000)
    parser.add_argument(
        "--only",
        default="parked,scan,long,loss,takeover",
        help="parts to run, comma-separated",
    )
    args = parser.parse_args()
    if args.quick:
        args.parked, args.reps, args.stored, args.long_events, args.rounds = (
            1_000,
            1,
            "10000",
            20_000,
            2,
        )
        args.takeover_sessions, args.daemons, args.scan_starts = 2_000, 1, 1
    parts = set(args.only.split(","))
    print(f"scale: load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    if "scan" in parts:
        print("boot scan of stored sessions (20 events each)", flush=True)
        rng = random.Random(7)
        for count in (int(c) for c in args.stored.split(",") if c):
            measure_scan(count, rng, args.scan_starts)
    if "long" in parts:
        print("resume of one long session", flush=True)
        measure_long(args.long_events, min(args.long_tail, args.long_events - 1))
    if "parked" in parts:
        install_plugin_package(BENCHTOOLS)
        print("parked sessions (daemons holding them and unloaded twins)", flush=True)
        measure_parked(args.parked, args.reps, args.daemons)
    if "takeover" in parts:
        print("takeover of a killed daemon's sessions by its running peer", flush=True)
        measure_takeover(args.takeover_sessions)
    if "loss" in parts:
        install_plugin_package(BENCHTOOLS)
        print("worker loss (real processes, SIGKILL, default heartbeat)", flush=True)
        measure_loss(args.rounds, args.loss_sessions)
    print(f"scale: load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
