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
one step of the loop for the floor) is measured the same way.

Durability as measured: LMDB synced on every commit for both; JetStream as configured (default:
an acknowledged event is in the server's files and fsynced within two minutes; ``always``:
fsynced before the acknowledgement). Run ``python bench/bench_workload.py`` (``--quick``: S=5,
N=10, one repetition). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import nats
from nats.js.api import StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_runtime import make_config, percentile, run_sessions, scratch

from apomesh.core.events import AgentSnapshotted
from apomesh.plugins.manager import BUILTIN_DISTRIBUTION
from apomesh.runtime.node import Node
from apomesh.testing import install_plugin_package

BENCHTOOLS = Path(__file__).resolve().parent / "benchtools"
TURN_TEXT = "Looked the record up; appending the step's line next. " * 3
"""The model's words each turn: with the two calls and their results, ~300 bytes a step."""
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

    @property
    def rate(self) -> float:
        return self.steps / self.seconds


async def apomesh_run(node: Node, sessions: int, steps: int) -> Run:
    assert node.daemon is not None
    definition = workload_definition(steps)
    started = time.perf_counter()
    ids = await run_sessions(node, definition, sessions)
    seconds = time.perf_counter() - started
    latencies: list[float] = []
    for session_id in ids:
        ends: dict[int, float] = {}
        for env in await node.daemon.log.read(session_id):
            ev = env.event
            if isinstance(ev, AgentSnapshotted) and ev.source in STEP_SOURCES:
                ends[ev.step] = env.ts
        times = [ends[n] for n in sorted(ends)]
        latencies.extend(b - a for a, b in itertools.pairwise(times))
    return Run(sessions * steps, seconds, latencies)


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
        started = time.perf_counter()
        await asyncio.gather(*(session(n) for n in range(sessions)))
        seconds = time.perf_counter() - started
    finally:
        await js.delete_stream(stream)
        await nc.close()
        env.close()
    return Run(sessions * steps, seconds, latencies)


# --- the run --------------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, sync_always: bool) -> dict[str, Any]:
    with scratch("apomesh-workload-") as base:
        config = make_config(base, workers=2, sync_always=sync_always)
        config = _with_benchtools(config)
        async with Node(config, http=False) as node:
            for _, worker in node.workers:
                await worker.wait_registered()
            await apomesh_run(node, 2, 3)  # warm up: imports, first fold, LMDB pages
            ratios, ours, floors = [], [], []
            for rep in range(args.reps):
                mine = await apomesh_run(node, args.sessions, args.steps)
                naive = await floor_run(node, base, args.sessions, args.steps)
                ours.append(mine.rate)
                floors.append(naive.rate)
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
        "s1": (percentile(single_ours, 0.5), percentile(single_ours, 0.99)),
        "s1_floor": (percentile(single_floor, 0.5), percentile(single_floor, 0.99)),
    }


def _with_benchtools(config: Any) -> Any:
    import msgspec

    plugins = msgspec.structs.replace(
        config.plugins, allow=[BUILTIN_DISTRIBUTION, "apomesh-benchtools"]
    )
    return msgspec.structs.replace(config, plugins=plugins)


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
        "| S=1 p50 / p99 apomesh | S=1 p50 / p99 floor | p50 ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for sync_always, r in results.items():
        print(
            f"| {'always' if sync_always else 'default'} | {r['ours']:,.0f} | {r['floor']:,.0f} "
            f"| **{r['ratio']:.2f}x** | {ms(r['s1'][0])} / {ms(r['s1'][1])} "
            f"| {ms(r['s1_floor'][0])} / {ms(r['s1_floor'][1])} "
            f"| {r['s1'][0] / r['s1_floor'][0]:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="S=5, N=10, one repetition")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.steps, args.reps = 5, 10, 1
    install_plugin_package(BENCHTOOLS)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
