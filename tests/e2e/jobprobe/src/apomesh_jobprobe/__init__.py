"""Test support: effects that record every run.

``probe.deploy`` (``on_unknown = "fail"``) and ``probe.deploy_held`` (``on_unknown = "hold"``) are
daemon-side async jobs declared ``side_effect=True``; ``probe.launch`` is the same effect as a
plain side-effecting tool on the worker (``on_unknown = "hold"``). Every run appends one line (the
agent, the arguments and the process id) to ``deploys.log`` in the workspace, then waits
``settle`` seconds for the "deployment" to settle. Tests count the lines to see whether an effect
ran again, and read the process id to kill the worker in the middle of one. Installed into the
test environment by the e2e tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import anyio

from apomesh.plugins.api import Tool, ToolContext
from apomesh.plugins.hookspecs import hookimpl

RECORD = "deploys.log"


async def deploy(ctx: ToolContext, args: dict[str, Any]) -> str:
    line = json.dumps({"agent": ctx.agent, "args": args, "pid": os.getpid()})
    # One write of one line with O_APPEND: the effect is on disk before the job waits.
    fd = os.open(ctx.workspace / RECORD, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
    finally:
        os.close(fd)
    await anyio.sleep(float(args.get("settle", 0)))
    return f"deployed {args.get('version', '')}".strip()


PARAMETERS = {
    "type": "object",
    "properties": {"version": {"type": "string"}, "settle": {"type": "number"}},
}


@hookimpl
def register_tools(register: Callable[[Tool], None]) -> None:
    register(
        Tool(
            name="probe.deploy",
            description="Deploy a version (a long-running job with a side effect).",
            run=deploy,
            parameters=PARAMETERS,
            side_effect=True,
            async_job=True,
        )
    )
    register(
        Tool(
            name="probe.deploy_held",
            description="Deploy a version; an unknown outcome waits for an operator.",
            run=deploy,
            parameters=PARAMETERS,
            side_effect=True,
            async_job=True,
            on_unknown="hold",
        )
    )
    register(
        Tool(
            name="probe.launch",
            description="Launch a version (a slow effect on the worker).",
            run=deploy,
            parameters=PARAMETERS,
            side_effect=True,
            on_unknown="hold",
        )
    )
