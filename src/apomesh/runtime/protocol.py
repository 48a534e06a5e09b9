"""The control plane between the daemon and its workers, over core NATS only.

Workers never touch JetStream: they register (``apomesh.ctl.register.<worker_id>``), beat on
``apomesh.hb.<worker_id>``, take dispatches on ``apomesh.dispatch.<worker_id>`` and report back with
requests on ``apomesh.ctl.<verb>.<worker_id>``; their request inboxes are under
``_INBOX.worker.<worker_id>``. Every subject a worker uses names it, so NATS permissions can bind a
worker id to the credentials it connects with, and the daemon refuses a message whose payload names
another worker than its subject. NATS does not check the reply subject of a request against the
sender's permissions, and the daemon answers with its own (JetStream, KV, the log): it answers
only a request on a bound subject whose reply subject is that worker's own inbox
(``answerable``) and drops anything else, bare ``apomesh.ctl.<verb>`` subjects included. Every
report names the agent and carries the fencing epoch of
the dispatch it belongs to; the daemon answers ``Fenced`` to a stale epoch and appends nothing.
Workers never send events: they send facts (a node's new messages, a journal step, an outcome) and
the daemon decides which events to append. All messages are msgpack-encoded msgspec Structs.

No message may outgrow the NATS ``max_payload``. A dispatch carries the agent's working memory
only while it is small; a larger memory stays on the daemon and the worker fetches it page by page
(``MemoryFetch`` on ``apomesh.ctl.memory.<worker_id>``, each page answered on the worker's own
inbox and fenced by the dispatch's epoch like any report).
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

import msgspec

from apomesh.core.definition import AgentConfig
from apomesh.plugins.api import Message, ModelResponse

SUBJECT_REGISTER = "apomesh.ctl.register"
SUBJECT_NODE = "apomesh.ctl.node"
SUBJECT_TURN = "apomesh.ctl.turn"
SUBJECT_JOURNAL = "apomesh.ctl.journal"
SUBJECT_HITL = "apomesh.ctl.hitl"
SUBJECT_JOB = "apomesh.ctl.job"
SUBJECT_DONE = "apomesh.ctl.done"
SUBJECT_MEMORY = "apomesh.ctl.memory"
CTL_BOUND_WILDCARD = "apomesh.ctl.*.*"
"""Control subjects that end in the sending worker's id."""
CTL_PREFIX = "apomesh.ctl."
HB_PREFIX = "apomesh.hb."
DISPATCH_PREFIX = "apomesh.dispatch."
WORKER_INBOX_PREFIX = "_INBOX.worker."


def dispatch_subject(worker_id: str) -> str:
    return f"{DISPATCH_PREFIX}{worker_id}"


def beat_subject(worker_id: str) -> str:
    return f"{HB_PREFIX}{worker_id}"


def bound_subject(subject: str, worker_id: str) -> str:
    """A control subject (``SUBJECT_NODE``, ``SUBJECT_REGISTER``, ...) bound to ``worker_id``."""
    return f"{subject}.{worker_id}"


def worker_inbox_prefix(worker_id: str) -> str:
    """The inbox prefix of a worker's NATS connection, so permissions can give each worker its
    own replies and nobody else's."""
    return f"{WORKER_INBOX_PREFIX}{worker_id}"


def subject_worker(subject: str) -> str | None:
    """The worker id a bound control subject names, or ``None`` for a bare one."""
    tokens = subject.split(".")
    return tokens[3] if len(tokens) == 4 else None


def answerable(subject: str, reply: str) -> bool:
    """Whether the daemon may answer a request on control ``subject`` at ``reply``: only when the
    subject is bound to a worker (``apomesh.ctl.<verb>.<worker_id>``) and the reply subject lies in
    that worker's own inbox (``_INBOX.worker.<worker_id>.``), the one place its permissions let it
    hear. Any other reply subject (the JetStream API, a session's log, a KV key, another worker's
    inbox) would be published with the daemon's rights on the sender's say-so."""
    worker_id = subject_worker(subject)
    if worker_id is None or not subject.startswith(CTL_PREFIX):
        return False
    inbox = worker_inbox_prefix(worker_id) + "."
    rest = reply[len(inbox) :]
    return reply.startswith(inbox) and bool(rest) and not any(c in rest for c in "*> \t\r\n")


def new_worker_id(name: str) -> str:
    """A fresh worker id for a worker whose credentials name none: ``name`` made one subject
    token, and a random suffix."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name) or "worker"
    return check_worker_id(f"{safe}-{uuid.uuid4().hex[:8]}")


def check_worker_id(worker_id: str) -> str:
    """``worker_id`` when it can be one subject token; ``ValueError`` otherwise."""
    if not worker_id or any(c in worker_id for c in ".*> \t\r\n") or not worker_id.isprintable():
        raise ValueError(
            f"worker id {worker_id!r} cannot be a NATS subject token (no dots, wildcards or spaces)"
        )
    return worker_id


class BudgetState(msgspec.Struct):
    """What an agent has spent so far; part of its snapshot."""

    steps: int = 0
    tool_calls: int = 0
    tokens: int = 0
    seconds: float = 0.0


class RecordedTurn(msgspec.Struct):
    """A model turn recorded before it was acted on: the answer the model gave at ``step``.

    A re-dispatched or resumed agent whose memory holds one replays it instead of asking the model
    again: its tool calls go through the journal with the same arguments (so the same keys), and a
    recorded plan or final answer ends the agent with exactly that output."""

    step: int
    response: ModelResponse

    @property
    def ends_agent(self) -> bool:
        """A plan or a final answer (the agent's answer to its ask), not tool calls."""
        return self.response.final is not None or self.response.plan is not None


class AgentMemory(msgspec.Struct):
    """An agent's working memory as a snapshot restores it. ``turn`` is the model turn recorded
    at ``step`` and not yet completed by a node (its tool calls may be cut short), or the plan or
    final answer the agent ended with."""

    messages: list[Message] = []
    model: dict[str, Any] = {}
    budget: BudgetState = msgspec.field(default_factory=BudgetState)
    step: int = 0
    prompt: str = ""
    call_counts: dict[str, int] = {}
    turn: RecordedTurn | None = None


# --- worker -> daemon ---------------------------------------------------------------------------


class Register(msgspec.Struct, tag=True):
    worker_id: str
    name: str
    tools: list[str]
    providers: list[str]
    incarnation_seen: str = ""
    pid: int = 0
    instance: str = ""
    """Random per worker process: the same id registering with another instance is a restarted
    worker, whose predecessor's dispatches are lost."""
    plugins: dict[str, str] = {}
    """The plugin distributions the worker loaded, name -> version: it only receives agents of
    sessions whose plugin pins those versions satisfy."""


class RegisterReply(msgspec.Struct):
    ok: bool
    incarnation: str = ""
    reason: str = ""
    heartbeat_interval: float = 1.0


class Beat(msgspec.Struct):
    worker_id: str
    name: str
    incarnation_seen: str
    agents: list[str] = []
    seq: int = 0


class _Report(msgspec.Struct, tag=True):
    worker_id: str
    session_id: str
    agent: str
    epoch: int


class CallResult(msgspec.Struct):
    """The outcome of a journaled call, carried on the ``NodeReport`` of the node that made it
    instead of in its own ``JournalFinish`` (the node's last call only: the daemon appends its
    ``ToolCallRecorded`` before the node's snapshot pointer, saving one round trip per step)."""

    key: str
    tool: str
    outcome: Literal["ok", "error"]
    result: str


class NodeReport(_Report):
    """A node boundary: what the node added to working memory, and why the snapshot is taken.
    ``turn`` is a recorded turn the snapshot still holds (the plan or final answer an agent ended
    with, at its ``affinity_release``); a node that completes a turn carries none."""

    step: int
    new_messages: list[Message]
    model: dict[str, Any]
    budget: BudgetState
    source: str = "node"
    reset: bool = False
    prompt: str = ""
    call_counts: dict[str, int] = {}
    results: list[CallResult] = []
    turn: RecordedTurn | None = None


class JournalBegin(_Report):
    """A side-effecting call about to run. ``probe``: the tool can tell whether an earlier
    attempt's effect happened; ``probed`` carries its answer when the daemon asked for it
    (``not_happened`` or ``cannot_tell``, with ``probe_reason``)."""

    key: str
    tool: str
    args: dict[str, Any]
    idempotent: bool
    on_unknown: str
    probe: bool = False
    probed: str = ""
    probe_reason: str = ""


class TurnReport(_Report):
    """A model turn, to be made durable before it is acted on (snapshot source ``turn``): a turn
    whose tool calls are about to run a side effect (or start a job, or ask a human), or one that
    ends the agent (a plan or a final answer). ``new_messages`` are what the agent added before the
    turn (a new prompt); ``model``, ``budget`` and ``call_counts`` are as they stand once the model
    answered and before any of its calls ran. ``intent`` is the turn's first side-effecting call,
    riding on the report to save a round trip: the reply is then that call's journal answer."""

    step: int
    turn: RecordedTurn
    new_messages: list[Message]
    model: dict[str, Any]
    budget: BudgetState
    prompt: str = ""
    call_counts: dict[str, int] = {}
    intent: JournalBegin | None = None

    source: ClassVar[str] = "turn"
    reset: ClassVar[bool] = False


class JournalFinish(_Report):
    """A journaled call's result; ``resolved_by="probe"`` when a probe found that an earlier
    attempt's effect happened (the result is the probe's)."""

    key: str
    tool: str
    outcome: Literal["ok", "error"]
    result: str
    resolved_by: str = ""


class HitlAsk(_Report):
    pause_id: str
    question: str


class JobStart(_Report):
    job_id: str
    tool: str
    args: dict[str, Any]


class MemoryFetch(_Report):
    """A page of the dispatch's working memory, when the ``Run`` said it comes in pages."""

    page: int


class Done(_Report):
    """A dispatch ended: ``final``, ``plan``, ``paused`` (HITL), ``waiting`` (async job or an
    operator hold), ``failed`` or ``budget_exhausted``."""

    outcome: Literal["final", "plan", "paused", "waiting", "failed", "budget_exhausted"]
    output: str = ""
    plan: list[str] | None = None
    reason: str = ""


Report = (
    NodeReport | TurnReport | JournalBegin | JournalFinish | HitlAsk | JobStart | MemoryFetch | Done
)


class Reply(msgspec.Struct):
    """The daemon's answer to any report. ``status``: ``ok``, ``fenced`` or ``error``; journal and
    HITL answers add a ``decision`` (``run``, ``probe``, ``done``, ``failed``, ``hold``, ``paused``,
    ``answered``, ``waiting``) and a ``result``."""

    status: Literal["ok", "fenced", "error"] = "ok"
    decision: str = ""
    result: str = ""
    outcome: str = ""
    message: str = ""
    data: bytes = b""
    """A page of working memory (the answer to a ``MemoryFetch``)."""


# --- daemon -> worker ---------------------------------------------------------------------------


class Run(msgspec.Struct, tag=True):
    session_id: str
    agent: str
    epoch: int
    config: AgentConfig
    purpose: str
    prompt: str
    task: str = ""
    task_index: int = 0
    memory: AgentMemory | None = None
    incarnation: str = ""
    memory_pages: int = 0
    """When the memory is too large to travel with the dispatch (``memory`` is None then): how
    many pages of its encoded bytes the worker fetches with ``MemoryFetch``, in order."""
    answered_step: int = 0
    """The step of the agent's latest recorded plan or final answer that the daemon took as the
    answer to an earlier ask (0: none). A recorded ending turn at or before it is part of the
    conversation this new ask goes on from; a later one is replayed."""


class Cancel(msgspec.Struct, tag=True):
    session_id: str
    agent: str
    epoch: int
    reason: str = ""


class Reregister(msgspec.Struct, tag=True):
    incarnation: str


DispatchMessage = Run | Cancel | Reregister


class DispatchAck(msgspec.Struct):
    ok: bool
    reason: str = ""


ENCODER = msgspec.msgpack.Encoder()
REPORT_DECODER = msgspec.msgpack.Decoder(Report)
REGISTER_DECODER = msgspec.msgpack.Decoder(Register)
REGISTER_REPLY_DECODER = msgspec.msgpack.Decoder(RegisterReply)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)
BEAT_DECODER = msgspec.msgpack.Decoder(Beat)
DISPATCH_DECODER = msgspec.msgpack.Decoder(DispatchMessage)
DISPATCH_ACK_DECODER = msgspec.msgpack.Decoder(DispatchAck)
MEMORY_DECODER = msgspec.msgpack.Decoder(AgentMemory)
