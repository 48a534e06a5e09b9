"""Tools served by MCP servers: a worker connects to the servers its config names and offers their
tools as apomesh tools, named ``<server>.<tool>``.

A server is a stdio command (the worker starts it as its child) or a streamable HTTP URL
(``McpServer``); the connection is the official ``mcp`` package's ``Client`` (the optional extra
``apomesh[mcp]``). A worker that cannot reach a server at start logs why and goes on without its
tools, so an agent that needs them is placed on a worker that has them. A connection that breaks
is opened again at the next call; a call it broke (or one left unanswered past the server's
``timeout``) is ``OutcomeUnknown``, decided by the journal as below.

The tool's MCP annotations decide how the journal treats a call (``journal_policy``): a
``readOnlyHint`` tool is read-only (not journaled; re-run freely after a crash); an
``idempotentHint`` tool is a side effect that may be run again when a crash left its outcome
unknown (``on_unknown = "rerun"``); any other tool is a side effect whose unknown outcome is
decided by the server's configured ``on_unknown`` (``hold`` by default: the session waits for an
operator). A side-effecting call carries its idempotency key to the server in the request's
``_meta`` (``IDEMPOTENCY_META``), so a server can apply a re-sent call once. The annotations
are trusted because the operator chose the server; a server that calls a side effect read-only
loses the journal's protection for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Iterable
from typing import Any, Literal

import anyio
import msgspec

from apomesh.core.errors import ApomeshError, OutcomeUnknown, ToolError
from apomesh.plugins.api import Tool, ToolContext, UnknownOutcomePolicy

log = logging.getLogger("apomesh.mcp")

IDEMPOTENCY_META = "apomesh/idempotency_key"
"""The ``_meta`` key of a side-effecting ``tools/call`` request that holds its idempotency key."""
SERVER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
"""What an MCP server may be called in the config: its name is the namespace of its tools."""


class McpUnavailable(ApomeshError):
    """The ``mcp`` package is not installed, or a server could not be reached."""

    code = "mcp_unavailable"


class McpServer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One MCP server as the config names it (``[mcp.servers.<name>]``): exactly one of
    ``command`` (argv of a stdio server, started by each worker) or ``url`` (a streamable HTTP
    endpoint); ``env`` is added to a stdio server's environment; ``on_unknown`` decides a side
    effect without ``idempotentHint`` whose outcome a crash left unknown; ``timeout`` bounds one
    call, in seconds."""

    command: list[str] = []
    url: str = ""
    env: dict[str, str] = {}
    on_unknown: Literal["hold", "fail"] = "hold"
    timeout: float = 60.0

    def problem(self) -> str | None:
        """Why this server cannot be used as written, or None."""
        if bool(self.command) == bool(self.url):
            return "give exactly one of `command` (a stdio server) or `url` (streamable HTTP)"
        if self.url and not self.url.startswith(("http://", "https://")):
            return f"`url` must be an http:// or https:// URL, not {self.url!r}"
        if self.timeout <= 0:
            return "`timeout` must be positive"
        return None


def journal_policy(
    annotations: Any, on_unknown: UnknownOutcomePolicy
) -> tuple[bool, bool, UnknownOutcomePolicy]:
    """``(side_effect, idempotent, on_unknown)`` of a tool with these MCP ``annotations`` (see the
    module text); ``on_unknown`` is the server's policy for a plain side effect."""
    if annotations is not None and annotations.read_only_hint is True:
        return False, False, on_unknown
    if annotations is not None and annotations.idempotent_hint is True:
        return True, True, "rerun"
    return True, False, on_unknown


def reason_of(exc: BaseException) -> str:
    """A failure's own message: the first leaf of an exception group (the ``mcp`` client's task
    groups wrap what went wrong), an apomesh error's message, else its type and text."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, ApomeshError):
        return exc.message
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def result_text(result: Any) -> str:
    """The text of a ``CallToolResult``: its text blocks, else its structured content as JSON,
    each other block named by its type."""
    parts: list[str] = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{block.type} content]")
    if not parts and result.structured_content is not None:
        parts.append(msgspec.json.encode(result.structured_content).decode())
    return "\n".join(parts)


class McpConnection:
    """The worker's connection to one MCP server, opened again after it broke. The ``mcp.Client``
    lives in a task of its own (its task group must be entered and left in one task); calls from
    any task go through it."""

    def __init__(self, name: str, server: McpServer) -> None:
        self.name = name
        self.server = server
        self._client: Any = None
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()

    async def open(self) -> Any:
        """The connected ``mcp.Client`` (connecting when there is none)."""
        async with self._lock:
            if self._client is None or self._runner is None or self._runner.done():
                self._client = await self._connect()
            return self._client

    async def _connect(self) -> Any:
        try:
            from mcp import Client, StdioServerParameters
        except ImportError:
            raise McpUnavailable(
                "MCP servers need the `mcp` package: pip install 'apomesh[mcp]'"
            ) from None
        target: Any
        if self.server.command:
            command, *args = self.server.command
            target = StdioServerParameters(command=command, args=args, env=self.server.env or None)
        else:
            target = self.server.url
        ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        stop = self._stop = asyncio.Event()

        async def hold_open() -> None:
            try:
                async with Client(target, read_timeout_seconds=self.server.timeout) as client:
                    ready.set_result(client)
                    await stop.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                elif not isinstance(exc, asyncio.CancelledError):
                    log.warning("the connection to MCP server %r ended: %s", self.name, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise

        self._runner = asyncio.create_task(hold_open(), name=f"mcp-{self.name}")
        return await ready

    async def close(self) -> None:
        """Leave the connection (a stdio server's process ends with it)."""
        runner, self._runner, self._client = self._runner, None, None
        self._stop.set()
        if runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner, 10)

    async def tools(self, on_unknown: UnknownOutcomePolicy) -> list[Tool]:
        """The server's tools as apomesh tools (every page of its listing)."""
        client = await self.open()
        listed: list[Any] = []
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return [self._tool(spec, on_unknown) for spec in listed]

    def _tool(self, spec: Any, on_unknown: UnknownOutcomePolicy) -> Tool:
        side_effect, idempotent, policy = journal_policy(spec.annotations, on_unknown)
        remote = spec.name

        async def run(ctx: ToolContext, args: dict[str, Any]) -> str:
            return await self.call(remote, args, getattr(ctx, "idempotency_key", ""))

        return Tool(
            name=f"{self.name}.{remote}",
            description=spec.description or spec.title or remote,
            run=run,
            parameters=dict(spec.input_schema or {}),
            side_effect=side_effect,
            idempotent=idempotent,
            on_unknown=policy,
        )

    async def call(self, tool: str, args: dict[str, Any], idempotency_key: str) -> str:
        """Call ``tool`` on the server; its error result is a ``ToolError`` the model sees. A
        connection that breaks or goes silent mid-call is dropped (the next call opens a new one)
        and the call is ``OutcomeUnknown``: never sent twice from here, decided by the journal
        like an intent a crash left without its result (a re-run under the same idempotency
        key for an idempotent tool, else the server's ``on_unknown``)."""
        meta = {IDEMPOTENCY_META: idempotency_key} if idempotency_key else None
        where = f"{self.name}.{tool}"
        try:
            client = await self.open()
        except ApomeshError:
            raise
        except Exception as exc:
            raise ToolError(
                f"{where}: MCP server {self.name!r} cannot be reached ({reason_of(exc)}); the"
                " call was not sent"
            ) from None
        try:
            with anyio.fail_after(self.server.timeout):
                result = await client.call_tool(tool, args, meta=meta)
        except ApomeshError:
            raise
        except TimeoutError:
            await self.close()
            raise OutcomeUnknown(
                f"{where}: no answer from MCP server {self.name!r} within "
                f"{self.server.timeout:g} s; whether the call took effect is not known"
            ) from None
        except Exception as exc:
            await self.close()
            raise OutcomeUnknown(
                f"{where}: the call to MCP server {self.name!r} broke off ({reason_of(exc)}); "
                "whether it took effect is not known"
            ) from None
        text = result_text(result)
        if result.is_error:
            raise ToolError(f"{where}: {text or 'the MCP server reported an error'}")
        return text


class McpTools:
    """The MCP servers a worker connects to, and the tools they offer: entering connects to each
    and lists its tools, leaving closes every connection."""

    def __init__(self, servers: dict[str, McpServer]) -> None:
        self.connections = {name: McpConnection(name, server) for name, server in servers.items()}
        self.tools: list[Tool] = []
        self.unreachable: dict[str, str] = {}
        """Servers that could not be listed at start, with why."""

    async def __aenter__(self) -> McpTools:
        for name, connection in self.connections.items():
            try:
                with anyio.fail_after(connection.server.timeout):
                    found = await connection.tools(connection.server.on_unknown)
            except Exception as exc:
                reason = reason_of(exc)
                self.unreachable[name] = reason
                log.error(
                    "MCP server %r is unreachable, its tools are not offered: %s", name, reason
                )
                await connection.close()
                continue
            self.tools.extend(found)
            log.info(
                "MCP server %r offers %s", name, ", ".join(t.name for t in found) or "no tools"
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for connection in self.connections.values():
            await connection.close()


def server_problems(servers: dict[str, McpServer]) -> Iterable[tuple[str, str]]:
    """``(name, problem)`` for each configured server that cannot be used as written."""
    for name, server in servers.items():
        if not SERVER_NAME.match(name):
            yield name, "a server name is lower-case letters, digits, '-' and '_' (at most 64)"
        problem = server.problem()
        if problem is not None:
            yield name, problem
