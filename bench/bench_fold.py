"""Fold throughput: decode and apply a realistic 100k-event session, single core.

Builds one long fanout session (a coordinator and several workers going through lifecycle phases,
snapshot pointers, journaled side effects, async jobs, coordinator checkpoints and one resume),
encodes it with the envelope codec, then measures, as the median of five runs:

- decode + apply: what a daemon does when it folds a log it reads back;
- decode only and apply only, to see where the time goes;
- a bare baseline: msgspec decoding the same bytes into untyped objects, the floor for any codec.

Run it with ``python bench/bench_fold.py`` (``--events N`` and ``--runs N`` to change the size).
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import msgspec

from apomesh.core import envelope
from apomesh.core.definition import (
    AgentConfig,
    Budget,
    ModelSpec,
    PinnedSkill,
    ScriptTurn,
    ToolCallSpec,
)
from apomesh.core.envelope import Envelope
from apomesh.core.events import (
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    AgentSnapshotted,
    AsyncJobFinished,
    AsyncJobStarted,
    CoordinatorCheckpoint,
    Event,
    PluginPin,
    SessionEnded,
    SessionShape,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.journal import call_key
from apomesh.core.state import SessionState, apply, new_state

SESSION_ID = "bench-session"
TARGET_PER_SECOND = 200_000


def _config(role: str, name: str) -> AgentConfig:
    skill = PinnedSkill(
        name="house-style",
        body="Write plainly. Prefer short sentences. " * 8,
        digest="9f" * 32,
        resolver="catalog",
    )
    turns = [
        ScriptTurn(tool_calls=[ToolCallSpec("fs.append", {"path": "out.md", "line": "{index}"})]),
        ScriptTurn(final="done: {task}"),
    ]
    return AgentConfig(
        name=name,
        version="1.0.0",
        role=role,
        instructions="Write what you are asked, one line at a time, and keep a log of each step.",
        model=ModelSpec(provider="scripted", turns=turns),
        tools=["fs.read", "fs.append", "fs.write"],
        skills=[skill],
        budget=Budget(max_steps=10_000, max_tool_calls=10_000),
    )


def build_session(total: int, workers: int = 8) -> list[Event]:
    """A fanout session of about ``total`` events, ending with ``SessionEnded``."""
    root_config = _config("root", "writer")
    worker_config = _config("worker", "writer.worker")
    shape = SessionShape(
        coordination="fanout",
        coordination_params={"max_parallel": workers},
        root=root_config,
        roles={"worker": worker_config},
        skills=list(root_config.skills),
        plugins=[PluginPin("apomesh", "0.1.0")],
    )
    tasks = [f"section {i}" for i in range(workers)]
    events: list[Event] = [
        SessionStarted(goal="write the long report", root="root", shape=shape),
        AgentLifecycle(agent="root", phase="born", config=root_config),
        AgentLifecycle(agent="root", phase="dispatched", worker="w-0", epoch=1),
        AgentLifecycle(agent="root", phase="running"),
        AgentLifecycle(agent="root", phase="planned", plan=tasks),
    ]
    refs = [f"root/{i}" for i in range(workers)]
    for i, ref in enumerate(refs):
        events.append(
            AgentLifecycle(
                agent=ref,
                phase="born",
                parent="root",
                config=worker_config,
                task=tasks[i],
                task_index=i,
                batch="b-0",
            )
        )
        events.append(AgentLifecycle(agent=ref, phase="dispatched", worker=f"w-{i % 3}", epoch=1))
        events.append(AgentLifecycle(agent=ref, phase="running"))
    tail = workers + 2
    step = 0
    snapshot_id = 0
    resumed = False
    while len(events) < total - tail:
        step += 1
        for i, ref in enumerate(refs):
            args = {"path": f"section-{i}.md", "line": f"paragraph {step} of {tasks[i]}"}
            key = call_key("fs.append", args)
            snapshot_id += 1
            events.append(ToolCallIntent(agent=ref, key=key, tool="fs.append", args=args))
            events.append(
                ToolCallRecorded(agent=ref, key=key, tool="fs.append", outcome="ok", result="ok")
            )
            events.append(
                AgentSnapshotted(
                    agent=ref, snapshot_id=snapshot_id, source="node", step=step, size=4096
                )
            )
            if step % 5 == 0:
                job = f"{ref}:job-{step}"
                events.append(
                    AsyncJobStarted(agent=ref, job_id=job, tool="fs.read", args={"path": "a"})
                )
                events.append(AgentLifecycle(agent=ref, phase="waiting"))
                events.append(AsyncJobFinished(agent=ref, job_id=job, ok=True, result="text"))
                events.append(AgentLifecycle(agent=ref, phase="running"))
        events.append(
            CoordinatorCheckpoint(position=f"step-{step}", state=msgspec.msgpack.encode([step]))
        )
        if not resumed and len(events) > total // 2:
            resumed = True
            events.append(AgentResuming(agent=refs[0], reason="worker lost", epoch=2))
            events.append(AgentResumed(agent=refs[0], epoch=2))
    for ref in refs:
        events.append(AgentLifecycle(agent=ref, phase="completed", output=f"{ref} done"))
    events.append(AgentLifecycle(agent="root", phase="completed", output="the report"))
    events.append(SessionEnded(status="completed", output="the report"))
    return events


def encode_session(events: list[Event]) -> list[bytes]:
    ts = 1_700_000_000.0
    return [
        envelope.encode(envelope.make(SESSION_ID, i, ts + i * 0.001, f"{SESSION_ID}:{i}", ev))
        for i, ev in enumerate(events)
    ]


def decode_all(records: list[bytes]) -> list[Envelope]:
    decode = envelope.decode
    return [decode(r) for r in records]


def decode_only(records: list[bytes]) -> None:
    decode = envelope.decode
    for r in records:
        decode(r)


def apply_all(envelopes: list[Envelope]) -> SessionState:
    state = new_state(SESSION_ID)
    for env in envelopes:
        apply(state, env)
    return state


def decode_and_apply(records: list[bytes]) -> SessionState:
    decode = envelope.decode
    state = new_state(SESSION_ID)
    for r in records:
        apply(state, decode(r))
    return state


def bare_decode(records: list[bytes]) -> None:
    decode = msgspec.msgpack.Decoder().decode
    for r in records:
        decode(r)


def median_seconds(run: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        # Each run starts without the previous run's garbage; the collector stays on while timing.
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    events = build_session(options.events)
    records = encode_session(events)
    decoded = decode_all(records)
    state = apply_all(decoded)
    assert state.terminal and state.last_index == len(records) - 1
    n = len(records)
    size = sum(len(r) for r in records)
    kinds: dict[str, int] = {}
    for ev in events:
        kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1

    rows = [
        ("decode + apply", median_seconds(lambda: decode_and_apply(records), options.runs)),
        ("decode only", median_seconds(lambda: decode_only(records), options.runs)),
        ("apply only", median_seconds(lambda: apply_all(decoded), options.runs)),
        ("bare msgspec decode", median_seconds(lambda: bare_decode(records), options.runs)),
    ]
    baseline = rows[-1][1]
    print(f"session: {n} events, {size / n:.0f} B/event on average, {len(state.agents)} agents")
    print("mix: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    print(f"median of {options.runs} runs, one core\n")
    print(f"{'measure':<22}{'events/s':>12}{'us/event':>10}{'x bare':>9}")
    for name, seconds in rows:
        print(
            f"{name:<22}{n / seconds:>12,.0f}{seconds / n * 1e6:>10.2f}{seconds / baseline:>9.2f}"
        )
    fold_rate = n / rows[0][1]
    verdict = "meets" if fold_rate >= TARGET_PER_SECOND else "BELOW"
    print(f"\ndecode + apply {fold_rate:,.0f}/s {verdict} the {TARGET_PER_SECOND:,}/s target")


if __name__ == "__main__":
    main()
