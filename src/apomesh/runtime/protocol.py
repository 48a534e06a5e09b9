"""The control plane between the daemon and its workers, over core NATS only.

Workers never touch JetStream: they register (``apomesh.ctl.register``), beat on
``apomesh.hb.<worker_id>``, take dispatches on ``apomesh.dispatch.<worker_id>`` and report back with
requests on ``apomesh.ctl.<verb>``. Every report names the agent and carries the fencing epoch of
the dispatch it belongs to; the daemon answers ``Fenced`` to a stale epoch and appends nothing.
Workers never send events: they send facts (a node's new messages, a journal step, an outcome) and
the daemon decides which events to append. All messages are msgpack-encoded msgspec Structs.
"""

from __future__ import annotations

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
CTL_WILDCARD = "apomesh.ctl.*"
HB_PREFIX = "apomesh.hb."
DISPATCH_PREFIX = "apomesh.dispatch."


def dispatch_subject(worker_id: str) -> str:
    return f"{DISPATCH_PREFIX}{worker_id}"


def beat_subject(worker_id: str) -> str:
    return f"{HB_PREFIX}{worker_id}"


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
