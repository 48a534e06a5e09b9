"""The chaos harness shared by ``tests/e2e/test_chaos.py`` (short runs in CI) and
``bench/chaos.py`` (hundreds of kills behind ``nox -s chaos``).

It drives a real system (a ``Mesh``: nats-server, an ``apomesh serve`` process, ``apomesh worker``
processes) through the SDK and kills its parts with SIGKILL at chosen points of a session's log:

- ``worker_kill_run``: one session whose agent appends lines to a file; the worker running a
  target agent is killed *before* a side-effecting call (during the model turn that leads to it),
  *during* it (as soon as its ``ToolCallIntent`` is on the log) or *after* it (as soon as its
  ``ToolCallRecorded`` is, before the node's snapshot), and a fresh worker replaces it;
- ``daemon_kill_run``: a few sessions with and without side effects; the daemon is killed at a
  random moment and started again; sessions on the recoverable list are resumed with
  ``apomesh recover resume ID --yes``.

Every finished session is checked the same way (``check_session``): it completed; its indexes
are dense and its event ids unique; no non-idempotent call has two intents under one agent; the
daemon's own verification agrees with its store; and every line in its files was written exactly
once, or, for a call whose outcome the log records as ``unknown``, at most once.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from tests.e2e.chaos_audit import files_of
from tests.fakes.fresh_model import fresh_model_config, fresh_model_env

from apomesh.core import envelope
from apomesh.core.definition import parse_definition
from apomesh.core.envelope import Envelope
from apomesh.core.events import (
    AgentLifecycle,
    AgentSnapshotted,
    Event,
    SessionEnded,
    SessionShape,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.journal import call_key
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.composition import compose_shape
from apomesh.sdk.client import Client, EventRecord, ServerUnavailable
from apomesh.testing import DaemonProcess, Mesh, WorkerProcess

STEP_DELAY = 0.12
"""Seconds each scripted model turn waits: the window a 'before' kill lands in."""

SESSION_DEADLINE = 90.0


# --- agent definitions ---------------------------------------------------------------------------


def _solo(name: str, tool: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "version": "1.0.0",
        "coordination": "solo",
        "tools": [tool],
        "model": {"provider": "scripted", "turns": turns},
    }


def _fanout(
    name: str, children: int, tool: str, child_turns: list[dict[str, Any]], final: str, **plan: Any
) -> dict[str, Any]:
    """A fanout of ``children`` sub-agents (tasks ``{task}-<n>``) each running ``child_turns``."""
    tasks = [f"{{task}}-{n}" for n in range(children)]
    return {
        "name": name,
        "version": "1.0.0",
        "coordination": "fanout",
        "coordination_params": {"max_parallel": children},
        "model": {"provider": "scripted", "turns": [{**plan, "plan": tasks}, {"final": final}]},
        "roles": {
            "worker": {"tools": [tool], "model": {"provider": "scripted", "turns": child_turns}}
        },
    }


def appender(steps: int = 3, delay: float = STEP_DELAY) -> dict[str, Any]:
    """A solo agent appending ``line 0..steps-1`` to ``chaos/<goal>.txt``, one call per turn."""
    return _solo("chaos-appender", "fs.append", _append_turns(steps, delay))


def fanout_appender(children: int = 3, steps: int = 3, delay: float = STEP_DELAY) -> dict[str, Any]:
    """A fanout whose sub-agents each append ``steps`` lines to ``chaos/<goal>-<n>.txt``."""
    turns = _append_turns(steps, delay)
    return _fanout("chaos-fanout-appender", children, "fs.append", turns, "all parts written")


def thinker(steps: int = 4, delay: float = STEP_DELAY) -> dict[str, Any]:
    """A solo agent without side effects: ``steps`` turns that only look around (``fs.list``),
    then an answer."""
    return _solo("chaos-thinker", "fs.list", _think_turns(steps, delay))


def fanout_thinker(children: int = 2, steps: int = 3, delay: float = STEP_DELAY) -> dict[str, Any]:
    """A fanout without side effects: sub-agents think and answer."""
    turns = _think_turns(steps, delay)
    final = "all parts thought through"
    return _fanout("chaos-fanout-thinker", children, "fs.list", turns, final, delay=delay)


def _append_turns(steps: int, delay: float) -> list[dict[str, Any]]:
    call = {"tool": "fs.append", "args": {"path": "chaos/{task}.txt", "line": ""}}
    turns: list[dict[str, Any]] = []
    for n in range(steps):
        args = {**call["args"], "line": f"{{task}} line {n}"}
        turns.append({"delay": delay, "tool_calls": [{**call, "args": args}]})
    turns.append({"final": "wrote {task}"})
    return turns


def _think_turns(steps: int, delay: float) -> list[dict[str, Any]]:
    look = {"tool": "fs.list", "args": {"path": "."}}
    turns: list[dict[str, Any]] = [
        {"delay": delay, "text": f"thinking about {{task}}, step {n}", "tool_calls": [look]}
        for n in range(steps)
    ]
    turns.append({"final": "thought about {task}"})
    return turns


# --- results -------------------------------------------------------------------------------------


@dataclass
class SessionCheck:
    """What ``check_session`` found in one finished session."""

    session_id: str
    status: str
    problems: list[str] = field(default_factory=list)
    duplicates: int = 0
    unknown_outcomes: int = 0
    resumes: int = 0
    events: int = 0
    records: list[EventRecord] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Tally:
    """Running totals of a chaos run, as ``bench/chaos.py`` prints them."""

    runs: int = 0
    worker_kills: int = 0
    daemon_kills: int = 0
    sessions: int = 0
    completed: int = 0
    duplicates: int = 0
    lost: int = 0
    unknown_outcomes: int = 0
    resumes: int = 0
    operator_resumes: int = 0
    auto_resumed: int = 0
    kill_points: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.worker_kills + self.daemon_kills

    def add(self, check: SessionCheck) -> None:
        self.sessions += 1
        self.completed += check.status == "completed"
        self.duplicates += check.duplicates
        self.lost += check.status != "completed"
        self.unknown_outcomes += check.unknown_outcomes
        self.resumes += check.resumes
        self.auto_resumed += any(
            r.kind == "SessionRecovered" and r.event.get("path") == "auto" for r in check.records
        )
        self.problems += [f"{check.session_id}: {p}" for p in check.problems]


# --- checks --------------------------------------------------------------------------------------


def check_session(
    records: list[EventRecord], verification: dict[str, Any], workspace: Path
) -> SessionCheck:
    """Every invariant a session must keep through kills and restarts (see the module doc);
    ``workspace`` is the workers' (the session's own directory in it is found here)."""
    session_id = records[0].session_id if records else "?"
    workspace = files_of(workspace, records, session_id)
    ended = [r for r in records if r.kind == "SessionEnded"]
    status = str(ended[-1].event.get("status")) if ended else "running"
    check = SessionCheck(session_id, status, events=len(records), records=records)
    problems = check.problems
    if status != "completed":
        reason = ended[-1].event.get("reason") if ended else "no SessionEnded"
        problems.append(f"ended {status}: {reason}")
    indexes = [r.index for r in records]
    if indexes != list(range(len(records))):
        problems.append(f"indexes are not dense: {indexes}")
        check.duplicates += len(indexes) - len(set(indexes))
    ids = Counter(r.event_id for r in records)
    repeated = [i for i, n in ids.items() if n > 1]
    if repeated:
        problems.append(f"event ids appear twice: {repeated}")
        check.duplicates += len(repeated)
    intents: Counter[tuple[str, str]] = Counter()
    idempotent: set[tuple[str, str]] = set()
    outcome: dict[tuple[str, str], str] = {}
    lines: dict[tuple[str, str], tuple[str, str]] = {}
    for r in records:
        ev = r.event
        if r.kind == "ToolCallIntent":
            key = (ev["agent"], ev["key"])
            # A second intent its probe found never happened runs the call for the first time.
            intents[key] += ev.get("resolution") != "not_happened"
            if ev.get("idempotent"):
                idempotent.add(key)
            if ev["tool"] == "fs.append":
                lines[key] = (ev["args"]["path"], ev["args"]["line"])
        elif r.kind == "ToolCallRecorded":
            outcome[(ev["agent"], ev["key"])] = ev["outcome"]
        elif r.kind == "AgentResuming":
            check.resumes += 1
    for key, count in intents.items():
        if count > 1 and key not in idempotent:
            problems.append(f"{key[0]} logged {count} intents for one non-idempotent call")
            check.duplicates += count - 1
    check.unknown_outcomes = sum(1 for o in outcome.values() if o == "unknown")
    files: dict[str, Counter[str]] = {}
    for key, (path, line) in lines.items():
        if path not in files:
            target = workspace / path
            files[path] = Counter(target.read_text().splitlines() if target.exists() else [])
        seen = files[path][line]
        if outcome.get(key) == "unknown":
            if seen > 1:
                problems.append(f"{path}: {line!r} written {seen} times (outcome unknown)")
                check.duplicates += seen - 1
        elif outcome.get(key) == "ok" and seen != 1:
            problems.append(f"{path}: {line!r} written {seen} times, expected once")
            check.duplicates += max(0, seen - 1)
        elif outcome.get(key) is None and seen > 1:
            problems.append(f"{path}: {line!r} written {seen} times with no result logged")
            check.duplicates += seen - 1
    logged = {line for path, line in lines.values()}
    for path, counts in files.items():
        for line in counts:
            if line not in logged:
                problems.append(f"{path}: {line!r} is in the file but no intent is on the log")
    if not verification.get("ok"):
        kinds = [p.get("kind") for p in verification.get("problems", [])]
        problems.append(f"verification disagrees: {kinds}")
    return check


# --- the worker pool -----------------------------------------------------------------------------


class WorkerPool:
    """The mesh's worker processes by name; a killed worker is replaced by a fresh one."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.kills = 0

    def by_id(self, worker_id: str) -> WorkerProcess | None:
        name = worker_id.rsplit("-", 1)[0]
        for worker in self.mesh.workers:
            if worker.name == name:
                return worker
        return None

    def kill(self, worker_id: str, *, replace: bool = True) -> bool:
        """SIGKILL the worker process behind ``worker_id``; start a fresh one in its place, with
        the same config file."""
        worker = self.by_id(worker_id)
        if worker is None or worker.proc is None or worker.proc.poll() is not None:
            return False
        worker.kill()
        self.kills += 1
        if replace:
            self.mesh.worker(f"w{len(self.mesh.workers)}", config=worker.config)
        return True


# --- runs ----------------------------------------------------------------------------------------


KILL_POINTS = ("before", "during", "after")


def _is(record: EventRecord, kind: str, agent: str) -> bool:
    return record.kind == kind and record.event.get("agent") == agent


class Chaos:
    """Runs kill scenarios against one mesh through one SDK client."""

    def __init__(
        self,
        mesh: Mesh,
        client: Client,
        *,
        rng: random.Random,
        tally: Tally | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.mesh = mesh
        self.client = client
        self.rng = rng
        self.pool = WorkerPool(mesh)
        self.tally = tally or Tally()
        self.say = say or (lambda _text: None)
        self._daemon_lock = anyio.Lock()

    async def finish(self, session_id: str, records: list[EventRecord]) -> SessionCheck:
        """Read the rest of the session's log (until it ends) and check it."""
        if not records or records[-1].kind != "SessionEnded":
            after = records[-1].index if records else -1
            with anyio.fail_after(SESSION_DEADLINE):
                async for record in self.client.events(session_id, after=after):
                    records.append(record)
        verification = await self.client.verify_session(session_id)
        return check_session(records, verification, self.mesh.daemon.workspace)

    async def worker_kill_run(self, tag: str, point: str | None = None) -> SessionCheck:
        """One session, one SIGKILL of the worker running its target agent at ``point``."""
        rng = self.rng
        point = point or rng.choice(KILL_POINTS)
        steps = 3
        fanout = rng.random() < 0.4
        definition = fanout_appender(3, steps) if fanout else appender(steps)
        target = f"root/{rng.randrange(3)}" if fanout else "root"
        call = rng.randrange(steps - 1)
        session_id = await self.client.start_session(tag, definition=definition)
        self.tally.runs += 1
        records: list[EventRecord] = []
        worker_of: dict[str, str] = {}
        seen: Counter[str] = Counter()
        killed = armed = False
        with anyio.fail_after(SESSION_DEADLINE):
            async for record in self.client.events(session_id):
                records.append(record)
                ev = record.event
                if record.kind == "AgentLifecycle" and ev.get("phase") == "dispatched":
                    worker_of[ev["agent"]] = ev["worker"]
                # When another run already killed the target's worker, the kill waits for the
                # target's next step on its next worker.
                rearmed = armed and ev.get("agent") == target and record.kind != "AgentLifecycle"
                if not killed and (rearmed or self._reached(record, point, target, call, seen)):
                    if point == "before":
                        await anyio.sleep(rng.uniform(0.0, STEP_DELAY * 0.6))
                    killed = self.pool.kill(worker_of[target])
                    armed = not killed
                    if killed:
                        self.tally.worker_kills += 1
                        self.tally.kill_points[point] += 1
                if record.kind == "SessionEnded":
                    break
        check = await self.finish(session_id, records)
        if killed:
            resumed = [r for r in records if _is(r, "AgentResuming", target)]
            done = [r for r in records if _is(r, "AgentResumed", target)]
            if not resumed or not done:
                check.problems.append(
                    f"{target} was on a killed worker but the log has {len(resumed)} "
                    f"AgentResuming and {len(done)} AgentResumed"
                )
        self.tally.add(check)
        self.say(
            f"worker kill {point:<6} {'fanout' if fanout else 'solo':<6} {target:<7} call {call}: "
            f"{check.status}, {check.resumes} resume(s), {check.unknown_outcomes} unknown"
        )
        return check

    @staticmethod
    def _reached(
        record: EventRecord, point: str, target: str, call: int, seen: Counter[str]
    ) -> bool:
        ev = record.event
        if point == "before":
            if call == 0:
                return _is(record, "AgentLifecycle", target) and ev.get("phase") == "dispatched"
            return _is(record, "AgentSnapshotted", target) and ev.get("step") == call
        kind = "ToolCallIntent" if point == "during" else "ToolCallRecorded"
        if not _is(record, kind, target):
            return False
        seen[kind] += 1
        return seen[kind] == call + 1

    async def daemon_kill_run(self, tag: str, *, cli_resume: bool = True) -> list[SessionCheck]:
        """A few sessions; SIGKILL the daemon at a random moment, start it again, resume what is
        on the recoverable list, and check every session."""
        rng = self.rng
        plans = {
            f"{tag}-think": thinker(4),
            f"{tag}-fanthink": fanout_thinker(2, 3),
            f"{tag}-append": appender(5),
        }
        if rng.random() < 0.5:
            plans[f"{tag}-fanappend"] = fanout_appender(2, 3)
        ids = {
            goal: await self.client.start_session(goal, definition=definition)
            for goal, definition in plans.items()
        }
        self.tally.runs += 1
        await anyio.sleep(rng.uniform(0.05, 0.9))
        async with self._daemon_lock:
            await anyio.to_thread.run_sync(self.mesh.daemon.kill)
            self.tally.daemon_kills += 1
            await anyio.to_thread.run_sync(self.mesh.daemon.start)
        recoverable = {r.session_id: r for r in await self.client.list_recoverable()}
        problems: dict[str, list[str]] = {sid: [] for sid in ids.values()}
        resumed: set[str] = set()
        for session_id, rec in recoverable.items():
            if session_id not in problems:
                continue
            if rec.side_effects == 0:
                problems[session_id].append(f"recoverable without side effects: {rec.reason}")
            await self.resume(session_id, cli=cli_resume)
            resumed.add(session_id)
            self.tally.operator_resumes += 1
        checks = []
        for goal, session_id in ids.items():
            check = await self.finish(session_id, [])
            check.problems += problems[session_id]
            check.problems += self._recovery_problems(check.records, session_id in resumed)
            self.tally.add(check)
            checks.append(check)
            self.say(
                f"daemon kill {goal:<22} {check.status}"
                f"{' after recover resume' if session_id in resumed else ''}, "
                f"{check.unknown_outcomes} unknown"
            )
        return checks

    @staticmethod
    def _recovery_problems(records: list[EventRecord], resumed: bool) -> list[str]:
        """An auto-resumed session had no side effect logged when it was taken up again; an
        operator resume happened only where one was asked for."""
        problems = []
        intents = 0
        for record in records:
            if record.kind == "ToolCallIntent":
                intents += 1
            if record.kind != "SessionRecovered":
                continue
            path = record.event.get("path")
            if path == "auto" and intents:
                problems.append(f"auto-resumed at {record.index} with {intents} side effect(s)")
            if path == "operator" and not resumed:
                problems.append("resumed by an operator nobody asked for")
        return problems

    async def resume(self, session_id: str, *, cli: bool) -> str:
        """Resume a recoverable session, as an operator would: ``apomesh recover resume``."""
        if not cli:
            await self.client.resume(session_id)
            return ""
        args = [
            sys.executable, "-m", "apomesh", "recover", "resume", session_id, "--yes",
            "--url", self.mesh.url,
        ]  # fmt: skip
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                args,
                capture_output=True,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "COLUMNS": "200"},
            )
        )
        if done.returncode != 0:
            raise AssertionError(f"recover resume exited {done.returncode}: {done.stderr}")
        return done.stdout


# --- sessions written straight to the log ----------------------------------------------------------


def stored_session(
    session_id: str,
    shape: SessionShape,
    *,
    goal: str = "stored",
    events: int = 20,
    side_effect: tuple[str, dict[str, Any], bool] | None = None,
    open_intent: tuple[str, dict[str, Any]] | None = None,
    terminal: bool = False,
    ts: float = 1_700_000_000.0,
) -> list[Envelope]:
    """The log of a session a daemon was driving when it died, ``events`` envelopes long: its
    bootstrap, a running root agent with node snapshots, and, as asked, a journaled side effect
    (``side_effect`` = tool, args, idempotent), an intent with no result (``open_intent``), or a
    terminal end. Snapshot pointers name no stored record (the daemon that wrote them is gone)."""
    head: list[Event] = [
        SessionStarted(goal=goal, root="root", shape=shape),
        AgentLifecycle("root", "born", config=shape.root, task=goal, task_index=0),
        AgentLifecycle("root", "dispatched", worker="gone-0", epoch=1, purpose="act"),
        AgentLifecycle("root", "running", worker="gone-0"),
    ]
    tail: list[Event] = []
    if side_effect is not None:
        tool, args, idempotent = side_effect
        key = call_key(tool, args)
        tail += [
            ToolCallIntent("root", key, tool, args, idempotent=idempotent),
            ToolCallRecorded("root", key, tool, "ok", "done"),
        ]
    if open_intent is not None:
        tool, args = open_intent
        tail.append(ToolCallIntent("root", call_key(tool, args), tool, args))
    if terminal:
        tail += [
            AgentLifecycle("root", "completed", output="done", purpose="act"),
            SessionEnded(status="completed", output="done"),
        ]
    middle = max(0, events - len(head) - len(tail))
    body: list[Event] = [
        AgentSnapshotted("root", snapshot_id=n + 1, source="node", step=n + 1)
        for n in range(middle)
    ]
    return [
        envelope.make(session_id, index, ts + index * 0.01, uuid.uuid4().hex, event)
        for index, event in enumerate(head + body + tail)
    ]


def shape_of(definition: dict[str, Any], host: PluginHost | None = None) -> SessionShape:
    """The pinned shape a daemon with ``host``'s plugins (default: what is installed) composes."""
    return compose_shape(
        parse_definition(definition), host=host or PluginHost(), skills=[], source="inline"
    )


# --- runs on a nondeterministic model ------------------------------------------------------------
#
# The agents below are answered by a ``FreshModelServer`` (``tests/fakes/fresh_model.py``) that
# never repeats itself, so a step asked of the model twice gets a different effect; every session
# is audited against the server's record (``tests/e2e/chaos_audit.py``).

ModelTable = Callable[[str], dict[str, Any]]
"""Model name -> the ``[model]`` table reaching the fresh server (``fresh_model_spec``)."""


def use_fresh_model(mesh: Mesh, base_url: str) -> Path:
    """Configure the mesh's daemon and workers with the fresh-model credential: a config file
    (``fresh_model_config``) given to the daemon and to every worker with ``--config``, and the
    key's variable in their environment. A running daemon is restarted and running workers are
    replaced by as many configured ones; workers started later take ``config=`` the file
    answered (``WorkerPool`` replaces a killed worker with one like it)."""
    config = Path(mesh.base) / "fresh-model.toml"
    config.write_text(fresh_model_config(base_url))
    mesh.env.update(fresh_model_env())
    mesh.daemon.env.update(fresh_model_env())
    mesh.daemon.extra_args = (*mesh.daemon.extra_args, "--config", str(config))
    running = [w for w in mesh.workers if w.proc is not None and w.proc.poll() is None]
    for worker in mesh.workers:
        worker.stop()
    mesh.workers.clear()
    if mesh.daemon.pid is not None:
        mesh.daemon.restart()
    for _ in running:
        mesh.worker(config=config)
    if running:
        mesh.wait_workers(len(running))
    return config


def fresh_solo(
    model: ModelTable, *, appends: int = 3, reads: int = 1, asks: int = 0
) -> dict[str, Any]:
    """A solo agent making ``appends`` fresh ``fs.append`` calls (and ``asks`` questions first)."""
    tools = ["fs.append", "fs.list"] + (["ask_human"] if asks else [])
    return {
        "name": "fresh-solo",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": tools,
        "model": model(f"fresh:appends={appends},reads={reads},asks={asks}"),
    }


def fresh_fanout(
    model: ModelTable, *, children: int = 2, appends: int = 2, jobs: int = 1
) -> dict[str, Any]:
    """A fanout of ``children`` sub-agents, each making the same ``jobs.sleep {"seconds": 1}``
    call ``jobs`` times, then ``appends`` fresh appends."""
    return {
        "name": "fresh-fanout",
        "version": "1.0.0",
        "coordination": "fanout",
        "coordination_params": {"max_parallel": children},
        "model": model(f"fresh:plan={children}"),
        "roles": {
            "worker": {
                "tools": ["fs.append", "fs.list", "jobs.sleep"],
                "model": model(f"fresh:appends={appends},jobs={jobs},reads=1"),
            }
        },
    }


def fresh_refine(model: ModelTable, *, children: int = 2, appends: int = 1) -> dict[str, Any]:
    """A refine loop: a fresh plan of ``children`` sub-tasks, each appending, then a critique."""
    return {
        "name": "fresh-refine",
        "version": "1.0.0",
        "coordination": "refine",
        "coordination_params": {"max_parallel": children, "max_iterations": 2},
        "model": model(f"fresh:plan={children}"),
        "roles": {
            "worker": {
                "tools": ["fs.append", "fs.write"],
                "model": model(f"fresh:appends={appends},writes=1"),
            }
        },
    }


@dataclass
class FreshTally:
    """Totals of a chaos run on the fresh model, as the summary prints them."""

    worker_kills: int = 0
    daemon_kills: int = 0
    nats_kills: int = 0
    sessions: int = 0
    completed: int = 0
    duplicates: int = 0
    never_run: int = 0
    never_run_probed: int = 0
    lost: int = 0
    undecodable: int = 0
    output_not_from_model: int = 0
    foreign_effects: int = 0
    races: Counter[str] = field(default_factory=Counter)
    race_refusals: Counter[str] = field(default_factory=Counter)
    acknowledged_lost: int = 0
    shapes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.worker_kills + self.daemon_kills + self.nats_kills

    def add(self, audit: Any, shape: str) -> None:
        self.sessions += 1
        self.shapes[shape] += 1
        self.completed += audit.status == "completed"
        self.duplicates += audit.duplicates
        self.never_run += audit.never_run
        self.never_run_probed += audit.never_run_probed
        self.lost += audit.lost
        self.undecodable += audit.undecodable
        self.output_not_from_model += audit.output_from_model is False
        self.foreign_effects += audit.foreign_effects
        self.problems += [f"{shape} {audit.session_id}: {p}" for p in audit.problems]

    def summary(self) -> list[str]:
        return [
            f"kills               {self.kills} ({self.worker_kills} workers, "
            f"{self.daemon_kills} daemons, {self.nats_kills} nats-servers)",
            f"sessions            {self.sessions} ({', '.join(f'{n} {s}' for s, n in sorted(self.shapes.items()))})",
            f"completed           {self.completed}",
            f"duplicates          {self.duplicates}",
            f"effects never run   {self.never_run_probed} for tools with probes; "
            f"{self.never_run} ok-but-absent in all",
            f"lost sessions       {self.lost}",
            f"undecodable logs    {self.undecodable}",
            f"output not from the model {self.output_not_from_model}",
            f"effects from no model answer {self.foreign_effects}",
            f"acknowledged events lost {self.acknowledged_lost}",
            f"operator races      {dict(self.races)} (refused: {dict(self.race_refusals)})",
        ]


class FreshChaos:
    """Kill scenarios on sessions answered by a fresh-model server, each session audited."""

    def __init__(
        self,
        mesh: Mesh,
        client: Client,
        model: ModelTable,
        model_log: Callable[[], list[dict[str, Any]]],
        *,
        rng: random.Random,
        tally: FreshTally | None = None,
        say: Callable[[str], None] | None = None,
        deadline: float = SESSION_DEADLINE,
    ) -> None:
        self.mesh = mesh
        self.client = client
        self.model = model
        self.model_log = model_log
        self.rng = rng
        self.pool = WorkerPool(mesh)
        self.tally = tally or FreshTally()
        self.say = say or (lambda _text: None)
        self.deadline = deadline
        self._daemon_lock = anyio.Lock()

    # --- pieces --------------------------------------------------------------------------------

    def definition(self, shape: str) -> dict[str, Any]:
        if shape == "fanout":
            return fresh_fanout(self.model, children=self.rng.choice((2, 3)))
        if shape == "refine":
            return fresh_refine(self.model)
        return fresh_solo(self.model, appends=self.rng.choice((2, 3, 4)))

    async def start_with_retry(self, goal: str, definition: dict[str, Any]) -> str:
        """Start a session, retrying a refusal (503) for a while as a client would: a cluster
        that has just lost a node may not have a stream leader yet. Goals must be unique in a
        run: the fresh model names an agent's files after its task."""
        for _ in range(30):
            try:
                return await self.client.start_session(goal, definition=definition)
            except ServerUnavailable as exc:
                self.say(f"start {goal!r} refused, retrying: {exc}")
                await anyio.sleep(1.0)
        return await self.client.start_session(goal, definition=definition)

    async def kill_daemon(self) -> None:
        async with self._daemon_lock:
            await anyio.to_thread.run_sync(self.mesh.daemon.kill)
            self.tally.daemon_kills += 1
            await anyio.to_thread.run_sync(self.mesh.daemon.start)

    async def read_log(self, session_id: str) -> list[EventRecord]:
        """The session's events up to its current last index."""
        last = (await self.client.get_session(session_id)).last_index
        records: list[EventRecord] = []
        if last < 0:
            return records
        with anyio.fail_after(60):
            async for record in self.client.events(session_id):
                records.append(record)
                if record.index >= last:
                    break
        return records

    async def settle(self, session_id: str, *, accept: tuple[str, ...] = ("completed",)) -> bool:
        """Until the session is terminal (resuming it, as an operator would, whenever it is on
        the recoverable list); False when the deadline passed first."""
        deadline = anyio.current_time() + self.deadline
        said = ""
        while anyio.current_time() < deadline:
            try:
                view = await self.client.get_session(session_id)
                if view.status in ("completed", "failed", "cancelled"):
                    return True
                recoverable = {r.session_id for r in await self.client.list_recoverable()}
                if session_id in recoverable:
                    await self.client.resume(session_id)
            except Exception as exc:  # a refused resume or a restarting daemon: try again
                if str(exc) != said:
                    self.say(f"settle {session_id}: {type(exc).__name__}: {exc}")
                said = str(exc)
            await anyio.sleep(0.5)
        return False

    async def audit(
        self,
        session_id: str,
        shape: str,
        *,
        in_time: bool,
        accept: tuple[str, ...] = ("completed",),
    ) -> Any:
        from tests.e2e.chaos_audit import audit_session

        records: list[EventRecord] = []
        verification: Any = None
        failure = "no answer within 30 s"
        with anyio.move_on_after(30):  # a daemon restarting under the run answers a moment later
            while True:
                try:
                    records = await self.read_log(session_id)
                    verification = await self.client.verify_session(session_id)
                    break
                except Exception as exc:  # an undecodable log fails every time, not once
                    failure = f"{type(exc).__name__}: {exc}"
                    await anyio.sleep(1)
        if verification is None:
            records, verification = [], {"problems": [{"kind": "undecodable", "message": failure}]}
        result = audit_session(
            records,
            verification,
            self.mesh.daemon.workspace,
            await anyio.to_thread.run_sync(self.model_log),
            session_id=session_id,
            timed_out=not in_time,
        )
        if result.lost and result.status in accept and in_time:
            result.lost = False
            result.problems = [p for p in result.problems if not p.startswith("lost:")]
        self.tally.add(result, shape)
        for problem in result.problems:  # as they are found, so a long run can be looked into
            print(f"  problem {shape} {session_id}: {problem}", flush=True)
        self.say(
            f"{shape:<14} {session_id[:12]} {result.status:<9} dup {result.duplicates} "
            f"never-run {result.never_run} lost {int(result.lost)} "
            f"undecodable {int(result.undecodable)} output-from-model {result.output_from_model}"
        )
        return result

    # --- runs ----------------------------------------------------------------------------------

    async def kill_run(self, tag: str, shape: str | None = None) -> Any:
        """One session; SIGKILL the worker running an agent of it (or, one time in five, the
        daemon) after a random number of its events, or at its n-th side-effecting call's intent
        or result; resume what lands on the recoverable list."""
        rng = self.rng
        shape = shape or rng.choice(("solo", "fanout", "refine"))
        session_id = await self.client.start_session(
            f"{tag} {shape}", definition=self.definition(shape)
        )
        # At the n-th event of a kind: any event, or right at a side-effecting call's intent or
        # result (where a model asked again for the cut-short step rephrases the effect).
        trigger = rng.choice(("AnyEvent", "ToolCallIntent", "ToolCallRecorded"))
        kill_at = rng.randrange(3, 30) if trigger == "AnyEvent" else rng.randrange(1, 4)
        worker_of: dict[str, str] = {}
        seen = 0
        try:
            with anyio.fail_after(self.deadline):
                async for record in self.client.events(session_id):
                    ev = record.event
                    if record.kind == "AgentLifecycle" and ev.get("phase") == "dispatched":
                        worker_of[ev["agent"]] = ev["worker"]
                    seen += trigger in ("AnyEvent", record.kind)
                    if seen == kill_at and trigger in ("AnyEvent", record.kind):
                        agent = ev.get("agent")
                        if rng.random() < 0.2 or agent not in worker_of:
                            await self.kill_daemon()
                            break
                        if self.pool.kill(worker_of[agent]):
                            self.tally.worker_kills += 1
                    if record.kind == "SessionEnded":
                        break
        except TimeoutError:
            pass
        in_time = await self.settle(session_id)
        return await self.audit(session_id, shape, in_time=in_time)

    async def _post_pair(
        self, first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]]
    ) -> list[int]:
        import httpx

        statuses = [0, 0]

        async def post(n: int, path: str, body: dict[str, Any]) -> None:
            async with httpx.AsyncClient(base_url=self.mesh.url, timeout=30) as http:
                try:
                    statuses[n] = (await http.post(path, json=body)).status_code
                except httpx.HTTPError:
                    statuses[n] = -1

        async with anyio.create_task_group() as group:
            group.start_soon(post, 0, *first)
            group.start_soon(post, 1, *second)
        return statuses

    async def hitl_race_run(self, tag: str) -> Any:
        """Two answers to one HITL pause at the same moment; the session must complete."""
        definition = fresh_solo(self.model, appends=2, asks=1)
        session_id = await self.client.start_session(f"{tag} ask", definition=definition)
        pause_id = ""
        with anyio.fail_after(self.deadline):
            async for record in self.client.events(session_id):
                if record.kind == "HitlPaused":
                    pause_id = record.event["pause_id"]
                    break
                if record.kind == "SessionEnded":
                    break
        if pause_id:
            path = f"/v1/sessions/{session_id}/hitl/{pause_id}"
            statuses = await self._post_pair(
                (path, {"answer": f"first {uuid.uuid4().hex}"}),
                (path, {"answer": f"second {uuid.uuid4().hex}"}),
            )
            self.tally.races["hitl+hitl"] += 1
            self.tally.race_refusals["hitl+hitl"] += sum(s >= 400 for s in statuses)
        in_time = await self.settle(session_id)
        return await self.audit(session_id, "race hitl", in_time=in_time)

    async def resume_race_run(self, tag: str, *, with_cancel: bool) -> Any:
        """A session with side effects cut by a daemon SIGKILL; once it is recoverable, two
        resumes (or a resume and a cancel) at the same moment."""
        definition = fresh_solo(self.model, appends=4)
        session_id = await self.client.start_session(f"{tag} resume", definition=definition)
        with anyio.fail_after(self.deadline):
            async for record in self.client.events(session_id):
                if record.kind == "ToolCallRecorded" or record.kind == "SessionEnded":
                    break
        await self.kill_daemon()
        name = "resume+cancel" if with_cancel else "resume+resume"
        with anyio.move_on_after(15):
            while session_id not in {r.session_id for r in await self.client.list_recoverable()}:
                await anyio.sleep(0.2)
            base = f"/v1/sessions/{session_id}"
            second = (
                (f"{base}/cancel", {}) if with_cancel else (f"{base}/resume", {"confirm": True})
            )
            statuses = await self._post_pair((f"{base}/resume", {"confirm": True}), second)
            self.tally.races[name] += 1
            self.tally.race_refusals[name] += sum(s >= 400 for s in statuses)
        accept = ("completed", "cancelled") if with_cancel else ("completed",)
        in_time = await self.settle(session_id, accept=accept)
        return await self.audit(session_id, f"race {name}", in_time=in_time, accept=accept)

    async def nats_kill_run(
        self, tag: str, servers: list[Any], *, sessions: int = 3, down: float = 2.0
    ) -> list[Any]:
        """Sessions running while one nats-server of ``servers`` is SIGKILLed (its store kept) and
        started again: every event a client received before (an SSE frame) and every session
        the API acknowledged (201) must be on the log afterwards."""
        rng = self.rng
        shapes = [rng.choice(("solo", "fanout", "refine")) for _ in range(sessions)]
        ids = [
            await self.start_with_retry(f"{tag} nats {n} {s}", self.definition(s))
            for n, s in enumerate(shapes)
        ]
        received: dict[str, list[tuple[int, str]]] = {sid: [] for sid in ids}

        async def follow(session_id: str) -> None:
            with anyio.move_on_after(self.deadline):
                async for record in self.client.events(session_id):
                    received[session_id].append((record.index, record.event_id))
                    if record.kind == "SessionEnded":
                        return

        async with anyio.create_task_group() as group:
            for sid in ids:
                group.start_soon(follow, sid)
            await anyio.sleep(rng.uniform(0.5, 2.5))
            victim = rng.choice(servers)
            await anyio.to_thread.run_sync(victim.kill)
            self.tally.nats_kills += 1
            await anyio.sleep(down)
            await anyio.to_thread.run_sync(victim.start)
        audits = []
        for session_id, shape in zip(ids, shapes, strict=True):
            in_time = await self.settle(session_id)
            try:
                on_log = {(r.index, r.event_id) for r in await self.read_log(session_id)}
            except Exception as exc:
                on_log = set()
                self.tally.problems.append(f"nats {session_id}: cannot read the log: {exc}")
            missing = [frame for frame in received[session_id] if frame not in on_log]
            if missing or not on_log:
                self.tally.acknowledged_lost += len(missing) or 1
                self.tally.problems.append(
                    f"nats {session_id}: {len(missing)} received events not on the log"
                    + ("" if on_log else " (no log for an acknowledged session)")
                )
            audits.append(await self.audit(session_id, f"nats {shape}", in_time=in_time))
        return audits


class ClusterMesh(Mesh):
    """A ``Mesh`` on a three-node cluster: the daemon asks for three-replica streams and every
    process is given all three URLs."""

    def __init__(self, servers: list[Any], base: Path) -> None:
        super().__init__(servers[0], base)
        self.servers = servers
        urls = [s.url for s in servers]
        self.daemon = DaemonProcess(urls, base / "daemon", extra_args=("--replicas", "3"))

    def worker(
        self, name: str | None = None, *, env: dict[str, str] | None = None, config: Any = None
    ) -> WorkerProcess:
        worker = WorkerProcess(
            [s.url for s in self.servers],
            self.daemon.workspace,
            name or f"w{len(self.workers)}",
            env={**self.env, **(env or {})},
            config=config,
        )
        worker.start()
        self.workers.append(worker)
        return worker
