"""What went wrong in one finished session, measured against the model server's record.

``audit_session`` takes a session's log (``EventRecord``s read through the SDK), the daemon's
verification of it, its workspace and the calls a ``FreshModelServer`` recorded, and counts:

- **duplicates**: an effect line (``fs.append``) or content (``fs.write``) present more often than
  once — every line the fresh model gives is new, so any line twice ran twice — plus effects of two
  *different* model answers for the same agent and step that both landed (the model was asked
  again for a step whose effect had already run, and a rephrased effect ran as well; for
  ``fs.write``, whose file keeps only the last content, an earlier write with an ``ok`` result
  counts as landed);
- **effects never run**: an intent whose logged result is ``ok`` but whose line is not in the file
  (``never_run``), and among them those of tools with a probe (``never_run_probed``), which also
  counts a probed tool's effect left ``unknown`` and absent (its probe should have resolved it);
- **lost**: the session did not end ``completed`` within the deadline;
- **undecodable**: the daemon's verification cannot fold the log;
- **output_from_model**: whether the session's output is an answer the server really gave;
- **foreign effects**: lines in the agents' files that no model answer ever carried.

It reads only plain data (records with ``kind`` and ``event``), so it is tested on planted logs.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

EFFECT_TOOLS = ("fs.append", "fs.write")
PROBED_TOOLS: frozenset[str] = frozenset({"fs.append", "fs.write"})
"""Tools that declare a probe (an unknown outcome is resolved, so none is left "never run")."""


class Record(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def event(self) -> dict[str, Any]: ...


def files_of(workspace: Path, records: list[Any], session_id: str) -> Path:
    """The directory a session's file tools act in: ``<workspace>/<session id>/``, or the shared
    workspace when its root agent asked for it (as its ``SessionStarted`` says; a log from before
    workspaces per session, or records without a start, name none: the shared one)."""
    started = next((r.event for r in records if r.kind == "SessionStarted"), None)
    scope = started["shape"]["root"].get("workspace", "shared") if started else "shared"
    return workspace if scope == "shared" else workspace / session_id


@dataclass
class Audit:
    session_id: str
    status: str
    duplicates: int = 0
    never_run: int = 0
    never_run_probed: int = 0
    lost: bool = False
    undecodable: bool = False
    output_from_model: bool | None = None
    foreign_effects: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class ModelEffect:
    """One effect a model answer carried: which agent slot and step asked for it."""

    slot: str
    step: int
    call: int


def model_effects(
    calls: list[dict[str, Any]],
) -> tuple[dict[tuple[str, str], ModelEffect], set[str]]:
    """From a server record: ``(path, line-or-content) -> ModelEffect`` and the set of every
    text answer (final, plan or synthesis content) the server gave."""
    effects: dict[tuple[str, str], ModelEffect] = {}
    texts: set[str] = set()
    for call in calls:
        answer = call.get("answer")
        if call.get("status") != 200 or not answer:
            continue
        if answer.get("content"):
            texts.add(str(answer["content"]))
        for tool_call in answer.get("tool_calls") or []:
            function = tool_call["function"]
            args = json.loads(function["arguments"])
            text = args.get("line", args.get("content"))
            if "path" in args and text is not None:
                effects[(args["path"], str(text))] = ModelEffect(
                    str(call.get("slot")), int(call.get("step", -1)), int(call["n"])
                )
    return effects, texts


def _file_lines(workspace: Path, path: str, tool: str) -> list[str]:
    target = workspace / path
    if not target.exists():
        return []
    text = target.read_text()
    return text.splitlines() if tool == "fs.append" else [text]


def audit_session(
    records: list[Record],
    verification: dict[str, Any] | None,
    workspace: Path,
    model_calls: list[dict[str, Any]] | None = None,
    *,
    session_id: str = "?",
    timed_out: bool = False,
) -> Audit:
    """Count what went wrong in one session (see the module doc); ``workspace`` is the workers'
    (the session's own directory in it is found here)."""
    workspace = files_of(workspace, records, session_id)
    ended = [r for r in records if r.kind == "SessionEnded"]
    status = str(ended[-1].event.get("status")) if ended else "running"
    audit = Audit(session_id, status)
    if status != "completed" or timed_out:
        audit.lost = True
        reason = ended[-1].event.get("reason") if ended else "not terminal within the deadline"
        audit.problems.append(f"lost: {status}: {reason}")
    problems = (verification or {}).get("problems") or []
    undecodable = [p for p in problems if p.get("kind") == "undecodable"]
    if undecodable:
        audit.undecodable = True
        audit.problems.append(f"undecodable log: {undecodable[0].get('message', '')}")
    # The intents and their results, per effect (path, text).
    intents: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    tool_of: dict[tuple[str, str], str] = {}
    outcome: dict[tuple[str, str], str] = {}
    for r in records:
        ev = r.event
        if r.kind == "ToolCallIntent" and ev.get("tool") in EFFECT_TOOLS:
            args = ev.get("args") or {}
            text = args.get("line", args.get("content"))
            effect = (str(args.get("path")), str(text))
            intents[effect].append((ev["agent"], ev["key"]))
            tool_of[effect] = ev["tool"]
        elif r.kind == "ToolCallRecorded":
            outcome[(ev["agent"], ev["key"])] = ev["outcome"]
    # What is in the files the intents name.
    present: Counter[tuple[str, str]] = Counter()
    paths = {(path, tool_of[(path, text)]) for path, text in intents}
    for path, tool in sorted(paths):
        for line in _file_lines(workspace, path, tool):
            present[(path, line)] += 1
    for effect, count in present.items():
        if count > 1:
            audit.duplicates += count - 1
            audit.problems.append(f"{effect[0]}: {effect[1]!r} is there {count} times")
    overwritten = {path for (path, _), n in present.items() if n and (path, "fs.write") in paths}
    for effect, keys in intents.items():
        if present[effect] or (tool_of[effect] == "fs.write" and effect[0] in overwritten):
            continue  # there, or a write whose file holds a later write's content
        if any(outcome.get(key) == "ok" for key in keys):
            audit.never_run += 1
            audit.never_run_probed += tool_of[effect] in PROBED_TOOLS
            audit.problems.append(f"{effect[0]}: {effect[1]!r} has an ok result but never ran")
        elif tool_of[effect] in PROBED_TOOLS and any(outcome.get(k) == "unknown" for k in keys):
            audit.never_run_probed += 1
            audit.problems.append(f"{effect[0]}: {effect[1]!r} left unknown and never ran")
    if model_calls is None:
        return audit
    given, texts = model_effects(model_calls)
    landed: dict[tuple[str, int], list[tuple[str, str]]] = defaultdict(list)
    for effect in present:
        source = given.get(effect)
        if source is None:
            audit.foreign_effects += 1
            audit.problems.append(f"{effect[0]}: {effect[1]!r} came from no model answer")
            continue
        landed[(source.slot, source.step)].append(effect)
    # A write leaves only its last content in the file: two writes asked for one step, each with
    # an ok result on the log, both ran.
    for effect, keys in intents.items():
        source = given.get(effect)
        written = tool_of[effect] == "fs.write" and any(outcome.get(k) == "ok" for k in keys)
        if source is not None and written and effect not in present:
            landed[(source.slot, source.step)].append(effect)
    for (slot, step), effects in landed.items():
        if len(effects) > 1:
            audit.duplicates += len(effects) - 1
            audit.problems.append(
                f"agent slot {slot} step {step}: {len(effects)} different answers' effects ran"
            )
    if ended and status == "completed":
        output = ended[-1].event.get("output")
        audit.output_from_model = output in texts
        if not audit.output_from_model:
            audit.problems.append(f"output {output!r} is no answer the model gave")
    return audit
