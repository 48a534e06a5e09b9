"""A worker holds a node's report for the agent's next turn (``TurnRecorder``, ``Run.node_delay``):
against an in-memory daemon, a side-effecting step is one report (the turn's, carrying the node
before it and the turn's first intent); behind a model slower than the delay the node goes alone
at its time, while the model call still runs; a node refused then ends the dispatch with that
refusal and cuts the model call short; with no delay every node goes as it ends."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.chaos_kit import shape_of

from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.core.errors import Fenced
from apomesh.plugins.api import ModelRequest, ModelResponse, Tool
from apomesh.runtime.agent_loop import run_agent
from apomesh.runtime.protocol import (
    Done,
    JournalBegin,
    NodeReport,
    Reply,
    Report,
    Run,
    TurnReport,
)

pytestmark = pytest.mark.anyio

STEPS = 4


class Appender:
    """A read and an append a turn, ``STEPS`` turns, then the answer; turn ``slow`` waits
    ``delay`` seconds first."""

    def __init__(self, slow: int = 0, delay: float = 0.0) -> None:
        self.calls = 0
        self.slow, self.delay = slow, delay
        self.answered: list[int] = []
        self.cut_short = False

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        step = self.calls
        if step == self.slow:
            try:
                await asyncio.sleep(self.delay)
            except asyncio.CancelledError:
                self.cut_short = True
                raise
        self.answered.append(step)
        if step > STEPS:
            return ModelResponse(final="done")
        return ModelResponse(
            tool_calls=[
                ToolCallSpec("fs.read", {"path": f"k{step}"}),
                ToolCallSpec("fs.append", {"path": "p", "line": f"line {step}"}),
            ]
        )


class Provider:
    name = "scripted"

    def __init__(self, model: Appender) -> None:
        self.model = model

    def create(self, spec: ModelSpec) -> Appender:
        return self.model


class Daemon:
    """Answers every report; ``fence_nodes`` fences a node sent alone. Keeps what it got, with
    the model's progress at that moment."""

    def __init__(self, model: Appender, fence_nodes: bool = False) -> None:
        self.model = model
        self.fence_nodes = fence_nodes
        self.got: list[tuple[Report, int]] = []

    async def send(self, report: Report) -> Reply:
        self.got.append((report, len(self.model.answered)))
        if isinstance(report, NodeReport) and self.fence_nodes:
            return Reply("fenced", message="a newer epoch")
        if isinstance(report, TurnReport) and report.intent is not None:
            return Reply("ok", decision="run")
        if isinstance(report, JournalBegin):
            return Reply("ok", decision="run")
        return Reply("ok")

    def kinds(self) -> list[str]:
        out = []
        for report, _ in self.got:
            kind = type(report).__name__
            if isinstance(report, TurnReport):
                kind += "+node" if report.node is not None else ""
                kind += "+intent" if report.intent is not None else ""
            out.append(kind)
        return out


async def run(tmp_path: Path, model: Appender, daemon: Daemon, node_delay: float) -> Done:
    definition = {
        "name": "appender",
        "coordination": "solo",
        "tools": ["fs.read", "fs.append"],
        "model": {"provider": "scripted", "turns": [{"final": "unused"}]},
    }
    config = shape_of(definition).root

    async def lookup(ctx: Any, args: dict[str, Any]) -> str:
        return f"read {args['path']}"

    async def append(ctx: Any, args: dict[str, Any]) -> str:
        return "appended"

    tools = {
        "fs.read": Tool("fs.read", "read", lookup),
        "fs.append": Tool("fs.append", "write", append, side_effect=True),
    }
    return await run_agent(
        Run("s-1", "root", 1, config, "act", "go", node_delay=node_delay),
        worker_id="w",
        workspace=tmp_path,
        tools=tools,
        providers={"scripted": Provider(model)},  # type: ignore[dict-item]
        supervisors=[],
        send=daemon.send,
    )


async def test_a_side_effecting_step_is_one_report_carrying_the_node_before_it(
    tmp_path: Path,
) -> None:
    model = Appender()
    daemon = Daemon(model)
    done = await run(tmp_path, model, daemon, node_delay=5.0)
    assert done.outcome == "final" and done.output == "done"
    # The first turn goes with its intent; every later turn carries the node before it; the
    # answer carries the last node. No node travels alone.
    assert daemon.kinds() == ["TurnReport+intent"] + ["TurnReport+node+intent"] * (STEPS - 1) + [
        "TurnReport+node"
    ]
    turns = [r for r, _ in daemon.got if isinstance(r, TurnReport)]
    for before, turn in itertools.pairwise(turns):
        assert turn.node is not None and turn.node.step == before.step
        (result,) = turn.node.results
        assert (result.tool, result.outcome) == ("fs.append", "ok")


async def test_behind_a_slow_model_the_node_goes_alone_at_its_time_while_the_model_runs(
    tmp_path: Path,
) -> None:
    model = Appender(slow=3, delay=0.5)
    daemon = Daemon(model)
    done = await run(tmp_path, model, daemon, node_delay=0.05)
    assert done.outcome == "final"
    alone = [(r, answered) for r, answered in daemon.got if isinstance(r, NodeReport)]
    assert len(alone) == 1
    node, answered = alone[0]
    # The second node went alone while the third turn was still being asked for...
    assert node.step == 2 and answered == 2
    # ... and that turn's report carried no node; the others did.
    assert daemon.kinds() == [
        "TurnReport+intent",
        "TurnReport+node+intent",
        "NodeReport",
        "TurnReport+intent",
        "TurnReport+node+intent",
        "TurnReport+node",
    ]


async def test_a_node_refused_at_its_time_ends_the_dispatch_and_cuts_the_model_call_short(
    tmp_path: Path,
) -> None:
    model = Appender(slow=2, delay=30.0)
    daemon = Daemon(model, fence_nodes=True)
    with pytest.raises(Fenced, match="a newer epoch"):
        await asyncio.wait_for(run(tmp_path, model, daemon, node_delay=0.05), 10)
    assert model.cut_short
    assert daemon.kinds() == ["TurnReport+intent", "NodeReport"]


async def test_with_no_delay_every_node_goes_as_it_ends(tmp_path: Path) -> None:
    model = Appender()
    daemon = Daemon(model)
    done = await run(tmp_path, model, daemon, node_delay=0.0)
    assert done.outcome == "final"
    assert daemon.kinds() == ["TurnReport+intent", "NodeReport"] * STEPS + ["TurnReport"]
