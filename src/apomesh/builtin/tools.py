"""The built-in tools: workspace file tools, asking a human, explicit checkpoints and a sleep job.

File tools are confined to the ``ToolContext``'s workspace: ``resolve_in_workspace`` refuses
absolute paths and ``..`` traversal that leave it, and symlinks that resolve outside it. File I/O
runs in a worker thread (``anyio.to_thread.run_sync``) so a tool never blocks the event loop.
``fs.write`` rewrites a whole file (idempotent: the same call leaves the same file, so an unknown
outcome is simply re-run); ``fs.append`` appends one line (not idempotent: an unknown outcome fails
rather than risk a second line).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from apomesh.core.errors import ToolError
from apomesh.plugins.api import Tool, ToolContext

MAX_READ_BYTES = 1 << 20
"""``fs.read`` refuses files larger than this, so one call cannot flood a conversation."""


def resolve_in_workspace(workspace: Path, path: str, *, tool: str = "") -> Path:
    """The absolute path ``path`` names inside ``workspace``, or ``ToolError`` when it would leave
    it (an absolute path elsewhere, ``..`` past the root, or a symlink pointing outside).

    Touches the file system (symlinks are followed), so call it off the event loop.
    """
    prefix = f"{tool}: " if tool else ""
    if not path or "\x00" in path:
        raise ToolError(f"{prefix}path {path!r} is not a usable file name")
    root = workspace.resolve()
    candidate = Path(path)
    lexical = Path(os.path.normpath(root / candidate))
    if not lexical.is_relative_to(root):
        if candidate.is_absolute():
            raise ToolError(f"{prefix}absolute path {path!r} is outside the workspace")
        raise ToolError(f"{prefix}path {path!r} climbs out of the workspace with '..'")
    resolved = lexical.resolve()
    if not resolved.is_relative_to(root):
        raise ToolError(f"{prefix}path {path!r} goes through a symlink to outside the workspace")
    return resolved


def _str_arg(tool: str, args: dict[str, Any], key: str, default: str | None = None) -> str:
    value = args.get(key, default)
    if not isinstance(value, str):
        raise ToolError(f"{tool}: argument `{key}` must be a string")
    return value


def _read(workspace: Path, path: str) -> str:
    target = resolve_in_workspace(workspace, path, tool="fs.read")
    if not target.exists():
        raise ToolError(f"fs.read: no such file: {path}")
    if target.is_dir():
        raise ToolError(f"fs.read: {path} is a directory (use fs.list)")
    size = target.stat().st_size
    if size > MAX_READ_BYTES:
        raise ToolError(f"fs.read: {path} is {size} bytes, over the limit of {MAX_READ_BYTES}")
    try:
        return target.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"fs.read: {path} is not UTF-8 text") from None


def _list(workspace: Path, path: str) -> str:
    target = resolve_in_workspace(workspace, path, tool="fs.list")
    if not target.exists():
        raise ToolError(f"fs.list: no such directory: {path}")
    if not target.is_dir():
        raise ToolError(f"fs.list: {path} is not a directory")
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in target.iterdir())
    return "\n".join(names)


def _write(workspace: Path, path: str, content: str) -> str:
    target = resolve_in_workspace(workspace, path, tool="fs.write")
    if target.is_dir():
        raise ToolError(f"fs.write: {path} is a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8")
    # Write then rename, so a crash mid-write never leaves a half file for a re-run to find.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return f"wrote {len(data)} bytes to {path}"


def _append(workspace: Path, path: str, line: str) -> str:
    if "\n" in line or "\r" in line:
        raise ToolError("fs.append: `line` must be one line (no line breaks)")
    target = resolve_in_workspace(workspace, path, tool="fs.append")
    if target.is_dir():
        raise ToolError(f"fs.append: {path} is a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return f"appended 1 line to {path}"


async def fs_read(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.read", args, "path")
    return await anyio.to_thread.run_sync(_read, ctx.workspace, path)


async def fs_list(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.list", args, "path", ".")
    return await anyio.to_thread.run_sync(_list, ctx.workspace, path)


async def fs_write(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.write", args, "path")
    content = _str_arg("fs.write", args, "content")
    return await anyio.to_thread.run_sync(_write, ctx.workspace, path, content)


async def fs_append(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.append", args, "path")
    line = _str_arg("fs.append", args, "line")
    return await anyio.to_thread.run_sync(_append, ctx.workspace, path, line)


async def ask_human(ctx: ToolContext, args: dict[str, Any]) -> str:
    question = _str_arg("ask_human", args, "question")
    if not question.strip():
        raise ToolError("ask_human: `question` must not be empty")
    return await ctx.ask_human(question)


async def checkpoint_now(ctx: ToolContext, args: dict[str, Any]) -> str:
    await ctx.checkpoint_now()
    return "checkpoint taken"


async def jobs_sleep(ctx: ToolContext, args: dict[str, Any]) -> str:
    seconds = args.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ToolError("jobs.sleep: argument `seconds` must be a non-negative number")
    await anyio.sleep(seconds)
    return f"slept {seconds:g} s"


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "A path relative to the workspace."}

BUILTIN_TOOLS: list[Tool] = [
    Tool(
        name="fs.read",
        description="Read a UTF-8 text file from the workspace.",
        run=fs_read,
        parameters=_schema({"path": _PATH}, ["path"]),
    ),
    Tool(
        name="fs.list",
        description="List a workspace directory; directory names end with '/'.",
        run=fs_list,
        parameters=_schema({"path": {**_PATH, "default": "."}}, []),
    ),
    Tool(
        name="fs.write",
        description="Write a whole file in the workspace (replacing it), creating directories.",
        run=fs_write,
        parameters=_schema(
            {"path": _PATH, "content": {"type": "string", "description": "The whole new content."}},
            ["path", "content"],
        ),
        side_effect=True,
        idempotent=True,
        on_unknown="rerun",
    ),
    Tool(
        name="fs.append",
        description="Append one line of text to a file in the workspace, creating it if needed.",
        run=fs_append,
        parameters=_schema(
            {"path": _PATH, "line": {"type": "string", "description": "One line, no line breaks."}},
            ["path", "line"],
        ),
        side_effect=True,
        idempotent=False,
        on_unknown="fail",
    ),
    Tool(
        name="ask_human",
        description="Ask a human operator a question and wait for the answer.",
        run=ask_human,
        parameters=_schema({"question": {"type": "string"}}, ["question"]),
    ),
    Tool(
        name="checkpoint.now",
        description="Take an explicit checkpoint of this agent now.",
        run=checkpoint_now,
        parameters=_schema({}, []),
    ),
    Tool(
        name="jobs.sleep",
        description="A long-running job that waits the given number of seconds.",
        run=jobs_sleep,
        parameters=_schema(
            {"seconds": {"type": "number", "minimum": 0, "description": "How long to wait."}},
            ["seconds"],
        ),
        async_job=True,
    ),
]
