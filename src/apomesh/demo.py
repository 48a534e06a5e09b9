"""``apomesh demo``: a whole system in one command, with a worker killed mid-run.

It starts the embedded nats-server and a daemon, launches two worker processes, runs a ``fanout``
session whose sub-agents append lines to files in the workspace, SIGKILLs the worker running a
sub-agent in the middle of its work, and prints the log as it happens: the daemon notices the
silence, appends ``AgentResuming``, re-dispatches the agent from its snapshot on the surviving
worker, serves journaled side effects from the journal and the session completes. At the end it
checks every line was written exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from apomesh.adapters.nats_connect import redact_url
from apomesh.core.envelope import Envelope
from apomesh.core.events import (
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    AgentSnapshotted,
    CoordinatorCheckpoint,
    SessionEnded,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node

STEPS = 4

DEMO_AGENT: dict[str, Any] = {
    "name": "demo-writer",
    "version": "1.0.0",
    "instructions": "Split the goal into three parts and have a sub-agent write each.",
    "coordination": "fanout",
    "coordination_params": {"max_parallel": 3},
    "model": {
        "provider": "scripted",
        "turns": [
            {"plan": ["chapter one", "chapter two", "chapter three"]},
            {"final": "three chapters written, each line exactly once"},
        ],
    },
    "roles": {
        "worker": {
            "instructions": "Write your chapter line by line.",
            "tools": ["fs.append"],
            "model": {
                "provider": "scripted",
                "turns": [
                    {
                        "delay": 0.4,
                        "tool_calls": [
                            {
                                "tool": "fs.append",
                                "args": {
                                    "path": "chapter-{index}.txt",
                                    "line": f"{{task}}: line {n}",
                                },
                            }
                        ],
                    }
                    for n in range(1, STEPS + 1)
                ]
                + [{"final": "wrote {task}"}],
            },
        }
    },
}


def describe(env: Envelope) -> str | None:
    """One printable line for an event (None for the noisy ones)."""
    ev = env.event
    if isinstance(ev, SessionStarted):
        return f"[bold]SessionStarted[/] goal={ev.goal!r} coordination={ev.shape.coordination}"
    if isinstance(ev, AgentLifecycle):
        extra = ""
        if ev.phase == "born":
            extra = f" task={ev.task!r}" if ev.parent else ""
        elif ev.phase == "dispatched":
            extra = f" -> {ev.worker} (epoch {ev.epoch})"
        elif ev.phase in ("completed", "failed", "planned"):
            extra = f" {ev.output or ev.reason or ev.plan or ''}"
        elif ev.phase == "running":
            return None
        return f"AgentLifecycle {ev.agent} [cyan]{ev.phase}[/]{extra}"
    if isinstance(ev, AgentResuming):
        return (
            f"[bold yellow]AgentResuming[/] {ev.agent} from snapshot {ev.snapshot_id} ({ev.reason})"
        )
    if isinstance(ev, AgentResumed):
        return f"[bold green]AgentResumed[/] {ev.agent} (epoch {ev.epoch})"
    if isinstance(ev, ToolCallIntent):
        return f"ToolCallIntent {ev.agent} {ev.tool} {ev.args.get('line', '')!r}"
    if isinstance(ev, ToolCallRecorded):
        return None
    if isinstance(ev, AgentSnapshotted | CoordinatorCheckpoint):
        return None
    if isinstance(ev, SessionEnded):
        return f"[bold]SessionEnded[/] {ev.status}: {ev.output or ev.reason}"
    return type(ev).__name__


async def run_demo(console: Console, nats_url: str | None = None) -> int:
    base = Path(tempfile.mkdtemp(prefix="apomesh-demo-"))
    workspace = base / "workspace"
    config = load_config(
        None,
        env={},
        overrides={
            "daemon": {"data_dir": str(base / "data"), "workers": 0, "workspace": str(workspace)},
            "liveness": {"heartbeat_interval": 0.5, "missed_beats": 3},
            "nats": {"urls": [nats_url] if nats_url else None},
        },
    )
    console.print(f"[dim]demo data in {base}[/]")
    procs: list[subprocess.Popen[bytes]] = []
    async with Node(config, http=False) as node:
        assert node.daemon is not None and node.service is not None
        daemon = node.daemon
        console.print(
            f"embedded nats-server at {redact_url(node.urls[0])}; starting 2 worker processes"
        )
        for i in range(2):
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
                        f"demo-{i}",
                        "--workspace",
                        str(workspace),
                        # The embedded server admits only known users: each worker process
                        # logs in with a credential file the daemon wrote for this start.
                        *(
                            ["--config", str(node.worker_credential_files[i])]
                            if node.worker_credential_files
                            else []
                        ),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        try:
            deadline = time.monotonic() + 60
            while len(daemon.workers.workers) < 2:
                if time.monotonic() > deadline:
                    console.print("[red]the workers did not register[/]")
                    return 1
                await asyncio.sleep(0.1)
            console.print(
                f"workers: {', '.join(sorted(w.name for w in daemon.workers.workers.values()))}"
            )
            session_id = await node.service.create_session(
                "write three chapters", agent=None, definition=DEMO_AGENT, by="demo"
            )
            console.print(f"session {session_id}")
            killed: dict[str, str] = {}

            async def killer() -> None:
                runtime = daemon.registry.writer(session_id)
                while runtime is not None and not runtime.state.terminal:
                    for agent in runtime.state.agents.values():
                        if (
                            agent.parent
                            and agent.phase == "running"
                            and agent.step >= 2
                            and agent.worker
                        ):
                            worker = daemon.workers.workers.get(agent.worker)
                            proc = next(
                                (
                                    p
                                    for i, p in enumerate(procs)
                                    if worker and worker.name == f"demo-{i}"
                                ),
                                None,
                            )
                            if proc is not None:
                                killed["agent"], killed["worker"] = agent.ref, agent.worker
                                console.print(
                                    f"[bold red]SIGKILL[/] worker {agent.worker} (pid {proc.pid}) while it runs {agent.ref}"
                                )
                                os.kill(proc.pid, signal.SIGKILL)
                                return
                    await asyncio.sleep(0.05)

            kill_task = asyncio.create_task(killer())
            status = "?"
            async for env in daemon.log.tail(session_id):
                line = describe(env)
                if line:
                    console.print(f"  {env.index:>3} {line}")
                if isinstance(env.event, SessionEnded):
                    status = env.event.status
                    break
            kill_task.cancel()
            ok = status == "completed"
            for i in range(3):
                path = workspace / session_id / f"chapter-{i}.txt"
                lines = path.read_text().splitlines() if path.exists() else []
                unique = len(set(lines)) == len(lines) == STEPS
                ok = ok and unique
                mark = "[green]exactly once[/]" if unique else "[red]WRONG[/]"
                console.print(f"{path.name}: {len(lines)} lines, {mark}")
            if not killed:
                console.print("[yellow]no worker was killed (the session finished first)[/]")
            console.print("[bold green]demo ok[/]" if ok else "[bold red]demo failed[/]")
            return 0 if ok else 1
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
