"""The replicated state store's cost: LMDB alone against LMDB written through to the
``APOMESH_STATE`` bucket (three replicas) on a 3-node nats-server cluster, in one process run.

A 3-node cluster is started on loopback under a temporary directory (its three nats-server
processes share this machine's disk and CPUs with the bench). Two figures:

- **per write_batch**: sequential ``write_batch`` calls of one node's snapshot-sized records (a
  conversation segment of ``--value-bytes`` and a 300-byte snapshot record, as
  ``SnapshotStore.commit`` puts them), median and p99 per call, on ``LmdbStore`` (synced) and on
  ``ReplicatedStore`` (the same LMDB plus one JetStream atomic batch per call); and the latency
  of a read that misses LMDB (a peer's first read of a record) and of the listing a resume does
  (``latest_snapshot`` + ``scan`` of the segments of an agent of 32 nodes).
- **steps/s of the runtime workload**: an in-process ``Node`` (``--nats`` the cluster,
  ``--replicas 3``, two in-process workers) running ``--sessions`` concurrent ``solo`` sessions of
  ``--steps`` scripted ``fs.write`` steps, with ``[store] replicated = "off"`` and ``"on"``; each
  step is a model turn (its recorded turn snapshot), the tool call with its journal and the
  node's snapshot (the workload of ``bench/bench_runtime.py``).

Run ``python bench/bench_replicated_store.py`` (``--quick``, ``--runs N``, ``--sessions N``,
``--steps N``, ``--value-bytes N``). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench_runtime import agent_definition, percentile, run_sessions, step_latencies
from rich.console import Console
from rich.table import Table

from apomesh.adapters.lmdb_store import LmdbStore, snapshot_key
from apomesh.adapters.natsserver import (
    NatsCluster,
    cluster,
    start_cluster,
    wait_jetstream_ready,
)
from apomesh.adapters.replicated_store import ReplicatedStore
from apomesh.core.ports import StateStore
from apomesh.plugins.manager import BUILTIN_DISTRIBUTION
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def batch_latencies(store: StateStore, count: int, value: bytes, agent: str) -> list[float]:
    """Seconds per ``write_batch`` of one node's segment and snapshot record, ``count`` times."""
    record = os.urandom(300)
    times = []
    for n in range(count):
        puts = [
            ("segments", f"{agent}\x00{n:08x}", value),
            ("snapshots", snapshot_key(agent, n + 1), record),
        ]
        started = time.perf_counter()
        store.write_batch(puts)
        times.append(time.perf_counter() - started)
    return times


def timed(action: Callable[[], object], count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return times


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def store_figures(
    servers: NatsCluster, base: Path, *, count: int, value: bytes
) -> list[tuple[str, list[float]]]:
    urls = servers.urls
    rows: list[tuple[str, list[float]]] = []
    with LmdbStore(base / "lmdb-alone") as local:
        rows.append(("LMDB alone (synced)", batch_latencies(local, count, value, "bench/a")))
    replicated = await ReplicatedStore.open(LmdbStore(base / "lmdb-r"), urls, replicas=3)
    try:
        rows.append(
            (
                "LMDB + APOMESH_STATE (R3)",
                await asyncio.to_thread(batch_latencies, replicated, count, value, "bench/r"),
            )
        )
    finally:
        await asyncio.to_thread(replicated.close)
    # A peer with an empty LMDB: its first read of each record goes to the bucket.
    peer = await ReplicatedStore.open(LmdbStore(base / "lmdb-peer"), urls, replicas=3)
    try:
        ids = iter(range(1, count + 1))
        rows.append(
            (
                "peer: point read (bucket, copied to LMDB)",
                await asyncio.to_thread(
                    timed, lambda: peer.get_snapshot("bench/r", next(ids)), min(count, 200)
                ),
            )
        )
        await asyncio.to_thread(
            peer.write_batch,
            [("segments", f"bench/resume\x00{n:08x}", value) for n in range(32)]
            + [("snapshots", snapshot_key("bench/resume", n + 1), b"r" * 300) for n in range(32)],
        )

        def resume_reads() -> None:
            peer.latest_snapshot("bench/resume")
            peer.scan("segments", "bench/resume\x00")

        rows.append(
            (
                "resume reads (latest + scan, 32 nodes)",
                await asyncio.to_thread(timed, resume_reads, 50),
            )
        )
    finally:
        await asyncio.to_thread(peer.close)
    return rows


async def runtime_rate(
    servers: NatsCluster, base: Path, *, replicated: str, sessions: int, steps: int
) -> tuple[float, list[float]]:
    config = load_config(
        None,
        env={},
        overrides={
            "daemon": {
                "data_dir": str(base / "data"),
                "workers": 2,
                "workspace": str(base / "workspace"),
                "log_level": "warning",
            },
            "nats": {"urls": servers.urls, "replicas": 3},
            "store": {"replicated": replicated},
            "plugins": {"allow": [BUILTIN_DISTRIBUTION]},
        },
    )
    async with Node(config, http=False) as node:
        for _, worker in node.workers:
            await worker.wait_registered()
        await run_sessions(node, agent_definition("fs.write", 2), 4)  # warm the paths up
        started = time.perf_counter()
        ids = await run_sessions(node, agent_definition("fs.write", steps), sessions)
        seconds = time.perf_counter() - started
        counted, latencies = await step_latencies(node, ids)
    return counted / seconds, latencies


async def main_async(args: argparse.Namespace) -> None:
    console = Console(width=120)
    runs = 1 if args.quick else args.runs
    count = 200 if args.quick else 1000
    steps = 10 if args.quick else args.steps
    value = os.urandom(args.value_bytes)
    logging.getLogger("apomesh").setLevel(logging.WARNING)
    with scratch("apomesh-bench-replicated-") as base:
        servers = start_cluster(cluster(base / "cluster", 3))
        try:
            await wait_jetstream_ready(servers.urls, replicas=3)
            console.print(
                "[bold]replicated state store bench[/]: 3-node nats-server cluster on loopback"
                f" (this machine), {os.cpu_count()} CPUs, load average"
                f" {os.getloadavg()[0]:.1f} at start; LMDB sync = true; JetStream default"
                " sync_interval"
            )
            rows = await store_figures(servers, base / "store", count=count, value=value)
            table = Table(
                title=f"per call, {len(value)} B segment + 300 B snapshot record per write_batch"
            )
            for column in ("operation", "calls", "median", "p99"):
                table.add_column(column, justify="right")
            for name, times in rows:
                table.add_row(
                    name, str(len(times)), ms(statistics.median(times)), ms(percentile(times, 0.99))
                )
            console.print(table)

            results: dict[str, list[tuple[float, list[float]]]] = {"off": [], "on": []}
            for run in range(runs):
                for mode in ("off", "on"):
                    results[mode].append(
                        await runtime_rate(
                            servers,
                            base / f"node-{mode}-{run}",
                            replicated=mode,
                            sessions=args.sessions,
                            steps=steps,
                        )
                    )
            table = Table(
                title=f"runtime: {args.sessions} concurrent sessions x {steps} fs.write steps,"
                " in-process Node on the cluster (R3 log), 2 in-process workers"
            )
            for column in ("\\[store] replicated", "steps/s", "p50 step", "p99 step"):
                table.add_column(column, justify="right")
            for mode in ("off", "on"):
                rate = statistics.median(r for r, _ in results[mode])
                latencies = [latency for _, ls in results[mode] for latency in ls]
                table.add_row(
                    mode,
                    f"{rate:.0f}",
                    ms(percentile(latencies, 0.5)),
                    ms(percentile(latencies, 0.99)),
                )
            console.print(table)
            off = statistics.median(r for r, _ in results["off"])
            on = statistics.median(r for r, _ in results["on"])
            console.print(f"replicated on runs at {on / off:.0%} of the steps/s of LMDB alone")
        finally:
            servers.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short run of each figure")
    parser.add_argument("--runs", type=int, default=3, help="repeats of the runtime figure")
    parser.add_argument("--sessions", type=int, default=20, help="concurrent sessions")
    parser.add_argument("--steps", type=int, default=20, help="tool-call steps per agent")
    parser.add_argument("--value-bytes", type=int, default=4096, help="segment bytes per node")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
