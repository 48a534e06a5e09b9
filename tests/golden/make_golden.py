"""Writes the golden session logs in this directory: recorded histories the tests replay.

Each ``*.msgpack`` file is one session's log as it sits in the event stream: a msgpack array whose
items are the envelope bytes of each entry, in index order. Three logs are realistic sessions (a solo
session completed; a fanout session whose worker was lost and whose agent was resumed, with
journaled side effects; a HITL session paused and answered) and two are deliberately broken (an index
gap, and a torn record in the middle). Everything is fixed (timestamps, ids, configs), so the output
is deterministic.

Run ``python tests/golden/make_golden.py`` only for a deliberate change to the logs themselves; a
schema change must keep the committed files readable (through an upcaster), never regenerate them.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import msgspec

from apomesh.core import envelope
from apomesh.core.definition import AgentConfig, PinnedSkill, parse_definition, role_config
from apomesh.core.events import (
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    AgentSnapshotted,
    CoordinatorCheckpoint,
    Event,
    HitlAnswered,
    HitlPaused,
    PluginPin,
    SessionEnded,
    SessionShape,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.journal import call_key, pause_key

GOLDEN_DIR = Path(__file__).resolve().parent
START_TS = 1_767_225_600.0  # 2026-01-01T00:00:00Z
PLUGINS = [PluginPin("apomesh", "0.1.0")]
HOUSE_STYLE = PinnedSkill(
    name="house-style",
    body="Write plainly. One idea per line. No exclamation marks.",
    digest="3b1f0c6e54a0d7c1b2f4a9e8d6c5b4a3928170f6e5d4c3b2a19080f7e6d5c4b3",
    resolver="catalog",
)

SOLO_TOML = """
name = "writer"
version = "1.0.0"
instructions = "Write what you are asked."
coordination = "solo"
tools = ["fs.read", "fs.append"]
skills = ["house-style"]
[model]
provider = "scripted"
turns = [
  { tool_calls = [{ tool = "fs.append", args = { path = "poem.txt", line = "the sea at dawn" } }] },
  { final = "wrote poem.txt" },
]
[budget]
max_steps = 8
"""

FANOUT_TOML = """
name = "reporter"
version = "2.0.0"
instructions = "Split the report into sections and merge them."
coordination = "fanout"
tools = ["fs.read"]
skills = ["house-style"]
[coordination_params]
max_parallel = 2
[model]
provider = "scripted"
turns = [{ plan = ["introduction", "results"] }, { final = "report: {task}" }]
[roles.worker]
instructions = "Write one section of the report."
tools = ["fs.read", "fs.append", "fs.write"]
[roles.worker.model]
provider = "scripted"
turns = [
  { tool_calls = [{ tool = "fs.append", args = { path = "report.md", line = "{task} {index}" } }] },
  { final = "done: {task}" },
]
"""

HITL_TOML = """
name = "publisher"
version = "1.2.0"
instructions = "Draft the post, ask before publishing, then publish."
coordination = "solo"
tools = ["fs.write", "hitl.ask"]
[model]
provider = "scripted"
turns = [
  { tool_calls = [{ tool = "hitl.ask", args = { question = "Publish the post?" } }] },
  { tool_calls = [{ tool = "fs.write", args = { path = "post.md", content = "Hello." } }] },
  { final = "published post.md" },
]
"""


def _configs(toml: str) -> tuple[SessionShape, AgentConfig, AgentConfig]:
    # These sessions were recorded before agents had a workspace of their own: shared.
    definition = parse_definition({**tomllib.loads(toml), "workspace": "shared"})
    skills = [HOUSE_STYLE] if definition.skills else []
    root = role_config(definition, "root", skills)
    worker = role_config(definition, "worker", skills)
    shape = SessionShape(
        coordination=definition.coordination,
        coordination_params=dict(definition.coordination_params),
        root=root,
        roles={role: role_config(definition, role, skills) for role in definition.roles},
        skills=skills,
        plugins=PLUGINS,
        source="published",
        agent=f"{definition.name}@{definition.version}",
    )
    return shape, root, worker


def _records(session_id: str, events: list[Event]) -> list[bytes]:
    return [
        envelope.encode(
            envelope.make(session_id, i, START_TS + i * 0.125, f"{session_id}:{i}", event)
        )
        for i, event in enumerate(events)
    ]


def _call(agent: str, tool: str, args: dict[str, str], result: str) -> list[Event]:
    key = call_key(tool, args)
    return [
        ToolCallIntent(agent, key, tool, args, idempotent=tool == "fs.write"),
        ToolCallRecorded(agent, key, tool, "ok", result),
    ]


def solo_completed() -> list[Event]:
    shape, root, _ = _configs(SOLO_TOML)
    return [
        SessionStarted(goal="write a two-line poem about the sea", root="root", shape=shape),
        AgentLifecycle(agent="root", phase="born", config=root),
        AgentLifecycle(agent="root", phase="dispatched", worker="w-local-0", epoch=1),
        AgentLifecycle(agent="root", phase="running"),
        *_call("root", "fs.append", {"path": "poem.txt", "line": "the sea at dawn"}, "1 line"),
        AgentSnapshotted("root", 1, "node", 1, size=912),
        AgentLifecycle(agent="root", phase="completed", output="wrote poem.txt"),
        SessionEnded(status="completed", output="wrote poem.txt"),
    ]


def fanout_resumed() -> list[Event]:
    shape, root, worker = _configs(FANOUT_TOML)
    tasks = ["introduction", "results"]
    events: list[Event] = [
        SessionStarted(goal="write the quarterly report", root="root", shape=shape),
        AgentLifecycle(agent="root", phase="born", config=root),
        AgentLifecycle(agent="root", phase="dispatched", worker="w-a", epoch=1),
        AgentLifecycle(agent="root", phase="running"),
        AgentLifecycle(agent="root", phase="planned", plan=tasks),
        CoordinatorCheckpoint(position="planned", state=msgspec.msgpack.encode({"next": 0})),
    ]
    for i, task in enumerate(tasks):
        events.append(
            AgentLifecycle(
                agent=f"root/{i}",
                phase="born",
                parent="root",
                config=worker,
                task=task,
                task_index=i,
                batch="b-0",
            )
        )
    events += [
        AgentLifecycle(agent="root", phase="waiting"),
        AgentLifecycle(agent="root/0", phase="dispatched", worker="w-a", epoch=1),
        AgentLifecycle(agent="root/1", phase="dispatched", worker="w-b", epoch=1),
        AgentLifecycle(agent="root/0", phase="running"),
        AgentLifecycle(agent="root/1", phase="running"),
        *_call("root/0", "fs.append", {"path": "report.md", "line": "introduction 0"}, "1 line"),
        AgentSnapshotted("root/0", 1, "node", 1, size=1480),
        *_call("root/1", "fs.write", {"path": "results.md", "content": "up 4%"}, "5 bytes"),
        AgentSnapshotted("root/1", 1, "node", 1, size=1502),
        # Worker w-b goes silent: root/1 is resumed from its snapshot on w-c, same ref, new epoch.
        AgentResuming("root/1", reason="worker w-b lost", worker="w-c", snapshot_id=1, epoch=2),
        AgentLifecycle(agent="root/1", phase="dispatched", worker="w-c", epoch=2),
        AgentLifecycle(agent="root/1", phase="running"),
        *_call("root/1", "fs.append", {"path": "report.md", "line": "results 1"}, "1 line"),
        AgentSnapshotted("root/1", 2, "node", 2, size=1733),
        AgentLifecycle(agent="root/1", phase="completed", output="done: results"),
        AgentResumed("root/1", epoch=2),
        AgentLifecycle(agent="root/0", phase="completed", output="done: introduction"),
        CoordinatorCheckpoint(position="joined", state=msgspec.msgpack.encode({"next": 2})),
        AgentLifecycle(agent="root", phase="running"),
        AgentLifecycle(agent="root", phase="completed", output="report: 2 sections"),
        SessionEnded(status="completed", output="report: 2 sections"),
    ]
    return events


def hitl_answered() -> list[Event]:
    shape, root, _ = _configs(HITL_TOML)
    question = "Publish the post?"
    pause_id = pause_key("root", 1, question)
    return [
        SessionStarted(goal="publish the welcome post", root="root", shape=shape),
        AgentLifecycle(agent="root", phase="born", config=root),
        AgentLifecycle(agent="root", phase="dispatched", worker="w-local-0", epoch=1),
        AgentLifecycle(agent="root", phase="running"),
        AgentSnapshotted("root", 1, "node", 1, size=640),
        HitlPaused("root", pause_id, question),
        AgentLifecycle(agent="root", phase="paused", reason=f"waiting for {pause_id}"),
        HitlAnswered(pause_id, "yes, publish it", by="alice"),
        AgentLifecycle(agent="root", phase="dispatched", worker="w-local-1", epoch=2),
        AgentLifecycle(agent="root", phase="running"),
        *_call("root", "fs.write", {"path": "post.md", "content": "Hello."}, "6 bytes"),
        AgentSnapshotted("root", 2, "node", 2, size=702),
        AgentLifecycle(agent="root", phase="completed", output="published post.md"),
        SessionEnded(status="completed", output="published post.md"),
    ]


GAP_AT = 5  # the solo log with the entry at this index missing
TORN_AT = 9  # the fanout log with this record cut short, as a torn write leaves it


def build_logs() -> dict[str, list[bytes]]:
    """Every golden log by file stem: the list of envelope records it holds."""
    solo = _records("golden-solo", solo_completed())
    fanout = _records("golden-fanout", fanout_resumed())
    torn = list(_records("golden-torn", fanout_resumed()))
    torn[TORN_AT] = torn[TORN_AT][: len(torn[TORN_AT]) // 2]
    gapped = _records("golden-gap", solo_completed())
    return {
        "solo_completed": solo,
        "fanout_resumed": fanout,
        "hitl_answered": _records("golden-hitl", hitl_answered()),
        "broken_index_gap": gapped[:GAP_AT] + gapped[GAP_AT + 1 :],
        "broken_torn_record": torn,
    }


def read_log(path: Path) -> list[bytes]:
    """The envelope records of one golden file."""
    return msgspec.msgpack.decode(path.read_bytes(), type=list[bytes])


def main() -> int:
    for stem, records in build_logs().items():
        path = GOLDEN_DIR / f"{stem}.msgpack"
        path.write_bytes(msgspec.msgpack.encode(records))
        print(f"{path.name}: {len(records)} records, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
