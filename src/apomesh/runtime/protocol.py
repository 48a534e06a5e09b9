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
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

from apomesh.core.definition import AgentConfig
from apomesh.plugins.api import Message

SUBJECT_REGISTER = "apomesh.ctl.register"
SUBJECT_NODE = "apomesh.ctl.node"
SUBJECT_JOURNAL = "apomesh.ctl.journal"
SUBJECT_HITL = "apomesh.ctl.hitl"
SUBJECT_JOB = "apomesh.ctl.job"
SUBJECT_DONE = "apomesh.ctl.done"
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


class AgentMemory(msgspec.Struct):
    """An agent's working memory as a snapshot restores it."""

    messages: list[Message] = []
    model: dict[str, Any] = {}
    budget: BudgetState = msgspec.field(default_factory=BudgetState)
    step: int = 0
    prompt: str = ""
    call_counts: dict[str, int] = {}


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
    """A node boundary: what the node added to working memory, and why the snapshot is taken."""

    step: int
    new_messages: list[Message]
    model: dict[str, Any]
    budget: BudgetState
    source: str = "node"
    reset: bool = False
    prompt: str = ""
    call_counts: dict[str, int] = {}
    results: list[CallResult] = []


class JournalBegin(_Report):
    key: str
    tool: str
    args: dict[str, Any]
    idempotent: bool
    on_unknown: str


class JournalFinish(_Report):
    key: str
    tool: str
    outcome: Literal["ok", "error"]
    result: str


class HitlAsk(_Report):
    pause_id: str
    question: str


class JobStart(_Report):
    job_id: str
    tool: str
    args: dict[str, Any]


class Done(_Report):
    """A dispatch ended: ``final``, ``plan``, ``paused`` (HITL), ``waiting`` (async job or an
    operator hold), ``failed`` or ``budget_exhausted``."""

    outcome: Literal["final", "plan", "paused", "waiting", "failed", "budget_exhausted"]
    output: str = ""
    plan: list[str] | None = None
    reason: str = ""


Report = NodeReport | JournalBegin | JournalFinish | HitlAsk | JobStart | Done


class Reply(msgspec.Struct):
    """The daemon's answer to any report. ``status``: ``ok``, ``fenced`` or ``error``; journal and
    HITL answers add a ``decision`` (``run``, ``done``, ``failed``, ``hold``, ``paused``,
    ``answered``, ``waiting``) and a ``result``."""

    status: Literal["ok", "fenced", "error"] = "ok"
    decision: str = ""
    result: str = ""
    outcome: str = ""
    message: str = ""


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
