"""Agents written in Python and the embedded mesh a script or a notebook runs them on.

``Agent`` is an agent definition written in Python: the fields of the TOML format
(docs/formats.md) as keyword arguments, with ``@apomesh.tool`` tools given as themselves.

``local()`` is the whole system in the calling process: the same ``Node`` as ``apomesh serve``
(the embedded nats-server, the daemon, its in-process workers; no HTTP API) serving the Python
tools ``@apomesh.tool`` made, one ``ToolSet`` per module, pinned by module and digest. Its data dir
is stable for the script (``.apomesh/<script name>`` beside the script; ``.apomesh/notebook`` in
the current directory when there is no script file), so a rerun after the script was killed
finds the same log, journal and snapshots.

``mesh.run(agent, goal)`` is keyed: the session id comes from the definition and the goal (or
``key=``), so a rerun continues the session an earlier run started rather than starting another.
A session still running is waited for; one the restart put on the recoverable list (it had
logged side effects) is resumed, the rerun being the deliberate act an operator's resume is: each
journaled effect is served from the journal or settled by the tool's probe and ``on_unknown``
policy, never run twice. Only an unknown outcome of a ``hold`` tool without a probe, which a
resume would acknowledge, is left for the person to settle (``SessionNotCompleted``; then
``mesh.resume(session_id)``). A finished session answers its output again. A resume whose pins no
longer hold (the tool set changed) fails with ``PluginPinMismatch``; a session that ends other
than completed, waits for a human or holds an unknown outcome is a ``SessionNotCompleted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from apomesh.core.definition import parse_definition
from apomesh.core.errors import ApomeshError, NotFound, PluginPinMismatch, SessionNotCompleted
from apomesh.core.views import SessionView
from apomesh.plugins.api import Tool
from apomesh.plugins.python_tools import PIN_PREFIX, PythonTool, tool_sets
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node
from apomesh.runtime.service import Service

BY = "apomesh.local"
"""Who the operator actions of a local mesh (a rerun's resume) are logged as."""

STATUS_CHECK = 1.0
"""Seconds between looks at a session's status while no event arrives (a session put on the
recoverable list or holding an unknown outcome appends none)."""


class Agent:
    """An agent definition in Python: ``Agent("writer", instructions=..., tools=[my_tool],
    model={...})``; every other field of the definition format by its name (``coordination``,
    ``roles``, ``budget``, ...). Checked at once: a wrong field is a ``DefinitionError``."""

    def __init__(
        self,
        name: str,
        *,
        instructions: str = "",
        tools: Iterable[Tool | str] = (),
        model: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        data: dict[str, Any] = {"name": name, "instructions": instructions, **fields}
        data["tools"] = _tool_names(tools)
        if model is not None:
            data["model"] = dict(model)
        if isinstance(data.get("roles"), Mapping):
            data["roles"] = {
                role: (
                    {**spec, "tools": _tool_names(spec["tools"])}
                    if isinstance(spec, Mapping) and "tools" in spec
                    else spec
                )
                for role, spec in data["roles"].items()
            }
        parse_definition(data, where=f"agent {name!r}")
        self._definition = data

    def definition(self) -> dict[str, Any]:
        """The definition as ``POST /v1/sessions`` and ``apomesh agents publish`` take it."""
        return msgspec.convert(self._definition, dict[str, Any])

    def __repr__(self) -> str:
        return f"Agent({self._definition['name']!r})"


def _tool_names(tools: Iterable[Tool | str]) -> list[str]:
    return [t.name if isinstance(t, Tool) else str(t) for t in tools]


def run_session_id(definition: Mapping[str, Any], goal: str, key: str | None = None) -> str:
    """The session id ``LocalMesh.run`` gives a run: the same for the same definition and goal
    (or the same ``key``), so a rerun finds the session an earlier run started."""
    if key is None:
        key = msgspec.json.encode([dict(definition), goal], order="sorted").decode()
    return hashlib.sha256(f"apomesh-local\0{key}".encode()).hexdigest()[:32]


def script_data_dir() -> Path:
    """``.apomesh/<script name>`` beside the running script, else ``.apomesh/notebook`` here."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        script = Path(main_file).resolve()
        return script.parent / ".apomesh" / script.stem
    return Path.cwd() / ".apomesh" / "notebook"


class LocalMesh:
    """An embedded mesh (see the module's text); made by ``local()``."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        workers: int = 2,
        workspace: str | Path | None = None,
        tools: Iterable[PythonTool] | None = None,
        config: str | Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir) if data_dir is not None else script_data_dir()
        self.workspace = Path(workspace) if workspace is not None else self.data_dir / "workspace"
        self._tools = None if tools is None else list(tools)
        self._config = load_config(
            Path(config) if config is not None else None,
            env={},
            overrides={
                "daemon": {
                    "data_dir": str(self.data_dir),
                    "workspace": str(self.workspace),
                    "workers": workers,
                },
            },
        )
        self._node: Node | None = None

    async def __aenter__(self) -> LocalMesh:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        node = Node(self._config, http=False, extra_plugins=tool_sets(self._tools))
        await node.start()
        self._node = node
        return self

    async def __aexit__(self, *exc: object) -> None:
        node, self._node = self._node, None
        if node is not None:
            await node.aclose()

    @property
    def service(self) -> Service:
        """What the HTTP API serves, in process: sessions, recovery, HITL answers, workers."""
        if self._node is None or self._node.service is None:
            raise ApomeshError("the local mesh is not running: use `async with apomesh.local()`")
        return self._node.service

    async def run(
        self, agent: Agent | Mapping[str, Any], goal: str, *, key: str | None = None
    ) -> str:
        """Run ``agent`` on ``goal`` to its end and answer its output; continue the session an
        earlier run of the same agent, goal (or ``key``) started."""
        service = self.service
        definition = agent.definition() if isinstance(agent, Agent) else dict(agent)
        session_id = run_session_id(definition, goal, key)
        try:
            view = await service.get_session(session_id)
        except NotFound:
            await service.create_session(
                goal, agent=None, definition=definition, by=BY, session_id=session_id
            )
        else:
            if view.status == "recoverable":
                held = _held_for_a_person(view, service.plugins.tools())
                if held:
                    raise SessionNotCompleted(
                        f"session {session_id} holds unknown outcomes for you to decide ({held}:"
                        " on_unknown='hold' and no probe): look whether the effect happened,"
                        f" then `await mesh.resume({session_id!r})` goes on past it (the model"
                        " is told the call failed; it is not run again)",
                        session_id=session_id,
                        status=view.status,
                    )
                await self.resume(session_id)
        return await self.wait(session_id)

    async def resume(self, session_id: str) -> None:
        """Resume a session from the recoverable list, as ``apomesh recover resume`` does: its
        unknown outcomes are acknowledged (a ``hold`` stops holding them). ``PluginPinMismatch``
        when its pins no longer hold."""
        try:
            await self.service.resume(session_id, migrate_pins={}, by=BY)
        except PluginPinMismatch as exc:
            if not exc.pin.startswith(PIN_PREFIX):
                raise
            raise PluginPinMismatch(
                "the session was started with other Python tools (their code, schema or journal"
                " settings changed since): restore them to continue it, or run it under another"
                " key=",
                pin=exc.pin,
            ) from exc

    async def wait(self, session_id: str) -> str:
        """The output of session ``session_id`` once it completes; ``SessionNotCompleted`` when
        it ends otherwise or stops where only a person can move it on."""
        service = self.service
        changed = asyncio.Event()
        view = await service.get_session(session_id)

        async def follow(after: int) -> None:
            async for _ in service.tail_events(session_id, after):
                changed.set()

        follower = asyncio.create_task(follow(view.last_index))
        try:
            while not view.terminal:
                _check_not_stuck(view)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STATUS_CHECK):
                        await changed.wait()
                changed.clear()
                view = await service.get_session(session_id)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower
        if view.status != "completed":
            raise SessionNotCompleted(
                f"session {session_id} {view.status}: {view.reason or 'no reason given'}",
                session_id=session_id,
                status=view.status,
            )
        return view.output or ""


def _held_for_a_person(view: SessionView, tools: Mapping[str, Tool]) -> str:
    """The unknown outcomes of ``view`` that only a person may settle: calls of a ``hold`` tool
    with no probe (a resume would acknowledge them); ``""`` when there are none."""
    held = []
    for unknown in view.unknown_outcomes:
        tool = tools.get(unknown.tool)
        if tool is not None and tool.on_unknown == "hold" and tool.probe is None:
            held.append(f"{unknown.tool} by {unknown.agent} with {unknown.args}")
    return "; ".join(held)


def _check_not_stuck(view: SessionView) -> None:
    if view.status == "recoverable":
        why = f"it is on the recoverable list: {view.reason or 'no reason given'}"
    elif view.hitl_pending:
        questions = "; ".join(f"{p.pause_id}: {p.question}" for p in view.hitl_pending)
        why = f"it waits for a human answer ({questions})"
    elif held := [
        u
        for u in view.unknown_outcomes
        if u.agent in {a.ref for a in view.agents if a.phase == "waiting"}
    ]:
        calls = ", ".join(f"{u.tool} by {u.agent}" for u in held)
        why = f"it holds unknown outcomes for an operator ({calls})"
    else:
        return
    raise SessionNotCompleted(
        f"session {view.session_id} cannot go on by itself: {why}",
        session_id=view.session_id,
        status=view.status,
    )


def local(
    data_dir: str | Path | None = None,
    *,
    workers: int = 2,
    workspace: str | Path | None = None,
    tools: Iterable[PythonTool] | None = None,
    config: str | Path | None = None,
) -> LocalMesh:
    """An embedded mesh: ``async with apomesh.local() as mesh: await mesh.run(agent, goal)``.

    ``data_dir`` defaults to ``script_data_dir()``; ``tools`` to every ``@apomesh.tool`` tool
    made so far; ``config`` is an ``apomesh serve`` config file (its data dir, workspace and
    worker count are the arguments')."""
    return LocalMesh(data_dir, workers=workers, workspace=workspace, tools=tools, config=config)
