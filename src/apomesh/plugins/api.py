"""The types plugin authors implement and receive: tools, model providers, coordination kinds,
skill resolvers, recovery classifiers and supervisor policies.

A plugin hands declarations to the host through ``register_*`` hooks (``apomesh.plugins.hookspecs``)
and does no I/O while registering. The contexts (``ToolContext``, ``CoordinatorContext``) are
implemented by the runtime; plugins only call them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from apomesh.core.decisions import Classification
from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.core.errors import ApomeshError
from apomesh.core.events import TURN_SOURCE
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
    def idempotency_key(self) -> str:
        """The key of the side-effecting call being run (``""`` for a call that is not journaled):
        the same on every attempt of this call, through a re-dispatch, a daemon restart and an
        operator resume, and different for any other call. Pass it to a downstream API that
        deduplicates requests (a payment provider's ``Idempotency-Key`` header, say), so an effect
        whose outcome was lost in a crash can be sent again and still happen once. It is the hex
        sha256 of ``apomesh-idempotency``, the session id, the agent ref and the call's journal
        key, joined by NUL characters (``apomesh.core.journal.idempotency_key``)."""

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
    reason the model sees) or ``hold`` (the agent waits for an operator). ``read_only_when``, on a
    side-effecting tool, names the calls that are read-only after all (asked with the call's
    arguments; True: not journaled), as ``http.request`` does for GET and HEAD.
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
    read_only_when: Callable[[dict[str, Any]], bool] | None = None

    def journaled(self, args: dict[str, Any]) -> bool:
        """Whether a call with ``args`` goes through the journal (a side effect)."""
        if not self.side_effect:
            return False
        return self.read_only_when is None or not self.read_only_when(args)


def describe_tool(tool: Tool) -> dict[str, Any]:
    """The entry for ``tool`` in ``ModelRequest.tools``: its name, description and JSON schema."""
    parameters = tool.parameters or {"type": "object", "properties": {}}
    return {"name": tool.name, "description": tool.description, "parameters": parameters}


# --- models -----------------------------------------------------------------------------------


class ModelError(ApomeshError):
    """A model provider could not produce an answer (an HTTP error, an unreachable endpoint, an
    answer it cannot parse). ``status`` is the HTTP status when there was one; rate limits, server
    errors and unreachable endpoints are ``retryable``. ``retry_after`` is the delay in seconds the
    API asked for (its ``Retry-After`` header), when it named one."""

    code = "model_error"

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        status: int | None = None,
        retryable: bool | None = None,
        retry_after: float | None = None,
    ) -> None:
        where = f"model provider {provider!r}" + (f" (HTTP {status})" if status is not None else "")
        super().__init__(f"{where}: {message}")
        self.provider = provider
        self.status = status
        if retryable is None:
            retryable = status is not None and (status == 429 or status >= 500)
        self.retryable = retryable
        self.retry_after = retry_after


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
    """Total tokens of the call (prompt + completion when the API reports both)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    memory: dict[str, Any] = {}


class Model(Protocol):
    async def respond(self, request: ModelRequest) -> ModelResponse: ...


class ModelDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """A piece of a model's answer while it is written (a streaming provider sends them, in
    order, through ``emit_delta``). ``kind`` is ``start`` when an answer begins (a retried call
    starts over: drop what the previous attempt showed), ``text`` for ``text`` appended to the
    answer, ``tool_call`` for tool call number ``call`` (0-based, in the answer's order): its
    ``tool`` name on the call's first delta, then fragments of its JSON ``arguments``. Deltas are a
    preview: the answer the model call returns is what the session records."""

    kind: Literal["start", "text", "tool_call"]
    text: str = ""
    call: int = 0
    tool: str = ""
    arguments: str = ""


DeltaSink = Callable[[ModelDelta], Awaitable[None]]
MODEL_DELTAS: ContextVar[DeltaSink | None] = ContextVar("apomesh_model_deltas", default=None)
"""Where the model call running in this context sends its deltas (set by the runtime around an
agent's model calls; unset, deltas go nowhere)."""


async def emit_delta(delta: ModelDelta) -> None:
    """Hand ``delta`` to the runtime, which shows it to the session's live readers. Never
    raises: a preview that cannot be sent must not fail the model call."""
    sink = MODEL_DELTAS.get()
    if sink is None:
        return
    with contextlib.suppress(Exception):  # a lost preview is harmless: the answer is recorded
        await sink(delta)


class ModelProvider(Protocol):
    """Builds a ``Model`` from a ``ModelSpec``; ``name`` is what ``[model] provider`` names.

    ``options`` declares every key the provider takes in ``[model]`` beside ``provider``,
    ``model``, ``script``, ``turns`` and ``retry`` (name -> one line saying what it does): a
    definition giving any other key is refused when its session is created, naming the key and
    the closest declared one. A provider without ``options`` (written before it existed) takes
    any key. A provider may also have ``check(spec, where)``, run at the same time, to refuse
    values (raise ``DefinitionError`` naming ``where``). ``Model.respond`` raises ``ModelError``
    on a failed call; the runtime, not the provider, tries a ``retryable`` one again."""

    name: str
    options: Mapping[str, str]

    def create(self, spec: ModelSpec) -> Model: ...


# --- coordination -----------------------------------------------------------------------------


ROOT_PURPOSES: tuple[str, ...] = ("plan", "act", "critique", "synthesize")
"""What ``ask_root`` may ask the root for (the model sees it as ``ModelRequest.purpose``):
``plan`` (answer with sub-tasks), ``act`` (do the goal itself), ``critique`` (judge results: a
final answer or a new plan), ``synthesize`` (the final answer from results)."""

AGENT_PHASES: tuple[str, ...] = (
    "born",
    "dispatched",
    "running",
    "planned",
    "paused",
    "waiting",
    "completed",
    "failed",
    "cancelled",
)
"""An agent's phases as its ``AgentLifecycle`` events record them; ``completed``, ``failed`` and
``cancelled`` are terminal."""

BATCH_DONE_EARLY = "cancelled: its batch was done early"
"""The ``reason`` of a child a batch's ``done_when`` made unnecessary (never run again)."""


class ChildResult(msgspec.Struct, frozen=True):
    """One sub-agent's outcome in a batch: ``ok`` with its ``output``, or not with its ``reason``
    (it failed, or ``BATCH_DONE_EARLY`` when ``done_when`` ended the batch first; ``ref`` is
    ``""`` for a task whose agent was never born)."""

    ref: str
    task: str
    index: int
    ok: bool
    output: str = ""
    reason: str = ""


class RootAnswer(msgspec.Struct, frozen=True):
    plan: list[str] | None = None
    final: str | None = None


class Checkpoint(msgspec.Struct, frozen=True):
    """A coordinator checkpoint as the kind saved it: its ``position`` and opaque ``state``."""

    position: str
    state: bytes


DoneWhen = Callable[[list[ChildResult]], bool]
"""Asked with a batch's finished results (in task order) each time one more child ends; True
ends the batch at once: the children still running are cancelled (``BATCH_DONE_EARLY``)."""


class CoordinatorContext(Protocol):
    """What a coordination kind drives a session with. Implemented by the daemon (and, for unit
    tests, by ``apomesh.testing.ScriptedCoordinator``).

    Replay: after a lost worker, a daemon restart or an operator resume the daemon calls the
    kind's ``run`` again. Everything the context answers comes back from the log: an
    ``ask_root`` answer by its place in the loop (the n-th ask since the checkpoint the loop is
    at), a batch's results by its name. A replay that asks for other work than the log holds
    there raises ``Nondeterminism``. Re-saving a checkpoint the log already holds (a kind that
    walks its loop from the start) writes nothing: the loop is at that checkpoint again.
    """

    @property
    def goal(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]: ...

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The latest ``CoordinatorCheckpoint``: its position and state (None on a fresh start)."""

    async def ask_root(self, purpose: str, prompt: str) -> RootAnswer:
        """Run the root agent until it answers with a plan or a final answer. ``purpose`` is one
        of ``ROOT_PURPOSES``. Each answer is durable: a replayed loop gets it back by position."""

    async def run_children(
        self,
        batch: str,
        tasks: list[str],
        *,
        role: str = "worker",
        max_parallel: int = 4,
        done_when: DoneWhen | None = None,
    ) -> list[ChildResult]:
        """Run one sub-agent per task (at most ``max_parallel`` at once) and join them; a result
        per task, in task order.

        ``batch`` names this group by its place in the loop (e.g. ``iter-2``). Children of a
        batch that ended on the log (completed, failed, or cancelled by ``done_when``) are not
        run again: their results come from their terminal events. The tasks of a replayed batch
        must be the logged ones (``Nondeterminism`` otherwise).
        """

    async def save_checkpoint(self, position: str, state: bytes) -> None:
        """Append a ``CoordinatorCheckpoint`` with the loop position and opaque state (loop
        position only: never sub-task outputs, which come back from the children)."""


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


BUILTIN_CHECKPOINT_SOURCES = ("node", "reset_point", "explicit", "affinity_release", TURN_SOURCE)
