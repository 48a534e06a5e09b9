"""Several daemons on one NATS cluster: takeover time after a daemon SIGKILL, and throughput with
one, two and three daemons.

A real three-node nats-server cluster (three-replica streams and buckets), ``apomesh serve``
processes with their own data dirs and two shared ``apomesh worker`` processes.

**Takeover.** Daemon A runs ``--sessions`` long sessions (an agent appending a line per turn);
once each has logged a side effect, A is SIGKILLed. For each session the figure is the time from
the SIGKILL to its first resumed step on a peer: the first ``dispatched`` event after the peer's
``SessionRecovered``, from the events' own timestamps. A peer sees A's presence record age out and
adopts each session once its lease expires, so the figure is about the lease TTL plus a sweep (a
sixth of the TTL, at most 2.5 s). Measured at the default lease (30 s) and a short one (3 s).

**Throughput.** The same workload (``--workload`` short sessions of three appends each, started
round-robin over the daemons, all at once) with one, two and three daemons on the cluster:
sessions completed per second, from the first start to the last end. The two workers are the same
in every run, so the figure shows what the daemons add or cost, not more worker capacity.

Run ``python bench/bench_daemons.py`` (``--quick``: the short lease only, a smaller workload).
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.chaos_kit import appender

from apomesh.adapters.natsserver import cluster, start_cluster, wait_jetstream_ready
from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess, WorkerProcess


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class System:
    def __init__(self, urls: list[str], base: Path, lease_ttl: float) -> None:
        self.urls = urls
        self.base = base
        self.lease_ttl = lease_ttl
        self.daemons: list[DaemonProcess] = []
        self.workers: list[WorkerProcess] = []

    def daemon(self) -> DaemonProcess:
        daemon = DaemonProcess(
            self.urls,
            self.base / f"d{len(self.daemons)}",
            extra_args=("--replicas", "3"),
            env={"APOMESH_DAEMON_LEASE_TTL": str(self.lease_ttl)},
        )
        daemon.start(timeout=60.0)
        self.daemons.append(daemon)
        return daemon

    def worker(self) -> None:
        worker = WorkerProcess(self.urls, self.base / "workspace", f"w{len(self.workers)}")
        worker.start()
        self.workers.append(worker)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        for daemon in self.daemons:
            daemon.stop()


async def wait_ready(url: str, daemons: int) -> None:
    async with Client(url) as client:
        while True:
            live = [d for d in await client.list_daemons() if d.state == "active"]
            workers = [w for w in await client.list_workers() if w.alive]
            if len(live) >= daemons and len(workers) >= 2:
                return
            await asyncio.sleep(0.1)


async def takeover(urls: list[str], base: Path, lease_ttl: float, sessions: int) -> list[float]:
    system = System(urls, base, lease_ttl)
    try:
        a, b = system.daemon(), system.daemon()
        system.worker()
        system.worker()
        await wait_ready(a.url, 2)
        async with Client(a.url) as on_a:
            ids = [
                await on_a.start_session(
                    f"takeover-{n}", definition=appender(steps=400, delay=0.05)
                )
                for n in range(sessions)
            ]
            for sid in ids:
                while (await on_a.get_session(sid)).side_effects < 1:
                    await asyncio.sleep(0.05)
        killed_at = time.time()
        a.kill()
        figures: list[float] = []
        async with Client(b.url) as on_b:
            for sid in ids:
                recovered = False
                async for record in on_b.events(sid):
                    if record.kind == "SessionRecovered":
                        recovered = True
                    elif (
                        recovered
                        and record.kind == "AgentLifecycle"
                        and record.event.get("phase") == "dispatched"
                    ):
                        figures.append(record.ts - killed_at)
                        break
        return figures
    finally:
        system.close()


async def throughput(urls: list[str], base: Path, daemons: int, workload: int) -> float:
    system = System(urls, base, 30.0)
    try:
        started = [system.daemon() for _ in range(daemons)]
        system.worker()
        system.worker()
        await wait_ready(started[0].url, daemons)
        clients = [Client(d.url) for d in started]
        try:
            begin = time.perf_counter()
            ids = await asyncio.gather(
                *(
                    clients[n % daemons].start_session(
                        f"load-{daemons}-{n}", definition=appender(steps=3, delay=0.0)
                    )
                    for n in range(workload)
                )
            )
            await asyncio.gather(
                *(clients[n % daemons].wait(sid, timeout=600) for n, sid in enumerate(ids))
            )
            return workload / (time.perf_counter() - begin)
        finally:
            for client in clients:
                await client.aclose()
    finally:
        system.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short lease only, small workload")
    parser.add_argument("--sessions", type=int, default=6, help="sessions killed per takeover run")
    parser.add_argument("--workload", type=int, default=60, help="sessions per throughput run")
    args = parser.parse_args()
    leases = [3.0] if args.quick else [30.0, 3.0]
    workload = 20 if args.quick else args.workload
    with tempfile.TemporaryDirectory(prefix="bench-daemons-") as tmp:
        base = Path(tmp)
        servers = start_cluster(cluster(base / "nats", 3))
        try:
            await wait_jetstream_ready(servers.urls, replicas=3)
            print("takeover after a daemon SIGKILL (kill -> first resumed step on a peer)")
            for ttl in leases:
                figures = await takeover(
                    servers.urls, base / f"takeover-{ttl:g}", ttl, args.sessions
                )
                print(
                    f"  lease_ttl {ttl:>4g} s: {len(figures)} sessions,"
                    f" p50 {statistics.median(figures):.2f} s, p99 {percentile(figures, 99):.2f} s,"
                    f" max {max(figures):.2f} s"
                )
            print(f"throughput: {workload} sessions of 3 appends, 2 shared workers")
            results: dict[int, Any] = {}
            for count in (1, 2, 3):
                results[count] = await throughput(
                    servers.urls, base / f"load-{count}", count, workload
                )
                print(f"  {count} daemon(s): {results[count]:.1f} sessions/s")
        finally:
            servers.stop()


if __name__ == "__main__":
    asyncio.run(main())
