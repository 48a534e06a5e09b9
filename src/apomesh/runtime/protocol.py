"""The control plane between daemons and workers, over core NATS only.

Several daemons may share one NATS and every worker on it: a worker serves them all. Each daemon
has a stable id (kept in its data dir) and an incarnation (fresh at every start). Daemons learn
workers from beats: a worker beats on ``apomesh.hb.<worker_id>`` with its load (the agents it
runs), its capacity and the incarnation of every daemon it is registered with; a daemon that sees
a beat without its own current incarnation asks that worker to register (``Reregister`` on the
worker's dispatch subject, as a starting daemon does for every worker in the heartbeat stream),
and the worker registers with that daemon alone. A worker so never needs to know any daemon in
advance. A dispatch (``Run``, on ``apomesh.dispatch.<worker_id>``) names its daemon and
incarnation; every report of that dispatch goes to that daemon's own control subjects,
``apomesh.ctl.<daemon_id>.<verb>.<worker_id>``, never to another's. The worker tracks incarnations
per daemon id: a new incarnation of daemon X abandons only X's older dispatches (X recovers them
under new epochs), and a daemon that stops answering a dispatch's reports for
``[workers] daemon_gone_after`` seconds loses that dispatch (the session's new owner dispatches it
again under a new epoch), so no worker slot stays wedged. A worker runs at most ``max_agents``
dispatches at once and refuses one more (``DispatchAck.full``); a daemon places no agent on a
worker it knows to be full, and one that finds a dispatch it sent gone from the worker's later
beats (``DispatchAck.beat_seq``) dispatches it again.

Every subject a worker uses names it, so NATS permissions can bind a worker id to the credentials
it connects with (``apomesh.ctl.*.*.<worker_id>``), and the daemon refuses a message whose payload
names another worker than its subject. Its request inboxes are under ``_INBOX.worker.<worker_id>``.
NATS does not check the reply subject of a request against the sender's permissions, and the
daemon answers with its own (JetStream, KV, the log): it answers only a request on a bound subject
whose reply subject is that worker's own inbox (``answerable``) and drops anything else. Every
report names the agent and carries the fencing epoch of the dispatch it belongs to; the daemon
answers ``Fenced`` to a stale epoch and appends nothing. Workers never send events: they send
facts (a node's new messages, a journal step, an outcome) and the daemon decides which events to
append. All messages are msgpack-encoded msgspec Structs.

No message may outgrow the NATS ``max_payload``. A dispatch carries the agent's working memory
only while it is small; a larger memory stays on the daemon and the worker fetches it page by page
(``MemoryFetch`` on ``apomesh.ctl.<daemon_id>.memory.<worker_id>``, each page answered on the
worker's own inbox and fenced by the dispatch's epoch like any report).

While a streaming model writes its answer the worker publishes the pieces (``TurnDelta``, a
plain publish, never a request: nothing waits for them and nothing is recorded) on
``apomesh.ctl.<daemon_id>.delta.<worker_id>``; the daemon passes on only those of a dispatch it
sent to that worker under that epoch, to the session's live event streams.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import msgspec

from apomesh.core.definition import AgentConfig
from apomesh.plugins.api import Message, ModelDelta, ModelResponse

VERB_REGISTER = "register"
VERB_NODE = "node"
VERB_TURN = "turn"
VERB_JOURNAL = "journal"
VERB_HITL = "hitl"
VERB_JOB = "job"
VERB_DONE = "done"
VERB_MEMORY = "memory"
VERB_MODEL = "model"
VERB_DELTA = "delta"
MODEL_CALL_FAILED = "held: the model call failed: "
"""How the reason of a dispatch that ends on a failed model call begins (``Done`` ``waiting``):
the session waits for an operator (``model_failed`` on the recoverable list) to resume it once
the cause (a key, a quota, an outage) is dealt with."""
CTL_PREFIX = "apomesh.ctl."
CTL_BOUND_WILDCARD = "apomesh.ctl.*.*.*"
"""Every daemon's control subjects (``apomesh.ctl.<daemon_id>.<verb>.<worker_id>``)."""
HB_PREFIX = "apomesh.hb."
ECHO_PREFIX = "apomesh.echo."
"""``<prefix><incarnation>``: what a daemon sends itself to know NATS still delivers to it
(``WorkerPool.liveness_forever``: a worker's silence counts only while the daemon hears)."""
DISPATCH_PREFIX = "apomesh.dispatch."
WORKER_INBOX_PREFIX = "_INBOX.worker."
DEFAULT_MAX_AGENTS = 32
"""How many agents a worker runs at once unless told otherwise (``[workers] max_agents``)."""
DEFAULT_DAEMON_GONE_AFTER = 30.0
"""Seconds a daemon may leave a dispatch's reports unanswered before the worker abandons it
(``[workers] daemon_gone_after``)."""


def dispatch_subject(worker_id: str) -> str:
    return f"{DISPATCH_PREFIX}{worker_id}"


def beat_subject(worker_id: str) -> str:
    return f"{HB_PREFIX}{worker_id}"


def control_subject(daemon_id: str, verb: str, worker_id: str) -> str:
    """The subject worker ``worker_id`` sends ``verb`` (``VERB_NODE``, ``VERB_REGISTER``, ...) to
    daemon ``daemon_id`` on."""
    return f"{CTL_PREFIX}{daemon_id}.{verb}.{worker_id}"


def daemon_control_wildcard(daemon_id: str, verb: str = "*") -> str:
    """The control subjects one daemon listens on (every worker's, one verb or all)."""
    return f"{CTL_PREFIX}{daemon_id}.{verb}.*"


def worker_control_subjects(worker_id: str) -> str:
    """Every control subject worker ``worker_id`` may send on (to any daemon, any verb)."""
    return f"{CTL_PREFIX}*.*.{worker_id}"


def worker_inbox_prefix(worker_id: str) -> str:
    """The inbox prefix of a worker's NATS connection, so permissions can give each worker its
    own replies and nobody else's."""
    return f"{WORKER_INBOX_PREFIX}{worker_id}"


def subject_worker(subject: str) -> str | None:
    """The worker id a bound control subject names, or ``None`` for any other subject."""
    tokens = subject.split(".")
    if len(tokens) != 5 or not subject.startswith(CTL_PREFIX):
        return None
    return tokens[4] or None


def subject_verb(subject: str) -> str:
    """The verb of a bound control subject (``register``, ``node``, ...), else ``""``."""
    tokens = subject.split(".")
    return tokens[3] if len(tokens) == 5 and subject.startswith(CTL_PREFIX) else ""


def answerable(subject: str, reply: str) -> bool:
    """Whether the daemon may answer a request on control ``subject`` at ``reply``: only when the
    subject is bound to a worker (``apomesh.ctl.<daemon_id>.<verb>.<worker_id>``) and the reply
    subject lies in that worker's own inbox (``_INBOX.worker.<worker_id>.``), the one place its
    permissions let it hear. Any other reply subject (the JetStream API, a session's log, a KV
    key, another worker's inbox) would be published with the daemon's rights on the sender's
    say-so."""
    worker_id = subject_worker(subject)
    if worker_id is None:
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
    return check_token(worker_id, "worker id")


def check_token(value: str, what: str) -> str:
    """``value`` (a worker or daemon id) when it can be one subject token; ``ValueError``
    naming ``what`` otherwise."""
    if not value or any(c in value for c in ".*> \t\r\n") or not value.isprintable():
        raise ValueError(
            f"{what} {value!r} cannot be a NATS subject token (no dots, wildcards or spaces)"
        )
    return value


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
    """A worker registering with one daemon (on that daemon's ``register`` subject), when the
    daemon asked it to (``Reregister``)."""

    worker_id: str
    name: str
    tools: list[str]
    providers: list[str]
    pid: int = 0
    instance: str = ""
    """Random per worker process: the same id registering with another instance is a restarted
    worker, whose predecessor's dispatches are lost."""
    plugins: dict[str, str] = {}
    """The plugin distributions the worker loaded, name -> version: it only receives agents of
    sessions whose plugin pins those versions satisfy."""
    max_agents: int = DEFAULT_MAX_AGENTS
    """How many agents the worker runs at once, for every daemon together."""


class RegisterReply(msgspec.Struct):
    ok: bool
    incarnation: str = ""
    reason: str = ""
    heartbeat_interval: float = 1.0
    daemon: str = ""
    """The id of the daemon that answered."""


class Beat(msgspec.Struct):
    """A worker's heartbeat, heard by every daemon. ``agents`` maps each dispatch it runs (for
    every daemon), ``session/agent``, to its epoch: its load; ``daemons`` maps each daemon id it
    is registered with to that daemon's incarnation."""

    worker_id: str
    name: str
    daemons: dict[str, str] = {}
    agents: dict[str, int] = {}
    seq: int = 0
    max_agents: int = DEFAULT_MAX_AGENTS


class _Report(msgspec.Struct, tag=True):
    worker_id: str
    session_id: str
    agent: str
    epoch: int


class ModelCall(msgspec.Struct):
    """A model call that answered: how long its last attempt took, after how many attempts, and
    the tokens the provider counted. It rides on the first report that records its turn."""

    seconds: float
    attempts: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ModelCallFailed(_Report):
    """An attempt of a model call failed (only sent when one does): ``retry_in`` seconds until the
    next attempt, or None when the call is given up (the dispatch's ``Done`` follows)."""

    step: int
    attempt: int
    reason: str
    seconds: float
    status: int | None = None
    retry_in: float | None = None


class CallResult(msgspec.Struct):
    """The outcome of a journaled call, carried on the ``NodeReport`` of the node that made it
    instead of in its own ``JournalFinish`` (the node's last call only: the daemon appends its
    ``ToolCallRecorded`` before the node's snapshot pointer, saving one round trip per step)."""

    key: str
    tool: str
    outcome: Literal["ok", "error"]
    result: str


class ToolTiming(msgspec.Struct, array_like=True):
    """How long one tool call ran on the worker and whether it returned (``ok``) or raised
    (``error``); carried on the next ``NodeReport`` for the daemon's metrics."""

    tool: str
    seconds: float
    outcome: Literal["ok", "error"]


class NodeReport(_Report):
    """A node boundary: what the node added to working memory, and why the snapshot is taken.
    ``turn`` is a recorded turn the snapshot still holds (the plan or final answer an agent ended
    with, at its ``affinity_release``); a node that completes a turn carries none.
    ``tool_timings`` are the tool runs since the last node report, for the daemon's metrics.
    ``call_counts`` are the journaled-call counts that changed since the agent's last report the
    daemon took (a repeat's key comes from them); the snapshot store merges them."""

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
    model_call: ModelCall | None = None
    """The model call of this node, when no ``TurnReport`` carried it."""
    tool_timings: list[ToolTiming] = []


class JournalBegin(_Report):
    """A side-effecting call about to run. ``probe``: the tool can tell whether an earlier
    attempt's effect happened; ``probed`` carries its answer when the daemon asked for it
    (``not_happened`` or ``cannot_tell``, with ``probe_reason``). ``interrupted``: this dispatch
    ran the call and the tool cannot tell whether its effect happened (``OutcomeUnknown``: a
    connection that broke mid-call, a timeout), with why; the daemon decides it like an
    intent a crash left without a result."""

    key: str
    tool: str
    args: dict[str, Any]
    idempotent: bool
    on_unknown: str
    probe: bool = False
    probed: str = ""
    probe_reason: str = ""
    interrupted: str = ""


class TurnReport(_Report):
    """A model turn, to be made durable before it is acted on (snapshot source ``turn``): a turn
    whose tool calls are about to run a side effect (or start a job, or ask a human), or one that
    ends the agent (a plan or a final answer). ``new_messages`` are what the agent added before the
    turn (a new prompt); ``model`` and ``budget`` are as they stand once the model answered and
    before any of its calls ran, ``call_counts`` the counts changed since the agent's last report
    the daemon took (as for ``NodeReport``). ``intent`` is the turn's first side-effecting call,
    riding on the report to save a round trip: the reply is then that call's journal answer.
    ``node`` is the agent's node before this turn, which the worker held while the model answered
    (at most ``Run.node_delay``): the daemon logs its results and stores its snapshot in the same
    decision, commit and append as the turn, so a step is one report, one commit and one append."""

    step: int
    turn: RecordedTurn
    new_messages: list[Message]
    model: dict[str, Any]
    budget: BudgetState
    prompt: str = ""
    call_counts: dict[str, int] = {}
    intent: JournalBegin | None = None
    model_call: ModelCall | None = None
    node: NodeReport | None = None

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
    NodeReport
    | TurnReport
    | JournalBegin
    | JournalFinish
    | HitlAsk
    | JobStart
    | MemoryFetch
    | ModelCallFailed
    | Done
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
    """The incarnation of the dispatching daemon (stamped by its worker pool)."""
    daemon: str = ""
    """The id of the dispatching daemon: every report of this dispatch goes to its control
    subjects."""
    memory_pages: int = 0
    """When the memory is too large to travel with the dispatch (``memory`` is None then): how
    many pages of its encoded bytes the worker fetches with ``MemoryFetch``, in order."""
    answered_step: int = 0
    """The step of the agent's latest recorded plan or final answer that the daemon took as the
    answer to an earlier ask (0: none). A recorded ending turn at or before it is part of the
    conversation this new ask goes on from; a later one is replayed."""
    node_delay: float = 0.0
    """Seconds the worker may hold a node's report for the agent's next model turn to carry it
    (``TurnReport.node``); past that, or when another report must go first, the node is sent
    alone. 0: every node is sent as it ends."""


class Cancel(msgspec.Struct, tag=True):
    session_id: str
    agent: str
    epoch: int
    reason: str = ""


class Reregister(msgspec.Struct, tag=True):
    """Daemon ``daemon`` (now at ``incarnation``) asks the worker to register with it."""

    incarnation: str
    daemon: str = ""


DispatchMessage = Run | Cancel | Reregister


class DispatchAck(msgspec.Struct):
    ok: bool
    reason: str = ""
    full: bool = False
    """Refused because the worker already runs ``max_agents`` agents."""
    beat_seq: int = 0
    """The worker's latest beat when it took the dispatch: a later beat not listing the agent
    means the worker no longer runs it."""


LocalDispatch = Callable[[bytes, "dict[str, str] | None"], DispatchAck]
"""How a daemon hands an encoded dispatch (and its trace headers) to a worker in its own process
and event loop (``Worker.take_dispatch``): the worker's answer at once, no NATS round trip."""


class TurnDelta(msgspec.Struct, tag=True):
    """A piece of the model turn ``step`` of an agent, published while the model writes it."""

    worker_id: str
    session_id: str
    agent: str
    epoch: int
    step: int
    delta: ModelDelta


MAX_DELTA_BYTES = 64 * 1024
"""The largest ``TurnDelta`` a daemon passes on (a worker sends small pieces)."""
DELTA_PIECE_CHARS = 8 * 1024
"""The most characters of text or arguments one ``TurnDelta`` carries (``delta_pieces``)."""


def delta_pieces(delta: ModelDelta, size: int = DELTA_PIECE_CHARS) -> list[ModelDelta]:
    """``delta`` cut so that none carries more than ``size`` characters of text or arguments
    (a server may send a whole tool call, arguments and all, in one chunk); the tool's name
    stays on the first piece."""
    if len(delta.text) <= size and len(delta.arguments) <= size:
        return [delta]
    field = "text" if delta.kind == "text" else "arguments"
    whole: str = getattr(delta, field)
    pieces = [
        msgspec.structs.replace(delta, **{field: whole[i : i + size]})
        for i in range(0, len(whole), size)
    ]
    return [pieces[0], *(msgspec.structs.replace(p, tool="") for p in pieces[1:])]


ENCODER = msgspec.msgpack.Encoder()
REPORT_DECODER = msgspec.msgpack.Decoder(Report)
DELTA_DECODER = msgspec.msgpack.Decoder(TurnDelta)
REGISTER_DECODER = msgspec.msgpack.Decoder(Register)
REGISTER_REPLY_DECODER = msgspec.msgpack.Decoder(RegisterReply)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)
BEAT_DECODER = msgspec.msgpack.Decoder(Beat)
DISPATCH_DECODER = msgspec.msgpack.Decoder(DispatchMessage)
DISPATCH_ACK_DECODER = msgspec.msgpack.Decoder(DispatchAck)
MEMORY_DECODER = msgspec.msgpack.Decoder(AgentMemory)
