"""Test support: the ``probe`` model provider, the scripted model plus a record of every call.

Each model call appends one JSON line to the file named by the model's ``record`` option: the
exact instructions the agent loop built for the model (its own instructions and every pinned
skill body), the purpose, the task, the script position, the worker's process id and the wall time, then the
call is answered like the ``scripted`` provider would. Tests read the file to see which skill
bytes a resumed agent really ran with. Installed into the test environment by the e2e tests.

Also the ``pinprobe.mark`` tool: a side effect (one line appended to a workspace file) with no
probe, not idempotent, ``on_unknown="fail"``, for tests of the policy a tool without a probe gets. And ``probe.charge``: a side-effecting, non-idempotent tool whose unknown outcome is
held for an operator (``on_unknown = "hold"``). It appends ``id`` to ``charges.txt`` in the
workspace; with ``hang: true`` it never returns (a test kills the worker inside the call).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

from apomesh.builtin.models import SCRIPT_POSITION, ScriptedModel
from apomesh.core.definition import ModelSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import (
    Model,
    ModelProvider,
    ModelRequest,
    ModelResponse,
    Tool,
    ToolContext,
)
from apomesh.plugins.hookspecs import hookimpl


class ProbeModel:
    def __init__(self, scripted: ScriptedModel, record: str) -> None:
        self.scripted = scripted
        self.record = record

    async def respond(self, request: ModelRequest) -> ModelResponse:
        line = json.dumps(
            {
                "instructions": request.instructions,
                "purpose": request.purpose,
                "task": request.task,
                "position": request.memory.get(SCRIPT_POSITION, 0),
                "pid": os.getpid(),
                "ts": time.time(),
            }
        )
        # One write of one line with O_APPEND: lines from several workers never interleave.
        fd = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode("utf-8"))
        finally:
            os.close(fd)
        return await self.scripted.respond(request)


class ProbeProvider:
    name = "probe"

    def create(self, spec: ModelSpec) -> Model:
        record = spec.options.get("record")
        if not isinstance(record, str) or not record:
            raise DefinitionError("the probe model needs a `record` file path", where="probe model")
        return ProbeModel(ScriptedModel(spec.turns or []), record)


@hookimpl
def register_model_providers(register: Callable[[ModelProvider], None]) -> None:
    register(ProbeProvider())


async def mark(ctx: ToolContext, args: dict[str, Any]) -> str:
    target = ctx.workspace / str(args["path"])
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="utf-8") as handle:
        handle.write(f"{args['line']}\n")
    return f"marked {args['path']}"


async def charge(ctx: ToolContext, args: dict[str, object]) -> str:
    if args.get("hang"):
        await asyncio.sleep(3600)
    with open(ctx.workspace / "charges.txt", "a", encoding="utf-8") as out:
        out.write(f"{args.get('id')}\n")
    return f"charged {args.get('id')}"


@hookimpl
def register_tools(register: Callable[[Tool], None]) -> None:
    register(
        Tool(
            name="pinprobe.mark",
            description="Append one line to a workspace file (no probe).",
            run=mark,
            side_effect=True,
            idempotent=False,
            on_unknown="fail",
        )
    )
    register(
        Tool(
            name="probe.charge",
            description="Charge once (test support).",
            run=charge,
            side_effect=True,
            idempotent=False,
            on_unknown="hold",
        )
    )
