"""The standard durable-agent workload, apomesh against the naive loop at the same durability.

S sessions start at once (``--sessions``, 20), each N steps (``--steps``, 50). One step is one
node of a ``solo`` agent: a model turn (``scripted``, instant) with two tool calls — a read-only
``bench.lookup`` and a side-effecting ``bench.append`` that appends one fixed-width line to the
session's file with ``O_APPEND`` and no fsync (both from the ``apomesh-benchtools`` plugin in
``bench/benchtools``, installed by this script) — then the node's snapshot. The conversation grows
about 300 bytes a step. apomesh runs it through the public path: a ``Node`` (what ``apomesh serve``
runs: the embedded nats-server, the daemon, LMDB, in-process workers), sessions created through
the service the REST API uses. steps/s = S*N over the time from the first session created until
the last one ended.

The floor runs the same steps in the same process as plain asyncio tasks on one NATS connection
to the same nats-server: per step one awaited JetStream publish of ~300 bytes with the
``Nats-Expected-Last-Subject-Sequence`` header, the same side-effect line, then one synced LMDB
put of the session's snapshot (its whole conversation so far), in its own environment.

Repetitions are interleaved (apomesh, floor, apomesh, floor ...; ``--reps``, 3) for each server
sync setting (the default ``sync_interval`` and ``always``); the figure is the median of the
per-repetition ratios. S = 1 step latency p50/p99 (node boundary to node boundary for apomesh,
one step of the loop for the floor) is measured the same way, and for each the CPU this process
spent per step (``time.process_time``: the daemon with its in-process workers, or the loop; the
nats-server's is apart), which other work on a shared machine disturbs less than steps/s.

Kill -9 recovery (``--kill``, on by default): an ``apomesh serve`` process (its embedded
nats-server, two in-process workers) runs the S x N workload; at half the effects it is SIGKILLed
and started again, and the operator's bulk resume (``resume_matching``) takes every session that
waits for one; the figure is restart to all done: the lines are counted every 5 ms, and the
sessions listed once every line is there (and every 50 ms meanwhile: the daemon under test serves
the listing). The same again under ``apomesh serve --supervise``:
there the daemon is a child of the supervisor, and the child is SIGKILLed; the supervisor forks a
new one at once, with the runtime already imported (the figure runs from the kill to all done, the
operator's bulk resume as before). The floor runs as a child process on its own
nats-server (``floor_child.py``, importing only nats-py and LMDB), SIGKILLed at half its effects,
and restarted: each session replays the events after
its snapshot and goes on. For both: effects duplicated (a step's line twice), effects never run
(a step with no line) and sessions lost. The three kill runs are interleaved too, ``--kill-reps``
times (11: a restart, a third of a second or so, varies more from run to run on a shared machine
than the other figures, each run in new processes; the median ratio and the range are printed).
apomesh's modules are byte-compiled first, as a wheel install leaves them.

Durability as measured: LMDB synced on every commit for both; JetStream as configured (default:
an acknowledged event is in the server's files and fsynced within two minutes; ``always``:
fsynced before the acknowledgement). Run ``python bench/bench_workload.py`` (``--quick``: S=5,
N=10, one repetition). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import nats
import nats.js.errors
from nats.js.api import StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_runtime import make_config, percentile, run_sessions, scratch
from floor_child import FLOOR_CHILD, TURN_TEXT

import apomesh
from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.core.events import AgentSnapshotted
from apomesh.core.views import TERMINAL_STATUSES
from apomesh.plugins.manager import BUILTIN_DISTRIBUTION, ENV_ALLOW
from apomesh.runtime.node import Node
from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess, install_plugin_package

BENCHTOOLS = Path(__file__).resolve().parent / "benchtools"
STEP_SOURCES = ("node", "turn")


def workload_definition(steps: int) -> dict[str, Any]:
    turns: list[dict[str, Any]] = [
        {
            "text": f"{TURN_TEXT}step {n}",
            "tool_calls": [
                {"tool": "bench.lookup", "args": {"key": f"k{n}"}},
                {"tool": "bench.append", "args": {"step": n}},
            ],
        }
        for n in range(steps)
    ]
    turns.append({"final": "done: {task}"})
    return {
        "name": "bench-workload",
        "version": "1.0.0",
        "instructions": "Work through the script.",
        "coordination": "solo",
        "workspace": "shared",  # every session appends under bench/, counted as one
        "tools": ["bench.lookup", "bench.append"],
        "model": {"provider": "scripted", "turns": turns},
        "budget": {"max_steps": steps + 10},
    }


# --- apomesh --------------------------------------------------------------------------------------


@dataclass
class Run:
    steps: int
    seconds: float
    latencies: list[float]
    cpu: float = 0.0
    """CPU seconds this process spent (the daemon and its in-process workers, or the loop)."""

    @property
    def rate(self) -> float:
        return self.steps / self.seconds


async def apomesh_run(node: Node, sessions: int, steps: int) -> Run:
    assert node.daemon is not None
    definition = workload_definition(steps)
    started, cpu = time.perf_counter(), time.process_time()
    ids = await run_sessions(node, definition, sessions)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    latencies: list[float] = []
    for session_id in ids:
        ends: dict[int, float] = {}
        for env in await node.daemon.log.read(session_id):
            ev = env.event
            if isinstance(ev, AgentSnapshotted) and ev.source in STEP_SOURCES:
                ends[ev.step] = env.ts
        times = [ends[n] for n in sorted(ends)]
        latencies.extend(b - a for a, b in itertools.pairwise(times))
    return Run(sessions * steps, seconds, latencies, cpu)


# --- the naive floor ------------------------------------------------------------------------------


async def floor_run(node: Node, base: Path, sessions: int, steps: int) -> Run:
    """The naive loop: per step an awaited JetStream publish with the expected-last-subject-
    sequence header, the side-effect line, a synced LMDB put of the whole conversation."""
    run_id = uuid.uuid4().hex[:8]
    stream = f"FLOOR_{run_id}"
    login = node.credentials.daemon if node.credentials is not None else None
    nc = await nats.connect(
        node.urls[0],
        name="bench-floor",
        user=login.user if login else None,
        password=login.password if login else None,
    )
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(name=stream, subjects=[f"apomesh.floor.{run_id}.>"], storage=StorageType.FILE)
    )
    env = lmdb.open(str(base / f"floor-{run_id}"), map_size=1 << 30, sync=True, max_dbs=2)
    lines = base / f"floor-{run_id}-lines"
    lines.mkdir()
    latencies: list[float] = []

    def put(key: bytes, value: bytes) -> None:
        with env.begin(write=True) as txn:
            txn.put(key, value)

    async def session(n: int) -> None:
        subject = f"apomesh.floor.{run_id}.s{n}"
        conversation = bytearray()
        last = 0
        fd = os.open(lines / f"s{n}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for step in range(steps):
                began = time.perf_counter()
                event = f'{{"step":{step},"text":"{TURN_TEXT}","result":"appended"}}'.encode()
                ack = await js.publish(
                    subject,
                    event.ljust(300),
                    headers={"Nats-Expected-Last-Subject-Sequence": str(last)},
                )
                last = ack.seq
                os.write(fd, f"s{n} step {step}".ljust(63).encode() + b"\n")
                conversation += event
                await asyncio.to_thread(put, subject.encode(), bytes(conversation))
                latencies.append(time.perf_counter() - began)
        finally:
            os.close(fd)

    try:
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(session(n) for n in range(sessions)))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await js.delete_stream(stream)
        await nc.close()
        env.close()
    return Run(sessions * steps, seconds, latencies, cpu)


# --- the run --------------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, sync_always: bool) -> dict[str, Any]:
    with scratch("apomesh-workload-") as base:
        config = make_config(base, workers=2, sync_always=sync_always)
        config = _with_benchtools(config)
        async with Node(config, http=False) as node:
            for _, worker in node.workers:
                await worker.wait_registered()
            await apomesh_run(node, 2, 3)  # warm up: imports, first fold, LMDB pages
            ratios, ours, floors, cpu_ours, cpu_floor = [], [], [], [], []
            for rep in range(args.reps):
                mine = await apomesh_run(node, args.sessions, args.steps)
                naive = await floor_run(node, base, args.sessions, args.steps)
                ours.append(mine.rate)
                floors.append(naive.rate)
                cpu_ours.append(mine.cpu / mine.steps)
                cpu_floor.append(naive.cpu / naive.steps)
                ratios.append(mine.rate / naive.rate)
                print(
                    f"  {'always' if sync_always else 'default'} rep {rep + 1}: apomesh "
                    f"{mine.rate:,.0f} steps/s, floor {naive.rate:,.0f} steps/s, "
                    f"ratio {mine.rate / naive.rate:.2f}",
                    flush=True,
                )
            single_ours: list[float] = []
            single_floor: list[float] = []
            for _ in range(args.reps):
                single_ours += (await apomesh_run(node, 1, args.steps)).latencies
                single_floor += (await floor_run(node, base, 1, args.steps)).latencies
    return {
        "ratio": statistics.median(ratios),
        "ours": statistics.median(ours),
        "floor": statistics.median(floors),
        "cpu": (statistics.median(cpu_ours), statistics.median(cpu_floor)),
        "s1": (percentile(single_ours, 0.5), percentile(single_ours, 0.99)),
        "s1_floor": (percentile(single_floor, 0.5), percentile(single_floor, 0.99)),
    }


def _with_benchtools(config: Any) -> Any:
    import msgspec

    plugins = msgspec.structs.replace(
        config.plugins, allow=[BUILTIN_DISTRIBUTION, "apomesh-benchtools"]
    )
    return msgspec.structs.replace(config, plugins=plugins)


# --- kill -9 recovery -----------------------------------------------------------------------------


@dataclass
class Recovery:
    seconds: float
    duplicates: int
    never_run: int
    lost: int


def audit_lines(folder: Path, sessions: list[str], steps: int, completed: set[str]) -> Recovery:
    duplicates = never_run = 0
    for name in sessions:
        path = folder / f"{name}.log"
        found = (
            [line.split()[-1] for line in path.read_text().splitlines()] if path.exists() else []
        )
        duplicates += len(found) - len(set(found))
        never_run += len({str(n) for n in range(steps)} - set(found))
    return Recovery(0.0, duplicates, never_run, len(set(sessions) - completed))


def lines_in(folder: Path) -> int:
    return (
        sum(len(p.read_bytes().splitlines()) for p in folder.glob("*.log"))
        if folder.exists()
        else 0
    )


def daemon_pid(daemon: DaemonProcess) -> int | None:
    """The pid the daemon's data dir lock names (under ``--supervise``, the supervisor's child)."""
    text = (daemon.data_dir / "daemon.lock").read_text().strip()
    return int(text) if text else None


async def apomesh_kill(base: Path, sessions: int, steps: int, *, supervised: bool) -> Recovery:
    daemon = DaemonProcess(
        [],
        base / "daemon",
        workers=2,
        env={ENV_ALLOW: f"{BUILTIN_DISTRIBUTION},apomesh-benchtools"},
        extra_args=("--supervise",) if supervised else (),
    )
    folder = daemon.workspace / "bench"
    await asyncio.to_thread(daemon.start)
    try:
        async with Client(daemon.url, reconnect_window=60) as client:
            definition = workload_definition(steps)
            ids = [
                await client.start_session(f"k{n}", definition=definition) for n in range(sessions)
            ]
            while lines_in(folder) < sessions * steps // 2:
                await asyncio.sleep(0.005)
        # The operator's client is at hand before the kill (an HTTP client with its TLS context
        # takes ~20 ms to build): the figure is the daemon's restart, not the client's.
        operator = Client(daemon.url, reconnect_window=60)
        if supervised:
            # The daemon, not its supervisor, which forks a new one at once.
            killed = daemon_pid(daemon)
            assert killed is not None and killed != daemon.pid
            os.kill(killed, signal.SIGKILL)
            restarted = time.perf_counter()
            while daemon_pid(daemon) in (None, killed):
                await asyncio.sleep(0.001)
            await asyncio.to_thread(daemon.wait_ready)
        else:
            await asyncio.to_thread(daemon.kill)
            restarted = time.perf_counter()
            await asyncio.to_thread(daemon.start)
        async with operator as client:
            await client.resume_matching()
            listed = 0.0
            while True:
                # The sessions are listed once every line is written (then every 5 ms until all
                # have ended), and every 50 ms meanwhile: the end is seen within 5 ms (it was
                # within 20 ms), and the daemon under test serves 20 listings a second, not 50.
                now = time.perf_counter()
                if lines_in(folder) >= sessions * steps or now - listed >= 0.05:
                    listed = now
                    rows = {row.session_id: row.status for row in await client.list_sessions()}
                    statuses = [rows.get(sid, "") for sid in ids]
                    if all(status in TERMINAL_STATUSES for status in statuses):
                        break
                    if "running" not in statuses:
                        await client.resume_matching()  # listed after the first call's scan
                await asyncio.sleep(0.005)
            seconds = time.perf_counter() - restarted
            completed = {
                sid for sid, status in zip(ids, statuses, strict=True) if status == "completed"
            }
        result = audit_lines(folder, ids, steps, completed)
        return Recovery(seconds, result.duplicates, result.never_run, result.lost)
    finally:
        await asyncio.to_thread(daemon.kill)


async def floor_kill(base: Path, sessions: int, steps: int) -> Recovery:
    server = NatsServer(single_node(base / "floor-nats", name="floor"))
    await asyncio.to_thread(server.start)
    folder = base / "bench"
    # Its own small script: the loop's restart imports what the loop needs, not this module's
    # apomesh imports.
    command = [sys.executable, str(FLOOR_CHILD), server.url, str(base), str(sessions), str(steps)]
    try:
        child = subprocess.Popen(command)
        while lines_in(folder) < sessions * steps // 2 and child.poll() is None:
            await asyncio.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait()
        restarted = time.perf_counter()
        child = subprocess.Popen(command)
        code = await asyncio.to_thread(child.wait)
        seconds = time.perf_counter() - restarted
        names = [f"s{n}" for n in range(sessions)]
        result = audit_lines(folder, names, steps, set(names) if code == 0 else set())
        return Recovery(seconds, result.duplicates, result.never_run, result.lost)
    finally:
        await asyncio.to_thread(server.stop)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def main_async(args: argparse.Namespace) -> None:
    print(
        f"workload: S={args.sessions} sessions x N={args.steps} steps, {args.reps} interleaved "
        f"repetitions, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results = {}
    for sync_always in (False, True):
        results[sync_always] = await measure(args, sync_always)
    print()
    print(
        "| server sync | apomesh steps/s | floor steps/s | ratio (median of reps) "
        "| S=1 p50 / p99 apomesh | S=1 p50 / p99 floor | p50 ratio "
        "| CPU per step, apomesh / floor (this process) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for sync_always, r in results.items():
        print(
            f"| {'always' if sync_always else 'default'} | {r['ours']:,.0f} | {r['floor']:,.0f} "
            f"| **{r['ratio']:.2f}x** | {ms(r['s1'][0])} / {ms(r['s1'][1])} "
            f"| {ms(r['s1_floor'][0])} / {ms(r['s1_floor'][1])} "
            f"| {r['s1'][0] / r['s1_floor'][0]:.2f}x "
            f"| {ms(r['cpu'][0])} / {ms(r['cpu'][1])} |"
        )
    if args.kill:
        # Both processes start from bytecode, as from a wheel install (pip compiles at install):
        # under PYTHONDONTWRITEBYTECODE an editable install compiles apomesh (and the bench's
        # tool plugin) from source at every start, about 0.4 s, while nats-py and LMDB come
        # compiled.
        compileall.compile_dir(Path(apomesh.__file__).parent, quiet=2)
        compileall.compile_dir(BENCHTOOLS / "src", quiet=2)
        ours, supervised, naive = [], [], []
        for _ in range(args.kill_reps):
            with scratch("apomesh-kill-") as base:
                ours.append(await apomesh_kill(base, args.sessions, args.steps, supervised=False))
            with scratch("apomesh-supervised-kill-") as base:
                supervised.append(
                    await apomesh_kill(base, args.sessions, args.steps, supervised=True)
                )
            with scratch("apomesh-floor-kill-") as base:
                naive.append(await floor_kill(base, args.sessions, args.steps))
        print()
        print(
            "| kill -9 at half the effects | restart to all done | duplicated effects "
            "| effects never run | sessions lost |"
        )
        print("|---|---|---|---|---|")
        rows = (
            ("apomesh serve (started again)", ours),
            ("apomesh serve --supervise (its daemon forked again)", supervised),
            ("floor", naive),
        )
        for name, runs in rows:
            print(
                f"| {name} | {statistics.median(r.seconds for r in runs):.2f} s "
                f"| {sum(r.duplicates for r in runs)} | {sum(r.never_run for r in runs)} "
                f"| {sum(r.lost for r in runs)} |"
            )
        for name, runs in rows[:2]:
            ratios = [a.seconds / b.seconds for a, b in zip(runs, naive, strict=True)]
            print(
                f"restart to all done, {name} / floor: **{statistics.median(ratios):.2f}x** (median"
                f" of {args.kill_reps}; {min(ratios):.2f}x to {max(ratios):.2f}x)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--kill-reps",
        type=int,
        default=11,
        help="repetitions of the kill -9 runs (11: a restart's time varies the most)",
    )
    parser.add_argument("--quick", action="store_true", help="S=5, N=10, one repetition")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="skip kill -9")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.steps, args.reps, args.kill_reps = 5, 10, 1, 1
    install_plugin_package(BENCHTOOLS)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
