"""The long chaos run behind ``nox -s chaos``: hundreds of SIGKILLs of workers, daemons and
nats-servers on a real system answered by a model that never repeats itself, with a summary.

A nats-server, an ``apomesh serve`` process, ``--workers`` ``apomesh worker`` processes and a
fresh-model server (``python -m tests.fakes.fresh_model``, an OpenAI-compatible server whose every
answer carries new arguments) run in a temporary directory. Until ``--kills`` kills have been made
(or ``--seconds`` have passed):

- a wave of ``--concurrency`` solo, fanout and refine sessions (fanout children making the same
  ``jobs.sleep`` call), each SIGKILLing the worker running one of its agents, or the daemon, after
  a random number of its events; what lands on the recoverable list is resumed;
- every ``--race-every`` waves, two operator actions at one moment through the HTTP API: two
  answers to one HITL pause, two resumes, or a resume and a cancel;
- every ``--nats-every`` waves, the nats-server SIGKILLed mid-session (store kept) and started
  again: every event a client received and every session the API acknowledged must be on the log;
- at the end, ``--cluster-runs`` runs SIGKILLing one node of a three-node cluster the same way.

Every session is audited (``tests/e2e/chaos_audit.py``) against the model server's record. The
summary prints kills, sessions, duplicates, effects never run, lost sessions, undecodable logs and
acknowledged events lost; the exit status is 1 when any of them is not 0. ``--scripted`` runs the
earlier harness instead (a deterministic scripted model, worker and daemon kills only).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.chaos_kit import Chaos, ClusterMesh, FreshChaos, FreshTally, Tally
from tests.fakes.fresh_model import fetch_log, fresh_model_spec

from apomesh.adapters.natsserver import (
    NatsServer,
    cluster,
    single_node,
    start_cluster,
    wait_jetstream_ready,
)
from apomesh.sdk.client import Client
from apomesh.testing import Mesh


async def scripted_run(args: argparse.Namespace, mesh: Mesh, tally: Tally) -> float:
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


def start_model_server(base: Path) -> tuple[subprocess.Popen[str], str]:
    """The fresh-model server as a process of its own; its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fresh_model", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=open(base / "fresh-model.log", "w"),  # noqa: SIM115
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def out_of_budget(args: argparse.Namespace, tally: FreshTally, started: float) -> bool:
    if args.seconds and time.perf_counter() - started >= args.seconds:
        return True
    return tally.kills >= args.kills


async def fresh_run(
    args: argparse.Namespace, mesh: Mesh, tally: FreshTally, model_url: str, started: float
) -> None:
    rng = random.Random(args.seed)
    say = (lambda _text: None) if args.quiet else (lambda text: print(f"  {text}", flush=True))

    def model(name: str) -> dict[str, Any]:
        return fresh_model_spec(model_url, name)

    async with Client(mesh.url, reconnect_window=120) as client:
        chaos = FreshChaos(
            mesh,
            client,
            model,
            lambda: fetch_log(model_url, requests=False),
            rng=rng,
            tally=tally,
            say=say,
        )

        async def guarded(run: str, work: Any) -> None:
            try:
                await work
            except Exception as exc:  # a run that cannot finish is a lost session, not a crash
                tally.lost += 1
                tally.sessions += 1
                tally.problems.append(f"{run}: {type(exc).__name__}: {exc}")

        wave = 0
        races = ("hitl", "resume", "resume+cancel")
        while not out_of_budget(args, tally, started):
            wave += 1
            if args.nats_every and wave % args.nats_every == 0:
                await guarded(f"nats run {wave}", chaos.nats_kill_run(f"n{wave}", [mesh.server]))
            elif args.race_every and wave % args.race_every == 0:
                kind = races[(wave // args.race_every) % len(races)]
                if kind == "hitl":
                    work = chaos.hitl_race_run(f"r{wave}")
                else:
                    work = chaos.resume_race_run(f"r{wave}", with_cancel=kind == "resume+cancel")
                await guarded(f"race {kind} {wave}", work)
            else:
                async with anyio.create_task_group() as group:
                    for n in range(args.concurrency):
                        tag = f"w{wave}-{n}"
                        group.start_soon(guarded, tag, chaos.kill_run(tag))
            live = [w for w in mesh.workers if w.proc is not None and w.proc.poll() is None]
            for _ in range(args.workers - len(live)):
                mesh.worker(f"w{len(mesh.workers)}")
            print(
                f"wave {wave}: {tally.kills} kills, {tally.completed}/{tally.sessions} completed, "
                f"{tally.duplicates} duplicates, {tally.lost} lost",
                flush=True,
            )


async def cluster_run(
    args: argparse.Namespace, mesh: ClusterMesh, tally: FreshTally, model_url: str
) -> None:
    rng = random.Random(args.seed + 1)
    say = (lambda _text: None) if args.quiet else (lambda text: print(f"  {text}", flush=True))

    def model(name: str) -> dict[str, Any]:
        return fresh_model_spec(model_url, name)

    async with Client(mesh.url, reconnect_window=120) as client:
        chaos = FreshChaos(
            mesh,
            client,
            model,
            lambda: fetch_log(model_url, requests=False),
            rng=rng,
            tally=tally,
            say=say,
        )
        for run in range(args.cluster_runs):
            try:
                await chaos.nats_kill_run(f"c{run}", list(mesh.servers))
            except Exception as exc:
                tally.lost += 1
                tally.problems.append(f"cluster run {run}: {type(exc).__name__}: {exc}")
            print(f"cluster run {run}: {tally.nats_kills} nats kills in all", flush=True)


def run_fresh(args: argparse.Namespace, base: Path) -> int:
    tally = FreshTally()
    model_proc, model_url = start_model_server(base)
    started = time.perf_counter()
    print(
        f"chaos: {args.kills} kills or {args.seconds or 'unbounded'} s, waves of "
        f"{args.concurrency} sessions, {args.workers} workers, fresh model at {model_url}, "
        f"seed {args.seed}; data in {base}",
        flush=True,
    )
    try:
        server = NatsServer(single_node(base, name="nats"))
        server.start()
        mesh = Mesh(server, base / "single")
        mesh.daemon.env["APOMESH_LIVENESS_HEARTBEAT_INTERVAL"] = str(args.heartbeat)
        try:
            mesh.daemon.start()
            for _ in range(args.workers):
                mesh.worker()
            mesh.wait_workers(args.workers)
            try:
                anyio.run(fresh_run, args, mesh, tally, model_url, started)
            except KeyboardInterrupt:  # Ctrl-C: stop here and print what was found so far
                args.cluster_runs = 0
        finally:
            mesh.close()
            server.stop()
        if args.cluster_runs:
            servers = start_cluster(cluster(base / "cluster", 3))
            try:
                anyio.run(lambda: wait_jetstream_ready(servers.urls, replicas=3))
                cmesh = ClusterMesh(list(servers), base / "cluster-mesh")
                try:
                    cmesh.daemon.start()
                    for _ in range(2):
                        cmesh.worker()
                    cmesh.wait_workers(2)
                    anyio.run(cluster_run, args, cmesh, tally, model_url)
                finally:
                    cmesh.close()
            finally:
                servers.stop()
    finally:
        model_proc.kill()
        model_proc.wait()
    print()
    for line in tally.summary():
        print(line)
    print(f"elapsed             {time.perf_counter() - started:.0f} s")
    for problem in tally.problems[: args.problems]:
        print(f"problem: {problem}")
    bad = (
        tally.duplicates
        or tally.never_run_probed
        or tally.lost
        or tally.undecodable
        or tally.acknowledged_lost
    )
    return 1 if bad else 0


def run_scripted(args: argparse.Namespace, base: Path) -> int:
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
        seconds = anyio.run(scripted_run, args, mesh, tally)
    finally:
        mesh.close()
        server.stop()
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=300, help="stop after this many kills")
    parser.add_argument("--seconds", type=float, default=0, help="or after this long (0: no limit)")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions per worker wave")
    parser.add_argument("--workers", type=int, default=4, help="worker processes kept running")
    parser.add_argument("--race-every", type=int, default=3, help="an operator race every N waves")
    parser.add_argument(
        "--nats-every", type=int, default=7, help="a nats-server kill every N waves"
    )
    parser.add_argument("--cluster-runs", type=int, default=3, help="cluster node kills at the end")
    parser.add_argument(
        "--daemon-every", type=int, default=5, help="--scripted: daemon run every N"
    )
    parser.add_argument("--heartbeat", type=float, default=0.3, help="heartbeat interval, s")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--problems", type=int, default=30, help="problems to print")
    parser.add_argument("--scripted", action="store_true", help="the scripted-model harness")
    parser.add_argument("--quiet", action="store_true", help="print only the waves and summary")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="apomesh-chaos-"))
    try:
        return run_scripted(args, base) if args.scripted else run_fresh(args, base)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
