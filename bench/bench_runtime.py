"""Runtime throughput: agent node-steps per second through the whole daemon, against the bare floor.

The daemon is a ``Node`` (runtime/node.py) with its embedded nats-server under a temporary
directory and no HTTP, run inside this process so the process measures itself. Its workers are
in-process local workers by default (the daemon, its workers and this driver then share one
Python process and its one GIL, as ``apomesh serve`` runs them), or ``apomesh worker`` processes
with ``--worker-processes N`` (the daemon's figures are then the daemon's alone). The
nats-server is its own process either way. The output says which.

Every model is ``scripted`` and answers instantly. Figures, as medians over ``--runs`` repeats:

- **steps/s across 50 concurrent sessions**: each session is a ``solo`` agent whose script is
  ``--steps`` turns of one tool call and then a final answer. Each step is a node: a model turn,
  the tool call, the snapshot written to LMDB and its events appended to the log. Two workloads:
  ``fs.write`` (a side effect: the model turn recorded and the intent logged before the write —
  one report, a turn snapshot, two events — then its result and the node's snapshot pointer after
  it, four events per step) and ``fs.read`` (read-only: one snapshot pointer per step). Steps are
  counted from the log (the agent's distinct steps among its ``AgentSnapshotted`` of source
  ``node`` or ``turn``, the final answer's turn included) over the time from the first session
  created to the last one ended, so session start and end are in the figure.
- **p50/p99 step latency**: the time between the last ``AgentSnapshotted`` of an agent's
  consecutive steps (node boundary to node boundary: model turn, tool call, journal, snapshot).
- **peak RSS** of the daemon's process (with in-process workers: daemon + workers + driver),
  sampled every 50 ms during the run, and the CPU each process spent per step.
- **snapshot bytes per step** of one long agent (a 500-step ``fs.write`` script): the
  ``AgentSnapshotted.size`` at steps 10 and 500 (bytes of keys and values the step's snapshots,
  its turn's and its node's, put in LMDB) and the mean over 32 steps early and late (every ``compact_every`` = 32 nodes one step
  also writes the merged segment, so each window holds one compaction; step 1 also stores the
  definition, shown on its own), plus the LMDB data file at the end.
- **the bare floor**: one awaited JetStream append (``JetStreamLog.append`` of one event) and one
  synced LMDB commit (``LmdbStore.write_batch``) per step, in a plain sequential loop; and the
  runtime's ratio to it.

Durability as measured: LMDB ``sync = true`` (every commit fsynced before it returns, the
default), JetStream with the server's default ``sync_interval`` (an acknowledged event is in the
server's files and fsynced within two minutes, the default). ``--sync-always`` runs the embedded
server with ``sync_interval: always`` instead (fsynced before the ack).

Run ``python bench/bench_runtime.py`` (``--quick`` for a short run, ``--runs N``,
``--sessions N``, ``--steps N``, ``--worker-processes N``). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.lmdb_store import LmdbStore
from apomesh.adapters.nats_connect import connect
from apomesh.adapters.natsserver import embedded_server
from apomesh.core.envelope import make
from apomesh.core.events import AgentSnapshotted, CoordinatorCheckpoint
from apomesh.plugins.manager import BUILTIN_DISTRIBUTION, ENV_ALLOW
from apomesh.runtime.config import Config, load_config
from apomesh.runtime.node import Node

LONG_STEPS = 500
COMPACT_EVERY = Config().snapshots.compact_every
SEED_FILES = 8
STEP_SOURCES = ("node", "turn")
"""The snapshot sources that mark an agent's steps: its nodes, and its turns (the final answer's)."""
WORKLOADS = (("fs.write", "fs.write (side effect)"), ("fs.read", "fs.read (read-only)"))


def agent_definition(tool: str, steps: int) -> dict[str, Any]:
    """A ``solo`` agent that makes ``steps`` tool calls, one per node, then answers."""
    turns: list[dict[str, Any]] = []
    for n in range(steps):
        if tool == "fs.write":
            args = {"path": "{task}.txt", "content": f"{{task}} step {n}"}
        else:
            args = {"path": f"seed-{n % SEED_FILES}.txt"}  # varied, so the loop guard stays quiet
        turns.append({"tool_calls": [{"tool": tool, "args": args}]})
    turns.append({"final": "done: {task}"})
    return {
        "name": f"bench-{tool}",
        "version": "1.0.0",
        "instructions": "Work through the script.",
        "coordination": "solo",
        "workspace": "shared",  # the read-only steps read the seed files
        "tools": [tool],
        "model": {"provider": "scripted", "turns": turns},
        "budget": {"max_steps": steps + 10},
    }


def make_config(base: Path, *, workers: int, sync_always: bool) -> Config:
    return load_config(
        None,
        env={},
        overrides={
            "daemon": {
                "data_dir": str(base / "data"),
                "workers": workers,
                "workspace": str(base / "workspace"),
                "log_level": "warning",
            },
            "nats": {"sync_interval": "always" if sync_always else "default"},
            # Only the built-in plugin: the figures measure apomesh, not whatever else is installed.
            "plugins": {"allow": [BUILTIN_DISTRIBUTION]},
        },
    )


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds process ``pid`` has used so far (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Samples this process's resident set size and keeps the peak."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def current() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.current())
            await asyncio.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = self.current()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.peak = max(self.peak, self.current())


@dataclass
class System:
    """A running daemon and its workers, and the processes whose CPU is counted."""

    node: Node
    config: Config
    worker_pids: list[int] = field(default_factory=list)

    @property
    def server_pid(self) -> int | None:
        return self.node.server.pid if self.node.server is not None else None

    def cpu(self) -> tuple[float, float, float]:
        """CPU seconds so far of (this process, the worker processes, the nats-server)."""
        workers = sum(cpu_seconds(pid) for pid in self.worker_pids)
        return time.process_time(), workers, cpu_seconds(self.server_pid)


@contextlib.asynccontextmanager
async def running_system(
    base: Path, *, workers: int, worker_processes: int, sync_always: bool
) -> AsyncIterator[System]:
    """A ``Node`` with ``workers`` in-process workers, or none and ``worker_processes``
    ``apomesh worker`` processes, every worker registered."""
    config = make_config(base, workers=0 if worker_processes else workers, sync_always=sync_always)
    workspace = config.daemon.workspace_path()
    procs: list[subprocess.Popen[bytes]] = []
    async with Node(config, http=False) as node:
        assert node.daemon is not None
        try:
            for i in range(worker_processes):
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "apomesh",
                            "worker",
                            "--nats",
                            node.urls[0],
                            "--name",
                            f"bench-{i}",
                            "--workspace",
                            str(workspace),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        env={**os.environ, ENV_ALLOW: BUILTIN_DISTRIBUTION},
                    )
                )
            for _, worker in node.workers:
                await worker.wait_registered()
            deadline = time.monotonic() + 60
            while len(node.daemon.workers.workers) < (worker_processes or workers):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not register within 60 s")
                await asyncio.sleep(0.05)
            yield System(node, config, [p.pid for p in procs])
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


@dataclass
class LoadResult:
    steps: int
    seconds: float
    latencies: list[float]
    peak_rss: int
    cpu: tuple[float, float, float]  # seconds: daemon process, worker processes, nats-server

    @property
    def rate(self) -> float:
        return self.steps / self.seconds

    def cpu_per_step(self, part: int) -> float:
        return self.cpu[part] / self.steps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_sessions(node: Node, definition: dict[str, Any], sessions: int) -> list[str]:
    """Start ``sessions`` sessions at once and wait until every one has ended."""
    assert node.service is not None and node.daemon is not None
    daemon = node.daemon
    ids = await asyncio.gather(
        *(
            node.service.create_session(f"s{i}", agent=None, definition=definition, by="bench")
            for i in range(sessions)
        )
    )
    live = daemon.registry.live
    tasks = [live[sid].task for sid in ids if sid in live]
    await asyncio.gather(*(t for t in tasks if t is not None))
    return list(ids)


async def step_latencies(node: Node, session_ids: list[str]) -> tuple[int, list[float]]:
    """(node steps, seconds between consecutive snapshots of each agent) read back from the log."""
    assert node.daemon is not None
    steps = 0
    latencies: list[float] = []
    for sid in session_ids:
        envelopes = await node.daemon.log.read(sid)
        ends: dict[str, dict[int, float]] = {}
        for env in envelopes:
            ev = env.event
            if isinstance(ev, AgentSnapshotted) and ev.source in STEP_SOURCES:
                ends.setdefault(ev.agent, {})[ev.step] = env.ts
        for by_step in ends.values():
            steps += len(by_step)
            times = [by_step[n] for n in sorted(by_step)]
            latencies.extend(b - a for a, b in itertools.pairwise(times))
    return steps, latencies


async def measure_load(
    base: Path,
    *,
    tool: str,
    sessions: int,
    steps: int,
    workers: int,
    worker_processes: int,
    sync_always: bool,
) -> LoadResult:
    async with running_system(
        base, workers=workers, worker_processes=worker_processes, sync_always=sync_always
    ) as system:
        node = system.node
        workspace = system.config.daemon.workspace_path()
        for n in range(SEED_FILES):
            (workspace / f"seed-{n}.txt").write_text(f"seed file {n} for the read-only steps\n")
        await run_sessions(node, agent_definition(tool, 2), 4)  # warm the paths up
        with RssSampler() as rss:
            cpu_started = system.cpu()
            started = time.perf_counter()
            ids = await run_sessions(node, agent_definition(tool, steps), sessions)
            seconds = time.perf_counter() - started
            cpu_ended = system.cpu()
        counted, latencies = await step_latencies(node, ids)
        cpu = (
            cpu_ended[0] - cpu_started[0],
            cpu_ended[1] - cpu_started[1],
            cpu_ended[2] - cpu_started[2],
        )
        return LoadResult(counted, seconds, latencies, rss.peak, cpu)


@dataclass
class LongResult:
    sizes: dict[int, int]
    lmdb_file_bytes: int


async def measure_long_agent(
    base: Path, *, steps: int, worker_processes: int, sync_always: bool
) -> LongResult:
    async with running_system(
        base, workers=1, worker_processes=min(worker_processes, 1), sync_always=sync_always
    ) as system:
        node = system.node
        assert node.daemon is not None and node.service is not None
        sid = await node.service.create_session(
            "long", agent=None, definition=agent_definition("fs.write", steps), by="bench"
        )
        runtime = node.daemon.registry.live[sid]
        assert runtime.task is not None
        await runtime.task
        sizes: dict[int, int] = {}
        for env in await node.daemon.log.read(sid):
            ev = env.event
            if isinstance(ev, AgentSnapshotted) and ev.source in STEP_SOURCES:
                sizes[ev.step] = sizes.get(ev.step, 0) + ev.size
        lmdb_file = system.config.daemon.data_path() / "lmdb" / "data.mdb"
        return LongResult(sizes, lmdb_file.stat().st_size)


async def measure_floor(base: Path, *, count: int, sync_always: bool) -> float:
    """One awaited JetStream append and one synced LMDB commit per step, in a plain loop."""
    config = make_config(base, workers=0, sync_always=sync_always)
    server = embedded_server(config)
    await asyncio.to_thread(server.start)
    try:
        nc = await connect([server.url], name="bench-floor")
        try:
            log_adapter = JetStreamLog(nc, sync_always=sync_always)
            await log_adapter.ensure()
            with LmdbStore(base / "floor-lmdb", sync=True) as store:
                session_id = uuid.uuid4().hex
                value = os.urandom(200)
                started = time.perf_counter()
                for index in range(count):
                    event = CoordinatorCheckpoint(position=f"step {index}", state=value)
                    envelope = make(session_id, index, time.time(), uuid.uuid4().hex, event)
                    await log_adapter.append(session_id, [envelope])
                    store.write_batch([("snapshots", f"floor\x00{index:016x}", value)])
                return count / (time.perf_counter() - started)
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(server.stop)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def mib(n: float) -> str:
    return f"{n / (1024 * 1024):.0f} MiB"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


async def main_async(args: argparse.Namespace) -> None:
    console = Console(width=120)
    runs = 1 if args.quick else args.runs
    steps = 10 if args.quick else args.steps
    long_steps = 100 if args.quick else LONG_STEPS
    floor_count = 1000 if args.quick else 3000
    if args.worker_processes:
        mode = (
            f"daemon in this process (http off), {args.worker_processes} `apomesh worker` processes"
        )
    else:
        mode = (
            f"in-process: this one Python process runs the daemon (http off) and its "
            f"{args.workers} local workers"
        )
    console.print(f"[bold]apomesh runtime bench[/]: {mode}; nats-server is its own process")
    console.print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
        f"medians of {runs} run(s)"
    )
    console.print(
        "durability: LMDB sync = true (each commit fsynced before it returns); JetStream "
        + (
            "sync_interval = always (fsynced before the ack)"
            if args.sync_always
            else "sync_interval = default (acked = in the server's files, fsynced within 2 min)"
        )
    )

    floors = []
    for _ in range(runs):
        with scratch("apomesh-bench-floor-") as base:
            floors.append(
                await measure_floor(base, count=floor_count, sync_always=args.sync_always)
            )
    floor = statistics.median(floors)

    table = Table(
        title=f"{args.sessions} concurrent sessions x {steps} tool-call steps (scripted, instant)"
    )
    for column in ("workload", "steps/s", "x floor", "p50 step", "p99 step", "peak RSS"):
        table.add_column(column, justify="right")
    cpu_parts = ["daemon" if args.worker_processes else "process"]
    if args.worker_processes:
        cpu_parts.append("workers")
    cpu_parts.append("nats")
    table.add_column("CPU us/step: " + " / ".join(cpu_parts), justify="right")
    for tool, label in WORKLOADS:
        results = []
        for _ in range(runs):
            with scratch("apomesh-bench-runtime-") as base:
                results.append(
                    await measure_load(
                        base,
                        tool=tool,
                        sessions=args.sessions,
                        steps=steps,
                        workers=args.workers,
                        worker_processes=args.worker_processes,
                        sync_always=args.sync_always,
                    )
                )
        rate = statistics.median(r.rate for r in results)
        p50 = statistics.median(percentile(r.latencies, 0.50) for r in results)
        p99 = statistics.median(percentile(r.latencies, 0.99) for r in results)
        rss = statistics.median(r.peak_rss for r in results)
        parts = [0, 1, 2] if args.worker_processes else [0, 2]
        cpu = " / ".join(us(statistics.median(r.cpu_per_step(p) for r in results)) for p in parts)
        table.add_row(
            label,
            f"{rate:,.0f}",
            f"{rate / floor:.2f}",
            f"{p50 * 1000:.1f} ms",
            f"{p99 * 1000:.1f} ms",
            mib(rss),
            cpu,
        )
    table.add_row("bare floor: 1 append + 1 commit, plain loop", f"{floor:,.0f}", "1.00")
    console.print(table)

    with scratch("apomesh-bench-long-") as base:
        long = await measure_long_agent(
            base,
            steps=long_steps,
            worker_processes=args.worker_processes,
            sync_always=args.sync_always,
        )
    sizes = long.sizes
    window = COMPACT_EVERY
    first = [sizes[s] for s in range(2, window + 2) if s in sizes]  # after the definition
    last = [sizes[s] for s in range(long_steps - window + 1, long_steps + 1) if s in sizes]
    table = Table(title=f"LMDB bytes written per step, one {long_steps}-step fs.write agent")
    table.add_column("measure")
    table.add_column("bytes", justify="right")
    table.add_row("AgentSnapshotted.size at step 10", f"{sizes.get(10, 0):,}")
    table.add_row(f"AgentSnapshotted.size at step {long_steps}", f"{sizes.get(long_steps, 0):,}")
    table.add_row(f"mean, steps 2-{window + 1}", f"{statistics.mean(first):,.0f}")
    table.add_row(
        f"mean, steps {long_steps - window + 1}-{long_steps}", f"{statistics.mean(last):,.0f}"
    )
    table.add_row("step 1 (stores the definition once)", f"{sizes.get(1, 0):,}")
    compactions = [size for step, size in sizes.items() if step > 1 and step % COMPACT_EVERY == 0]
    table.add_row(
        f"largest compaction step (every {COMPACT_EVERY})", f"{max(compactions, default=0):,}"
    )
    table.add_row(f"LMDB data file after {long_steps} steps", f"{long.lmdb_file_bytes:,}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short run of each figure")
    parser.add_argument("--runs", type=int, default=3, help="repeats per figure (median shown)")
    parser.add_argument("--sessions", type=int, default=50, help="concurrent sessions")
    parser.add_argument("--steps", type=int, default=40, help="tool-call steps per agent")
    parser.add_argument("--workers", type=int, default=2, help="in-process local workers")
    parser.add_argument(
        "--worker-processes",
        type=int,
        default=0,
        help="run this many `apomesh worker` processes instead of in-process workers",
    )
    parser.add_argument(
        "--sync-always", action="store_true", help="run nats-server with sync_interval: always"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
