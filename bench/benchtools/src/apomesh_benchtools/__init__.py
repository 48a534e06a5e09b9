"""The two tools of the standard durable-agent workload (``bench/bench_workload.py``).

``bench.lookup`` is read-only: it answers a fixed-size record for a key. ``bench.append`` is a
side effect: it appends one fixed-width line to ``bench/<session>.log`` in the workspace with
``O_APPEND`` and no fsync, the session's file opened once and kept open (the naive floor does
the very same write, on a file it opens once a session). Its probe answers whether
a call's line is in the file, so a call cut off between its intent and its result (a kill -9) is
run again only if its line was never written: recovery then leaves no effect unrun and none twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apomesh.plugins.api import ProbeResult, Tool, ToolContext
from apomesh.plugins.hookspecs import hookimpl

LINE_WIDTH = 64
OPEN_FILES = 256
_files: dict[tuple[Path, str], int] = {}
"""Session files kept open for appending, the most recently opened last (at most
``OPEN_FILES``, the oldest closed first)."""


def line_for(session: str, step: int) -> bytes:
    """The fixed-width line step ``step`` of ``session`` appends."""
    return f"{session} step {step}".ljust(LINE_WIDTH - 1)[: LINE_WIDTH - 1].encode() + b"\n"


async def lookup(ctx: ToolContext, args: dict[str, Any]) -> str:
    return f"record {args.get('key', '')}: " + "x" * 48


def _file(workspace: Path, session: str) -> int:
    """The session's file, opened for appending once (its folder made then)."""
    fd = _files.get((workspace, session))
    if fd is None:
        folder = workspace / "bench"
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / f"{session}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if len(_files) >= OPEN_FILES:
            os.close(_files.pop(next(iter(_files))))
        _files[workspace, session] = fd
    return fd


async def append(ctx: ToolContext, args: dict[str, Any]) -> str:
    os.write(
        _file(ctx.workspace, ctx.session_id), line_for(ctx.session_id, int(args.get("step", 0)))
    )
    return "appended"


async def appended(ctx: ToolContext, args: dict[str, Any]) -> ProbeResult:
    """Whether the call's line is in the session's file (the probe of ``bench.append``)."""
    path = ctx.workspace / "bench" / f"{ctx.session_id}.log"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ProbeResult("not_happened")
    if line_for(ctx.session_id, int(args.get("step", 0))) in data:
        return ProbeResult("happened", result="appended")
    return ProbeResult("not_happened")


@hookimpl
def register_tools(register: Callable[[Tool], None]) -> None:
    register(
        Tool(
            name="bench.lookup",
            description="Look a record up (read-only).",
            run=lookup,
            parameters={"type": "object", "properties": {"key": {"type": "string"}}},
        )
    )
    register(
        Tool(
            name="bench.append",
            description="Append one line to the session's log file (a side effect).",
            run=append,
            parameters={"type": "object", "properties": {"step": {"type": "integer"}}},
            side_effect=True,
            probe=appended,
        )
    )
