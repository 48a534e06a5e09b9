"""A real MCP server for the tests, on the official ``mcp`` package: three tools, one per journal
policy, that count their effects in files.

``python tests/fakes/mcp_server.py DIR`` serves stdio; ``... DIR --http PORT`` serves streamable
HTTP on 127.0.0.1:PORT at ``/mcp``. Every call appends ``<tool> <args>`` to ``DIR/calls.txt`` when
it starts; an effect appends one line to ``DIR/effects.txt``. While ``DIR/hold`` exists a call
waits after its effect, before it answers, so a test can kill the worker mid-call; each server
process appends its pid to ``DIR/pids.txt`` when it starts, so a test can kill the server
itself mid-call.

- ``lookup`` (``readOnlyHint``): no effect;
- ``put`` (``idempotentHint``): sets a value, applied once per idempotency key (the request's
  ``_meta["apomesh/idempotency_key"]``), so a re-sent call does nothing more;
- ``charge`` (no hint): a plain side effect, applied on every call it gets.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

IDEMPOTENCY_META = "apomesh/idempotency_key"

DIR = Path(sys.argv[1])
server = MCPServer("apomesh-test-tools")


def _append(name: str, line: str) -> None:
    with open(DIR / name, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
        handle.flush()


async def _wait_while_held() -> None:
    while (DIR / "hold").exists():
        await asyncio.sleep(0.05)


def _key(ctx: Context) -> str:
    meta = ctx.request_context.meta or {}
    value = meta.get(IDEMPOTENCY_META, "") if isinstance(meta, dict) else ""
    return str(value)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def lookup(item: str) -> str:
    """Look up the price of an item."""
    _append("calls.txt", f"lookup {item}")
    await _wait_while_held()
    return f"{item} costs 5"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True, read_only_hint=False))
async def put(item: str, value: str, ctx: Context) -> str:
    """Set an item's value (applied once per idempotency key)."""
    key = _key(ctx)
    _append("calls.txt", f"put {item}={value} key={key}")
    keys = DIR / "put-keys.json"
    seen = json.loads(keys.read_text()) if keys.exists() else []
    if not key or key not in seen:
        _append("effects.txt", f"put {item}={value}")
        keys.write_text(json.dumps([*seen, key]))
    await _wait_while_held()
    return f"{item} is {value}"


@server.tool()
async def charge(amount: int, ctx: Context) -> str:
    """Charge an amount (a plain side effect)."""
    _append("calls.txt", f"charge {amount} key={_key(ctx)}")
    _append("effects.txt", f"charge {amount}")
    await _wait_while_held()
    return f"charged {amount}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def fail(reason: str) -> str:
    """Always fails with the given reason."""
    raise ToolError(reason)


if __name__ == "__main__":
    _append("pids.txt", str(os.getpid()))
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run()
