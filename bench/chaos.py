"""The long chaos run behind ``nox -s chaos``: hundreds of SIGKILLs of workers and daemons on a
real system, with a summary at the end.

A nats-server, an ``apomesh serve`` process and ``--workers`` ``apomesh worker`` processes run in
a temporary directory (heartbeats every ``--heartbeat`` s, a worker lost after three missed
beats). The run repeats, until ``--kills`` kills have been made:

- a wave of ``--concurrency`` sessions at once, each killing the worker that runs its target
  agent before, during or after one of its side-effecting calls (a fresh worker replaces each);
- every ``--daemon-every`` waves, a daemon run: a few sessions with and without side effects,
  the daemon SIGKILLed at a random moment and started again, the sessions on the recoverable
  list resumed as an operator would.

Every session is then checked (``tests/e2e/chaos_kit.py``: completed, dense and unduplicated log,
no non-idempotent call with two intents, each line in its files once, or at most once for an
unknown outcome, the daemon's verification clean). The summary prints runs, kills, sessions
completed, duplicates found and lost sessions; the exit status is 1 when a duplicate or a lost
session was found. Run ``python bench/chaos.py`` (``--kills N``, ``--seed N``, ``--quiet``).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.chaos_kit import Chaos, Tally

from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.sdk.client import Client
from apomesh.testing import Mesh


async def chaos_run(args: argparse.Namespace, mesh: Mesh, tally: Tally) -> float:
    rng = random.Random(args.seed)
    say = (lambda _text: None) if args.quiet else (lambda text: print(f"  {text}", flush=True))
    started = time.perf_counter()
    async with Client(mesh.url, reconnect_window=120) as client:
        chaos = Chaos(mesh, client, rng=rng, tally=tally, say=say)

        async def guarded(run: str, work: object) -> None:
            try:
                await work  # type: ignore[misc]
            except Exception as exc:  # a run that cannot finish is a lost session, not a crash
                tally.lost += 1
                tally.sessions += 1
                tally.problems.append(f"{run}: {type(exc).__name__}: {exc}")

        wave = 0
        while tally.kills < args.kills:
            wave += 1
            if args.daemon_every and wave % args.daemon_every == 0:
                await guarded(f"daemon run {wave}", chaos.daemon_kill_run(f"d{wave}"))
            else:
                async with anyio.create_task_group() as group:
                    for n in range(args.concurrency):
                        tag = f"w{wave}-{n}"
                        group.start_soon(guarded, tag, chaos.worker_kill_run(tag))
            live = [w for w in mesh.workers if w.proc is not None and w.proc.poll() is None]
            if not args.quiet or wave % 10 == 0:
                print(
                    f"wave {wave}: {tally.kills} kills, {tally.completed}/{tally.sessions} "
                    f"completed, {len(live)} workers alive",
                    flush=True,
                )
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200, help="stop after this many kills")
    parser.add_argument("--concurrency", type=int, default=6, help="sessions per worker wave")
    parser.add_argument("--workers", type=int, default=5, help="worker processes kept running")
    parser.add_argument("--daemon-every", type=int, default=5, help="a daemon run every N waves")
    parser.add_argument("--heartbeat", type=float, default=0.3, help="heartbeat interval, s")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--quiet", action="store_true", help="print only the waves and summary")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="apomesh-chaos-"))
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    mesh = Mesh(server, base)
    mesh.daemon.env["APOMESH_LIVENESS_HEARTBEAT_INTERVAL"] = str(args.heartbeat)
    tally = Tally()
    try:
        mesh.daemon.start()
        for _ in range(args.workers):
            mesh.worker()
        mesh.wait_workers(args.workers)
        print(
            f"chaos: {args.kills} kills, waves of {args.concurrency} sessions, {args.workers} "
            f"workers, a daemon run every {args.daemon_every} waves, heartbeat "
            f"{args.heartbeat} s x 3, seed {args.seed}; data in {base}",
            flush=True,
        )
        seconds = anyio.run(chaos_run, args, mesh, tally)
    finally:
        mesh.close()
        server.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"runs                {tally.runs}")
    print(
        f"kills               {tally.kills} ({tally.worker_kills} workers: "
        f"{', '.join(f'{n} {p}' for p, n in sorted(tally.kill_points.items()))}; "
        f"{tally.daemon_kills} daemons)"
    )
    print(f"sessions completed  {tally.completed} of {tally.sessions}")
    print(f"duplicates found    {tally.duplicates}")
    print(f"lost sessions       {tally.lost}")
    print(f"agent resumes       {tally.resumes}")
    print(f"operator resumes    {tally.operator_resumes}")
    print(f"auto-resumed        {tally.auto_resumed}")
    print(f"unknown outcomes    {tally.unknown_outcomes} (each line at most once)")
    print(f"elapsed             {seconds:.0f} s")
    for problem in tally.problems[:20]:
        print(f"problem: {problem}")
    return 1 if tally.duplicates or tally.lost or tally.problems else 0


if __name__ == "__main__":
    sys.exit(main())
