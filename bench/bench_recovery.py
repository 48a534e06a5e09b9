"""Recovery timings: how long a lost worker's agents wait to be re-dispatched, and how long a
restarted daemon takes to take its sessions up again.

**Worker loss to re-dispatch.** A real system (a nats-server, an ``apomesh serve`` process, two
``apomesh worker`` processes) runs several long sessions at once. The worker running some of
their agents is SIGKILLed; for each agent it ran, the figure is the time from the SIGKILL to the
``AgentResuming`` event (the daemon declared the worker lost and took the agent's snapshot) and
to the agent's next ``dispatched`` event (sent to a live worker), from the events' own
timestamps. A fresh worker replaces the killed one and the round repeats. Measured at the default
heartbeat (every 1 s, lost after 3 missed beats: a 3 s threshold) and at 200 ms beats (0.6 s).
The aim is a re-dispatch within one beat interval of the threshold: the liveness check runs every
quarter interval (at most every 250 ms), so a loss is seen between the threshold and a little
over it, plus the time since the last beat the worker sent before it died.

**Boot recovery.** ``--sessions`` (default 1,000 and 10,000) stored sessions of 20 events each are
written straight to the log (``JetStreamLog.append``, many sessions in flight at once), as a
daemon that died would have left them: half without side effects (auto-resumable), three in ten
with one logged side effect (for the recoverable list) and two in ten ended without their
completed-session record. Then an in-process daemon starts on that log, with one registered
worker that acknowledges every dispatch and runs nothing. The figures: the boot scan (list,
read, fold and classify every session: the daemon's ``start``) and the time from start until every
auto-resumable session has been re-dispatched (``SessionRecovered``, ``AgentResuming`` and
``dispatched`` appended, the dispatch acknowledged). The aim: 10,000 sessions under 10 s.

Run ``python bench/bench_recovery.py`` (``--quick`` for a short run; ``--rounds N``,
``--sessions 1000,10000``, ``--skip-loss``, ``--skip-boot``). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.chaos_kit import shape_of, stored_session, thinker

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.kv import KvBuckets
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.nats_connect import connect
from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.config import load_config
from apomesh.runtime.daemon import Daemon
from apomesh.runtime.protocol import (
    DISPATCH_DECODER,
    ENCODER,
    REGISTER_REPLY_DECODER,
    VERB_REGISTER,
    Beat,
    DispatchAck,
    Register,
    Reregister,
    Run,
    beat_subject,
    control_subject,
    dispatch_subject,
    worker_inbox_prefix,
)
from apomesh.sdk.client import ApiError, Client
from apomesh.testing import Mesh


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- worker loss to re-dispatch ----------------------------------------------------------------


async def loss_round(mesh: Mesh, client: Client, sessions: int) -> list[tuple[float, float]]:
    """Start ``sessions`` long sessions, kill the worker running the first one's agent once every
    session runs, and answer (to AgentResuming, to dispatched) in seconds for each agent it ran."""
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
        resuming = dispatched = None
        async for record in client.events(session_id):
            if record.ts < killed_at:
                continue
            if record.kind == "AgentResuming" and resuming is None:
                resuming = record.ts - killed_at
            phase = record.event.get("phase") if record.kind == "AgentLifecycle" else None
            if resuming is not None and phase == "dispatched":
                dispatched = record.ts - killed_at
                break
        if resuming is not None and dispatched is not None:
            samples.append((resuming, dispatched))
    for session_id in ids:
        with contextlib.suppress(ApiError):  # one that ended meanwhile is fine
            await client.cancel(session_id)
    return samples


def measure_loss(interval: float, rounds: int, sessions: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="apomesh-bench-loss-"))
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    mesh = Mesh(server, base)
    mesh.daemon.env["APOMESH_LIVENESS_HEARTBEAT_INTERVAL"] = str(interval)
    mesh.daemon.env["APOMESH_LIVENESS_MISSED_BEATS"] = "3"
    try:
        mesh.daemon.start()
        mesh.worker()
        mesh.worker()
        mesh.wait_workers(2)

        async def run() -> list[tuple[float, float]]:
            samples: list[tuple[float, float]] = []
            async with Client(mesh.url) as client:
                for _ in range(rounds):
                    samples += await loss_round(mesh, client, sessions)
                    await asyncio.to_thread(mesh.wait_workers, 2)
            return samples

        samples = asyncio.run(run())
    finally:
        mesh.close()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    threshold = 3 * interval
    to_resuming = [s[0] for s in samples]
    to_dispatch = [s[1] for s in samples]
    print(
        f"  beats every {interval:g} s, lost after 3 missed ({threshold:g} s): "
        f"{len(samples)} agents over {rounds} kills"
    )
    print(
        f"    SIGKILL -> AgentResuming   p50 {statistics.median(to_resuming):.3f} s   "
        f"p99 {percentile(to_resuming, 0.99):.3f} s   (threshold {percentile(to_resuming, 0.99) - threshold:+.3f} s at p99)"
    )
    print(
        f"    SIGKILL -> re-dispatched   p50 {statistics.median(to_dispatch):.3f} s   "
        f"p99 {percentile(to_dispatch, 0.99):.3f} s   (one beat interval over the threshold: {threshold + interval:g} s)"
    )


# --- boot recovery -----------------------------------------------------------------------------


SINK_ROOM = 1_000_000
"""The sink takes every dispatch: the figure is the daemon's, not a worker's capacity."""


class SinkWorker:
    """A registered worker that beats and acknowledges every dispatch, running nothing: the boot
    figure is then the daemon's alone."""

    def __init__(self, nc: Any, tools: list[str]) -> None:
        self.nc = nc
        self.worker_id = f"sink-{uuid.uuid4().hex[:8]}"
        self.tools = tools
        self.dispatches = 0
        self._beat_task: asyncio.Task[None] | None = None
        self._daemons: dict[str, str] = {}
        self.registered = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.running: dict[str, int] = {}
        self.seq = 0

    async def start(self) -> None:
        async def on_dispatch(msg: Any) -> None:
            message = DISPATCH_DECODER.decode(msg.data)
            if isinstance(message, Reregister):
                # A daemon that hears our beats asks us to register with it.
                task = asyncio.create_task(self.register(message.daemon))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
            if isinstance(message, Run):
                # Taken and held, never run: its beats list it, so the daemon waits on it.
                self.dispatches += 1
                self.running[f"{message.session_id}/{message.agent}"] = message.epoch
            await msg.respond(ENCODER.encode(DispatchAck(True, beat_seq=self.seq)))

        await self.nc.subscribe(dispatch_subject(self.worker_id), cb=on_dispatch)
        self._beat_task = asyncio.create_task(self._beat())

    async def register(self, daemon_id: str) -> None:
        request = Register(self.worker_id, "sink", self.tools, ["scripted"], max_agents=SINK_ROOM)
        # The daemon answers only on the worker's own inbox; the sink shares the daemon's
        # connection, so it names that inbox itself.
        inbox = f"{worker_inbox_prefix(self.worker_id)}.register"
        replies = await self.nc.subscribe(inbox)
        subject = control_subject(daemon_id, VERB_REGISTER, self.worker_id)
        while True:
            try:
                await self.nc.publish(subject, ENCODER.encode(request), reply=inbox)
                msg = await replies.next_msg(timeout=2)
            except Exception:
                await asyncio.sleep(0.05)
                continue
            await replies.unsubscribe()
            self._daemons[daemon_id] = REGISTER_REPLY_DECODER.decode(msg.data).incarnation
            self.registered.set()
            return

    async def _beat(self) -> None:
        while True:
            self.seq += 1
            beat = Beat(
                self.worker_id,
                "sink",
                dict(self._daemons),
                agents=dict(self.running),
                seq=self.seq,
                max_agents=SINK_ROOM,
            )
            await self.nc.publish(beat_subject(self.worker_id), ENCODER.encode(beat))
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        if self._beat_task is not None:
            self._beat_task.cancel()


async def seed(url: str, count: int, rng: random.Random) -> tuple[int, dict[str, int], float]:
    """Write ``count`` stored sessions; answer (events written, sessions per kind, seconds)."""
    shape = shape_of(thinker(2))
    kinds = {"auto": 0, "side_effects": 0, "terminal": 0}
    nc = await connect([url])
    log = JetStreamLog(nc)
    await log.ensure()
    gate = asyncio.Semaphore(256)
    written = 0

    async def one(n: int) -> None:
        nonlocal written
        draw = rng.random()
        session_id = uuid.uuid4().hex
        if draw < 0.5:
            kinds["auto"] += 1
            envelopes = stored_session(session_id, shape, goal=f"s{n}")
        elif draw < 0.8:
            kinds["side_effects"] += 1
            effect = ("fs.append", {"path": f"f{n}.txt", "line": "x"}, False)
            envelopes = stored_session(session_id, shape, goal=f"s{n}", side_effect=effect)
        else:
            kinds["terminal"] += 1
            envelopes = stored_session(session_id, shape, goal=f"s{n}", terminal=True)
        async with gate:
            await log.append(session_id, envelopes)
        written += len(envelopes)

    started = time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(count)))
    seconds = time.perf_counter() - started
    await nc.close()
    return written, kinds, seconds


@contextlib.asynccontextmanager
async def sink_daemon(
    url: str, data: Path, *, lease_ttl: float | None = None
) -> AsyncIterator[tuple[Daemon, SinkWorker]]:
    """A daemon (not started yet) on the log at ``url``, data dir ``data``, and a ``SinkWorker``
    on its connection; ``lease_ttl``: its presence TTL (the default when None)."""
    nc = await connect([url])
    host = PluginHost()
    sink = SinkWorker(nc, sorted(host.tools()))
    await sink.start()
    store = AsyncStore(LmdbStore(data / "lmdb"))
    daemon_config: dict[str, Any] = {"data_dir": str(data)}
    if lease_ttl is not None:
        daemon_config["lease_ttl"] = lease_ttl
    config = load_config(None, env={}, overrides={"daemon": daemon_config})
    daemon = Daemon(
        config,
        nc=nc,
        log_adapter=JetStreamLog(nc),
        heartbeats=HeartbeatStream(nc),
        kv=await KvBuckets.open(nc, lease_ttl=config.daemon.lease_ttl),
        store=store,
        plugins=host,
        workspace=data / "workspace",
    )
    try:
        yield daemon, sink
    finally:
        # Teardown only: a daemon draining thousands of sessions the sink never runs is cut off.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(daemon.aclose(), 60)
        sink.stop()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(nc.close(), 10)
        await store.aclose()


async def boot(
    url: str, data: Path, expected_auto: int, wait: float = 300, *, die: Path | None = None
) -> dict[str, Any]:
    """Start a daemon on the log at ``url``; answer seconds to its start returning (the boot
    scan) and to ``expected_auto`` dispatches acknowledged by the sink (waiting ``wait`` s).
    ``die``: once the start returned, write its seconds and boot report to this JSON file and
    SIGKILL this process (its leases stay held, its sessions unfinished: a daemon killed there)."""
    async with sink_daemon(url, data) as (daemon, sink):
        registering = asyncio.create_task(sink.registered.wait())
        started = time.perf_counter()
        await daemon.start()
        scanned = time.perf_counter() - started
        if die is not None:
            die.write_text(json.dumps({"scan": scanned, "report": dict(daemon.boot_report)}))
            os.kill(os.getpid(), signal.SIGKILL)
        await registering
        deadline = time.monotonic() + wait
        while sink.dispatches < expected_auto and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        dispatched = time.perf_counter() - started
        return {
            "scan": scanned,
            "dispatched": dispatched,
            "dispatches": sink.dispatches,
            "report": dict(daemon.boot_report),
        }


def measure_boot(count: int, rng: random.Random) -> None:
    base = Path(tempfile.mkdtemp(prefix="apomesh-bench-boot-"))
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    try:
        written, kinds, seed_seconds = asyncio.run(seed(server.url, count, rng))
        result = asyncio.run(boot(server.url, base / "daemon", kinds["auto"]))
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    report = result["report"]
    print(
        f"  {count:>6} sessions ({written} events written in {seed_seconds:.1f} s, "
        f"{written / seed_seconds:,.0f}/s): {kinds['auto']} auto-resumable, "
        f"{kinds['side_effects']} with side effects, {kinds['terminal']} ended"
    )
    print(
        f"    boot scan (every session classified)   {result['scan']:.2f} s   "
        f"({count / result['scan']:,.0f} sessions/s; auto {report.get('auto_resume')}, "
        f"recoverable {report.get('recoverable')}, terminal {report.get('terminal')})"
    )
    print(
        f"    every auto-resumable one dispatched    {result['dispatched']:.2f} s   "
        f"({result['dispatches']} dispatches acknowledged)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 1,000 sessions only")
    parser.add_argument("--rounds", type=int, default=5, help="worker kills per heartbeat setting")
    parser.add_argument("--per-round", type=int, default=6, help="sessions running per kill")
    parser.add_argument("--sessions", default="1000,10000", help="stored session counts")
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--skip-boot", action="store_true")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    counts = [1000] if args.quick else [int(c) for c in args.sessions.split(",") if c]
    if not args.skip_loss:
        print("worker loss -> re-dispatch (real processes, SIGKILL)")
        measure_loss(1.0, rounds, args.per_round)
        measure_loss(0.2, rounds * 2, args.per_round)
    if not args.skip_boot:
        print("boot recovery (in-process daemon, stored sessions of 20 events)")
        rng = random.Random(7)
        for count in counts:
            measure_boot(count, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
