"""The types plugin authors implement and receive: tools, model providers, coordination kinds,
skill resolvers, recovery classifiers and supervisor policies.

A plugin hands declarations to the host through ``register_*`` hooks (``apomesh.plugins.hookspecs``)
and does no I/O while registering. The contexts (``ToolContext``, ``CoordinatorContext``) are
implemented by the runtime; plugins only call them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from apomesh.core.decisions import Classification
from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.core.errors import ApomeshError
from apomesh.core.state import SessionState

# --- conversation -----------------------------------------------------------------------------


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    """One entry of an agent's working-memory conversation."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCallSpec] = []
    tool_call_id: str = ""
    name: str = ""


# --- tools ------------------------------------------------------------------------------------

UnknownOutcomePolicy = Literal["rerun", "fail", "hold"]


class ToolContext(Protocol):
    """What a running tool may use. Implemented by the worker runtime."""

    @property
    def workspace(self) -> Path: ...

    @property
    def session_id(self) -> str: ...

    @property
    def agent(self) -> str: ...

    @property
    def epoch(self) -> int:
        """The fencing epoch of this dispatch of the agent (higher = newer). A tool that fences
        its effects refuses one from an epoch older than the newest that reached its target."""

    async def ask_human(self, question: str) -> str:
        """The answer to ``question``; pauses the agent (and ends this dispatch) until one exists."""

    async def checkpoint_now(self) -> None:
        """Take an explicit snapshot at the current node boundary."""


ToolRun = Callable[[ToolContext, dict[str, Any]], Awaitable[str]]


class ProbeResult(msgspec.Struct, frozen=True):
    """A probe's answer about a call whose outcome is unknown: the effect ``happened`` (with the
    ``result`` the call would have returned), ``not_happened`` (the call is safe to run now), or
    ``cannot_tell`` (``reason`` says why; the tool's ``on_unknown`` policy decides)."""

    status: Literal["happened", "not_happened", "cannot_tell"]
    result: str = ""
    reason: str = ""


ToolProbe = Callable[[ToolContext, dict[str, Any]], Awaitable[ProbeResult]]
"""Asked, with the same context and arguments the call was made with, whether its effect
happened. It runs where the effect runs (on the worker, in its workspace) and must itself have no
effect the call would not have had."""


class Tool(msgspec.Struct, frozen=True):
    """A tool an agent can call.

    ``side_effect`` tools are journaled (intent, effect, result) and a repeated call is served from
    the journal. ``on_unknown`` says what happens to a side effect whose outcome is unknown after a
    crash: ``rerun`` (only sensible when ``idempotent``), ``fail`` (the call fails with a clear
    reason the model sees) or ``hold`` (the agent waits for an operator).
    """

    name: str
    description: str
    run: ToolRun
    parameters: dict[str, Any] = {}
    side_effect: bool = False
    idempotent: bool = False
    on_unknown: UnknownOutcomePolicy = "fail"
    async_job: bool = False
    probe: ToolProbe | None = None


def describe_tool(tool: Tool) -> dict[str, Any]:
    """The entry for ``tool`` in ``ModelRequest.tools``: its name, description and JSON schema."""
    parameters = tool.parameters or {"type": "object", "properties": {}}
    return {"name": tool.name, "description": tool.description, "parameters": parameters}


# --- models -----------------------------------------------------------------------------------


class ModelError(ApomeshError):
    """A model provider could not produce an answer (an HTTP error, an unreachable endpoint, an
    answer it cannot parse). ``status`` is the HTTP status when there was one; rate limits, server
    errors and unreachable endpoints are ``retryable``."""

    code = "model_error"

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        status: int | None = None,
        retryable: bool | None = None,
    ) -> None:
        where = f"model provider {provider!r}" + (f" (HTTP {status})" if status is not None else "")
        super().__init__(f"{where}: {message}")
        self.provider = provider
        self.status = status
        if retryable is None:
            retryable = status is not None and (status == 429 or status >= 500)
        self.retryable = retryable


class ModelRequest(msgspec.Struct, frozen=True):
    """One model call: the conversation so far and the model's private memory."""

    instructions: str
    messages: list[Message]
    tools: list[dict[str, Any]]
    memory: dict[str, Any]
    task: str = ""
    task_index: int = 0
    purpose: str = "act"  # "act", "plan", "synthesize", "critique"


class ModelResponse(msgspec.Struct, frozen=True):
    """A model's answer: tool calls, a plan, or a final answer; plus its updated memory."""

    text: str = ""
    tool_calls: list[ToolCallSpec] = []
    plan: list[str] | None = None
    final: str | None = None
    tokens: int = 0
    memory: dict[str, Any] = {}


class Model(Protocol):
    async def respond(self, request: ModelRequest) -> ModelResponse: ...


class ModelProvider(Protocol):
    """Builds a ``Model`` from a ``ModelSpec``; ``name`` is what ``[model] provider`` names."""

    name: str

    def create(self, spec: ModelSpec) -> Model: ...


# --- coordination -----------------------------------------------------------------------------


class ChildResult(msgspec.Struct, frozen=True):
    ref: str
    task: str
    index: int
    ok: bool
    output: str = ""
    reason: str = ""


class RootAnswer(msgspec.Struct, frozen=True):
    plan: list[str] | None = None
    final: str | None = None


class CoordinatorContext(Protocol):
    """What a coordination kind drives a session with. Implemented by the daemon."""

    @property
    def goal(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]: ...

    @property
    def checkpoint(self) -> bytes | None:
        """The loop state of the latest ``CoordinatorCheckpoint`` (None on a fresh start)."""

    async def ask_root(self, purpose: str, prompt: str) -> RootAnswer:
        """Run the root agent until it answers with a plan or a final answer."""

    async def run_children(
        self, batch: str, tasks: list[str], *, role: str = "worker", max_parallel: int = 4
    ) -> list[ChildResult]:
        """Run one sub-agent per task (at most ``max_parallel`` at once) and join them.

        ``batch`` names this group in the loop (e.g. ``iter-2``); children of a batch that already
        completed on the log are not run again: their outputs come from their terminal events.
        """

    async def save_checkpoint(self, position: str, state: bytes) -> None:
        """Append a ``CoordinatorCheckpoint`` with the loop position and opaque state."""


class CoordinationKind(Protocol):
    """A coordination strategy. ``fold_params`` validates and fills defaults (pinned at start)."""

    name: str
    roles: tuple[str, ...]

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]: ...

    async def run(self, ctx: CoordinatorContext) -> str: ...


# --- skills, recovery, supervision -------------------------------------------------------------


class ResolvedSkill(msgspec.Struct, frozen=True):
    """Exact skill bytes as a resolver found them, with their sha256 digest."""

    name: str
    body: str
    digest: str
    tools: list[str] = []


class SkillResolver(Protocol):
    """Finds skill bodies by name; ``name`` is recorded in pins (``PinnedSkill.resolver``)."""

    name: str

    async def resolve(self, skill: str) -> ResolvedSkill | None: ...


class RecoveryClassifier(Protocol):
    """Decides a restarted daemon's verdict for a session; None defers to the next classifier."""

    name: str

    def classify(
        self, state: SessionState, pin_problem: str | None, tools: dict[str, Tool]
    ) -> Classification | None: ...


class SupervisorPolicy(Protocol):
    """Watches an agent's loop; answering ``reset`` takes a reset-point snapshot and restarts it
    from its birth config with a note in its conversation."""

    name: str

    def review(
        self, agent: str, step: int, recent: list[Message]
    ) -> Literal["continue", "reset"]: ...


class CheckpointSource(msgspec.Struct, frozen=True):
    """A reason an agent snapshot is taken (never a HITL pause)."""

    name: str
    description: str = ""


BUILTIN_CHECKPOINT_SOURCES = ("node", "reset_point", "explicit", "affinity_release")
