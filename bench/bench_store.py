"""LMDB state store throughput: what the daemon's snapshot and journal writes cost on this disk.

Measures, as the median of several runs on a fresh store in a temporary directory:

- single synced commits: one ``put_snapshot`` per transaction, each fsynced before it returns
  (the cost of writing one record on its own);
- batched puts: ``write_batch`` with 100 records per synced transaction (how the runtime writes a
  node's snapshot records and journal together);
- the same two with ``sync=False``, to show what the fsync costs;
- gets: random point reads of 4 KiB snapshot records.

Run it with ``python bench/bench_store.py`` (``--runs N``, ``--dir PATH`` to measure another disk,
``--value-bytes N``). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from apomesh.adapters.lmdb_store import LmdbStore, snapshot_key


def _rate(operations: int, seconds: float) -> float:
    return operations / seconds if seconds > 0 else float("inf")


def single_commits(store: LmdbStore, count: int, value: bytes) -> float:
    start = time.perf_counter()
    for snapshot_id in range(count):
        store.put_snapshot("bench/single", snapshot_id, value)
    return _rate(count, time.perf_counter() - start)


def batched_puts(store: LmdbStore, batches: int, per_batch: int, value: bytes) -> float:
    start = time.perf_counter()
    for batch in range(batches):
        agent = f"bench/batch{batch}"
        store.write_batch([("snapshots", snapshot_key(agent, i), value) for i in range(per_batch)])
    return _rate(batches * per_batch, time.perf_counter() - start)


def point_gets(store: LmdbStore, count: int, value: bytes) -> float:
    keys = 1000
    store.write_batch([("snapshots", snapshot_key("bench/get", i), value) for i in range(keys)])
    order = [random.randrange(keys) for _ in range(count)]
    start = time.perf_counter()
    for snapshot_id in order:
        store.get_snapshot("bench/get", snapshot_id)
    return _rate(count, time.perf_counter() - start)


def median_of(runs: int, base: Path, sync: bool, measure: Callable[[LmdbStore], float]) -> float:
    rates = []
    for _ in range(runs):
        with (
            tempfile.TemporaryDirectory(dir=base) as scratch,
            LmdbStore(Path(scratch) / "db", sync=sync) as store,
        ):
            rates.append(measure(store))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="repeats per figure (median shown)")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the scratch stores")
    parser.add_argument("--value-bytes", type=int, default=4096, help="size of each record")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.gettempdir())
    value = os.urandom(args.value_bytes)

    figures = [
        (
            "single synced commit",
            "commits/s",
            median_of(args.runs, base, True, lambda s: single_commits(s, 300, value)),
        ),
        (
            "batched puts, 100 per synced txn",
            "puts/s",
            median_of(args.runs, base, True, lambda s: batched_puts(s, 50, 100, value)),
        ),
        (
            "single commit, sync=False",
            "commits/s",
            median_of(args.runs, base, False, lambda s: single_commits(s, 2000, value)),
        ),
        (
            "batched puts, 100 per txn, sync=False",
            "puts/s",
            median_of(args.runs, base, False, lambda s: batched_puts(s, 50, 100, value)),
        ),
        (
            "point get",
            "gets/s",
            median_of(args.runs, base, True, lambda s: point_gets(s, 50_000, value)),
        ),
    ]

    table = Table(title=f"LMDB store, {args.value_bytes}-byte records, median of {args.runs} runs")
    table.add_column("operation")
    table.add_column("rate", justify="right")
    table.add_column("unit")
    for name, unit, rate in figures:
        table.add_row(name, f"{rate:,.0f}", unit)
    Console().print(table)
    print(f"scratch stores under {base}")


if __name__ == "__main__":
    main()
