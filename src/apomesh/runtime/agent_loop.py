"""The agent tool-use loop a worker runs for one dispatch.

Each node is one model turn plus the tool calls it asks for. At each node boundary the loop reports
what the node added to working memory (``NodeReport``); the daemon stores the snapshot and appends
the pointer. Side-effecting tools go through the journal (intent before the effect, result after);
a call found in the journal is served from it, and one an earlier dispatch left with an unknown
outcome is first put to the tool's probe, here where the effect runs, when it has one (the daemon
answers ``probe``; the answer goes back as a result or as a ``not_happened`` intent).

A model turn is made durable before anything depends on it (``TurnRecorder``): a turn whose calls
are about to run a side effect, start a job or ask a human is sent to the daemon (``TurnReport``)
ahead of the first such report, the first journal intent riding on it; a plan or a final answer is
sent before the agent ends with it. A dispatch whose memory holds a recorded turn replays it instead
of asking the model again: the same calls with the same arguments reach the same journal keys (a
call with a logged result is served from the log), and a recorded answer ends the agent with exactly
that output. So a model that answers differently every time still runs each effect at most once.

A human question, an async job or an operator hold stalls the loop: the dispatch ends, and a later
dispatch replays the recorded turn to the same stall, where the answer now waits (pause ids and
journal keys are derived from the call, so nothing is asked or run twice).

Each tool run is timed (a ``ToolTiming`` on the next node report, for the daemon's metrics); with
tracing on, each node, model call and tool run is a span of the dispatch (``runtime.tracing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

from apomesh.builtin.skills import skill_digest
from apomesh.core.errors import ApomeshError, CorruptPin, Fenced, OutcomeUnknown
from apomesh.core.journal import call_key, idempotency_key, pause_key
from apomesh.plugins.api import (
    MODEL_DELTAS,
    Message,
    Model,
    ModelDelta,
    ModelProvider,
    ModelRequest,
    ModelResponse,
    ProbeResult,
    SupervisorPolicy,
    Tool,
    ToolContext,
    describe_tool,
)
from apomesh.runtime.model_calls import FailedAttempt, ModelGaveUp, call_model
from apomesh.runtime.protocol import (
    MODEL_CALL_FAILED,
    AgentMemory,
    BudgetState,
    CallResult,
    Done,
    HitlAsk,
    JobStart,
    JournalBegin,
    JournalFinish,
    ModelCall,
    ModelCallFailed,
    NodeReport,
    RecordedTurn,
    Reply,
    Report,
    Run,
    ToolTiming,
    TurnDelta,
    TurnReport,
)
from apomesh.runtime.tracing import NO_TRACE, DispatchTrace

Send = Callable[[Report], Awaitable[Reply]]

MAX_INTERRUPTIONS = 3
"""How many interrupted runs (``OutcomeUnknown``) of one journaled call a dispatch goes through
the unknown-outcome decision for before it records the last one as the call's error."""


class Stall(Exception):
    """The loop cannot go on in this dispatch (``paused`` or ``waiting``)."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


class LoopContext(msgspec.Struct, dict=True):
    """The ``ToolContext`` a tool sees, bound to one dispatch."""

    run: Run
    worker_id: str
    workspace_root: Path
    send: Send
    step: int = 0
    explicit_checkpoint: bool = False
    asked: dict[str, str] = msgspec.field(default_factory=dict)
    idempotency_key: str = ""
    """The key of the journaled call being run (``core.journal.idempotency_key``), else empty."""
    call_key: str = ""
    """The journal key of the side-effecting call running (or being probed) now."""
    trace: DispatchTrace = NO_TRACE
    """This dispatch's spans (``runtime.tracing``): a tool's run is one of its node's."""
    tool_timings: list[ToolTiming] = msgspec.field(default_factory=list)
    """The tool runs since the last node report, which carries them to the daemon's metrics."""

    def take_tool_timings(self) -> list[ToolTiming]:
        timings, self.tool_timings = self.tool_timings, []
        return timings

    @functools.cached_property
    def workspace(self) -> Path:
        return agent_workspace(self.workspace_root, self.run)

    @property
    def session_id(self) -> str:
        return self.run.session_id

    @property
    def agent(self) -> str:
        return self.run.agent

    @property
    def epoch(self) -> int:
        return self.run.epoch

    async def ask_human(self, question: str) -> str:
        pause_id = pause_key(self.run.agent, self.step, question)
        reply = await _checked(
            self.send(
                HitlAsk(
                    self.worker_id,
                    self.run.session_id,
                    self.run.agent,
                    self.run.epoch,
                    pause_id,
                    question,
                )
            )
        )
        if reply.decision == "answered":
            return reply.result
        raise Stall("paused", f"waiting for a human answer to pause {pause_id}")

    async def checkpoint_now(self) -> None:
        self.explicit_checkpoint = True


SESSION_DIR = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
"""A session id usable as its workspace directory's name (one path component, never ``..``)."""


def agent_workspace(root: Path, run: Run) -> Path:
    """The directory an agent's tools act in: ``<root>/<session id>/`` for a session workspace
    (the default), ``root`` itself when the agent asked for the shared one."""
    if run.config.workspace == "shared":
        return root
    if not SESSION_DIR.match(run.session_id):
        raise ApomeshError(
            f"session id {run.session_id!r} cannot name a workspace directory (letters, digits,"
            " '-' and '_' only); give the agent `workspace = \"shared\"`"
        )
    return root / run.session_id


async def make_workspace(workspace: Path) -> None:
    """Make an agent's workspace directory if it is missing, off the event loop. A ``mkdir``
    writes metadata and can wait on the filesystem while others sync: one held the daemon's
    loop 0.5 s with 10,000 parked sessions (docs/performance.md, fifteenth round). The ``stat``
    that finds an existing directory writes nothing."""
    if not workspace.is_dir():
        await asyncio.to_thread(workspace.mkdir, parents=True, exist_ok=True)


async def _checked(awaitable: Awaitable[Reply]) -> Reply:
    reply = await awaitable
    if reply.status == "fenced":
        raise Fenced(reply.message or "this dispatch was fenced off by a newer epoch")
    if reply.status == "error":
        raise ApomeshError(reply.message or "the daemon refused the report")
    return reply


class CallCounts:
    """How many times this agent made each journaled call (the key its next repeat takes), and
    the counts no report the daemon took has carried yet. A report carries only those
    (``unsent``), so it stays small however many calls the agent has made; the daemon's snapshot
    store keeps each report's counts in its segment and a load merges them
    (``runtime/snapshots.py``)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = dict(counts)
        self._unsent: dict[str, int] = {}

    def take(self, base: str) -> int:
        """Count one more call of ``base``; answers how many were made before it."""
        seen = self.counts.get(base, 0)
        self.counts[base] = self._unsent[base] = seen + 1
        return seen

    def unsent(self) -> dict[str, int]:
        return dict(self._unsent)

    def sent(self, carried: dict[str, int]) -> None:
        """The daemon took a report carrying ``carried``: those need not travel again (a count
        that moved on since still does)."""
        for base, count in carried.items():
            if self._unsent.get(base) == count:
                del self._unsent[base]


class TurnRecorder(msgspec.Struct):
    """Orders what the dispatch sends the daemon, so that a model turn is durable before anything
    acts on it and a step costs one report.

    The loop leaves each new turn's report here (``wait``); it goes to the daemon ahead of the
    first report the turn's tool calls send (``send`` is the dispatch's ``ToolContext``
    transport): a journal intent rides on it, a job start or a human question follows it. A plan
    or a final answer is sent at once (``flush``). A turn whose calls send nothing (read-only
    tools) is never sent: its node records it.

    A node that ends is held here (``hold``) while the model answers the next turn and that turn's
    read-only calls run, at most ``Run.node_delay`` seconds: the next turn's report then carries it
    (``TurnReport.node``: one report, one commit, one append a step). It is sent alone before any
    other report, and once its time is up, from a task of its own while the loop waits on the
    model or a read (``_time_up``): a refusal then cancels the dispatch's task, which ends with
    that refusal (``run_agent``). Nothing that acts waits on a held node: an effect needs a report
    first, and a report takes the node."""

    send_report: Send
    counts: CallCounts
    node_delay: float = 0.0
    waiting: TurnReport | None = None
    carried: int = 0
    """How many of the node's first messages the sent turn report carried (they are stored)."""
    held: NodeReport | None = None
    """The last node's report, held for the next turn to carry (until ``timer`` fires)."""
    timer: asyncio.TimerHandle | None = None
    lock: asyncio.Lock = msgspec.field(default_factory=asyncio.Lock)
    """One report at a time: a model call's failure report, or the held node sent when its time
    is up, may race the loop's next report."""
    refusal: Exception | None = None
    """Why the daemon refused a held node sent alone while the loop awaited something else: every
    later report raises it, and the dispatch ends with it."""
    sending: asyncio.Task[None] | None = None
    """The held node being sent alone because its time is up."""
    loop_task: asyncio.Task[Any] | None = None
    """The dispatch's task (``hold`` notes it), cancelled when a node sent at its time is refused."""

    def wait(self, report: TurnReport) -> None:
        self.waiting, self.carried = report, 0

    async def hold(self, node: NodeReport) -> None:
        """Hold ``node`` for the next turn's report (sent at once when holding is off)."""
        async with self.lock:
            self._check()
            await self._send_held()
            if self.node_delay <= 0:
                await self._send_alone(node)
                return
            self.loop_task = asyncio.current_task()
            self.held = node
            self.timer = asyncio.get_running_loop().call_later(self.node_delay, self._time_up)

    def _time_up(self) -> None:
        self.timer = None
        if self.held is not None:
            self.sending = asyncio.ensure_future(self._send_in_time())

    async def _send_in_time(self) -> None:
        try:
            await self.flush_node()
        except Exception as exc:  # fenced, refused, or the daemon gone
            self.refusal = exc
            if self.loop_task is not None:
                self.loop_task.cancel()

    async def flush_node(self) -> None:
        """Send the held node alone, if there is one."""
        async with self.lock:
            self._check()
            await self._send_held()

    def _check(self) -> None:
        if self.refusal is not None:
            raise self.refusal

    async def send(self, report: Report) -> Reply:
        async with self.lock:
            self._check()
            turn = self._take()
            if turn is None:
                await self._send_held()
                return await self.send_report(report)
            if isinstance(report, JournalBegin):
                node = self._take_held()
                reply = await self.send_report(
                    msgspec.structs.replace(turn, intent=report, node=node)
                )
                if reply.status == "ok":
                    self._sent(turn, node)
                return reply
            await self._send_turn(turn)
            return await self.send_report(report)

    async def flush(self) -> None:
        """Send the waiting turn (a plan or a final answer), with the held node."""
        async with self.lock:
            self._check()
            turn = self._take()
            if turn is None:
                await self._send_held()
            else:
                await self._send_turn(turn)

    def unsent_call(self) -> ModelCall | None:
        """The model call of a turn that was never sent (its node reports it)."""
        return self.waiting.model_call if self.waiting is not None else None

    def node_messages(self, pending: list[Message]) -> list[Message]:
        """What a node reports of its ``pending`` messages: those its turn's report did not carry
        (an unsent turn is dropped: the node records it)."""
        carried, self.carried, self.waiting = self.carried, 0, None
        return pending[carried:]

    def _take(self) -> TurnReport | None:
        turn, self.waiting = self.waiting, None
        if turn is not None:
            self.carried = len(turn.new_messages)
        return turn

    async def _send_turn(self, turn: TurnReport) -> None:
        node = self._take_held()
        carrying = msgspec.structs.replace(turn, node=node) if node is not None else turn
        await _checked(self.send_report(carrying))
        self._sent(turn, node)

    async def _send_held(self) -> None:
        node = self._take_held()
        if node is not None:
            await self._send_alone(node)

    def _take_held(self) -> NodeReport | None:
        node, self.held = self.held, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return node

    async def _send_alone(self, node: NodeReport) -> None:
        await _checked(self.send_report(node))
        self.counts.sent(node.call_counts)

    def _sent(self, turn: TurnReport, node: NodeReport | None) -> None:
        self.counts.sent(turn.call_counts)
        if node is not None:
            self.counts.sent(node.call_counts)


def _turn_message(response: ModelResponse) -> Message:
    """The assistant message a model turn adds to the conversation."""
    if response.final is not None:
        return Message(role="assistant", content=response.final)
    if response.plan is not None:
        return Message(role="assistant", content="\n".join(response.plan))
    return Message(role="assistant", content=response.text, tool_calls=list(response.tool_calls))


def _instructions(run: Run) -> str:
    parts = [run.config.instructions] if run.config.instructions else []
    for skill in run.config.skills:
        parts.append(f"## Skill: {skill.name}\n{skill.body}")
    return "\n\n".join(parts)


def _tool_schemas(tools: dict[str, Tool], names: list[str]) -> list[dict[str, Any]]:
    return [describe_tool(tools[n]) for n in names if n in tools]


def _timed(tool: Tool) -> Tool:
    """``tool`` with each run timed for the daemon's metrics (a ``ToolTiming`` left on the
    dispatch's context; a run that stalls for a human leaves none) and traced."""
    run = tool.run

    async def timed_run(ctx: ToolContext, args: dict[str, Any]) -> str:
        assert isinstance(ctx, LoopContext)
        started = time.monotonic()
        with ctx.trace.tool_call(tool.name) as call:
            try:
                result = await run(ctx, args)
            except Stall:
                call.ended("stalled")
                raise
            except Exception:
                call.ended("error")
                ctx.tool_timings.append(ToolTiming(tool.name, time.monotonic() - started, "error"))
                raise
            call.ended("ok")
            ctx.tool_timings.append(ToolTiming(tool.name, time.monotonic() - started, "ok"))
            return result

    return msgspec.structs.replace(tool, run=timed_run)


def _budget_exhausted(run: Run, budget: BudgetState) -> str | None:
    b = run.config.budget
    if b.max_steps is not None and budget.steps >= b.max_steps:
        return f"budget exhausted: max_steps {b.max_steps} reached"
    if b.max_tool_calls is not None and budget.tool_calls > b.max_tool_calls:
        return f"budget exhausted: max_tool_calls {b.max_tool_calls} exceeded"
    if b.max_tokens is not None and budget.tokens >= b.max_tokens:
        return f"budget exhausted: max_tokens {b.max_tokens} reached"
    if b.max_seconds is not None and budget.seconds >= b.max_seconds:
        return f"budget exhausted: max_seconds {b.max_seconds} reached"
    return None


async def run_agent(
    run: Run,
    *,
    worker_id: str,
    workspace: Path,
    tools: dict[str, Tool],
    providers: dict[str, ModelProvider],
    supervisors: list[SupervisorPolicy],
    send: Send,
    trace: DispatchTrace = NO_TRACE,
    publish_delta: Callable[[TurnDelta], Awaitable[None]] | None = None,
) -> Done:
    """Run one dispatch of an agent until it ends, stalls or is fenced (``Fenced`` propagates).
    ``trace`` gets a span per node, model call and tool run; ``publish_delta`` takes the pieces
    of each model turn while a streaming model writes it. A node still held for a next turn
    (``TurnRecorder``) is sent before the dispatch ends, whatever ends it but a fence."""
    memory = run.memory or AgentMemory()
    recorder = TurnRecorder(send, CallCounts(memory.call_counts), run.node_delay)
    try:
        ended = await _agent_steps(
            run,
            memory,
            recorder,
            worker_id=worker_id,
            workspace=workspace,
            tools=tools,
            providers=providers,
            supervisors=supervisors,
            trace=trace,
            publish_delta=publish_delta,
        )
    except Fenced:
        raise
    except asyncio.CancelledError:
        if recorder.refusal is not None:
            # Cancelled by the refusal of the held node sent alone: end with that refusal.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            raise recorder.refusal from None
        # A worker stopping, or the daemon taking the dispatch back: the node the agent
        # finished is still worth its report (a fenced one is simply refused).
        if recorder.held is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(recorder.flush_node()), CANCEL_FLUSH)
        raise
    except Exception:
        with contextlib.suppress(Exception):
            await recorder.flush_node()
        raise
    await recorder.flush_node()
    return ended


CANCEL_FLUSH = 1.0
"""Seconds a cancelled dispatch gives the node it holds to reach the daemon."""


async def _agent_steps(
    run: Run,
    memory: AgentMemory,
    recorder: TurnRecorder,
    *,
    worker_id: str,
    workspace: Path,
    tools: dict[str, Tool],
    providers: dict[str, ModelProvider],
    supervisors: list[SupervisorPolicy],
    trace: DispatchTrace,
    publish_delta: Callable[[TurnDelta], Awaitable[None]] | None,
) -> Done:
    """The steps of ``run_agent``: model turns and their tool calls, node by node."""
    messages = list(memory.messages)
    model_memory = dict(memory.model)
    budget = BudgetState(**{f: getattr(memory.budget, f) for f in BudgetState.__struct_fields__})
    call_counts = recorder.counts
    step = memory.step
    pending: list[Message] = []
    replay = memory.turn
    if replay is not None and replay.ends_agent and replay.step <= run.answered_step:
        # The plan or final answer the agent ended with was taken as an earlier ask's answer:
        # this new ask goes on from a conversation that holds it.
        pending.append(_turn_message(replay.response))
        replay = None
    prompt = memory.prompt
    if run.prompt and run.prompt != memory.prompt:
        pending.append(Message(role="user", content=run.prompt))
        prompt = run.prompt
    ctx = LoopContext(run, worker_id, workspace, recorder.send, step=step, trace=trace)
    await make_workspace(ctx.workspace)
    provider = providers.get(run.config.model.provider)

    def done(outcome: Any, **kw: Any) -> Done:
        return Done(worker_id, run.session_id, run.agent, run.epoch, outcome=outcome, **kw)

    if provider is None:
        return done(
            "failed", reason=f"model provider {run.config.model.provider!r} is not on this worker"
        )
    for skill in run.config.skills:
        # The body reaches the model only if it is byte for byte the one pinned at start.
        if skill_digest(skill.body) != skill.digest:
            corrupt = CorruptPin(
                "the pinned body does not match its digest", pin=f"skill {skill.name}"
            )
            return done("failed", reason=corrupt.message)
    model: Model = trace.wrap_model(provider.create(run.config.model), run.config.model)
    allowed = [n for n in run.config.tools]
    for skill in run.config.skills:
        allowed.extend(t for t in skill.tools if t not in allowed)
    schemas = _tool_schemas(tools, allowed)
    tools = {name: _timed(tools[name]) for name in allowed if name in tools}
    started = time.monotonic()

    finished: list[CallResult] = []  # the node's last journaled call, reported with the node

    def spent() -> BudgetState:
        budget.seconds = memory.budget.seconds + (time.monotonic() - started)
        return msgspec.structs.replace(budget)

    def time_left() -> float | None:
        limit = run.config.budget.max_seconds
        return None if limit is None else limit - spent().seconds

    async def tell_failure(failed: FailedAttempt) -> None:
        # Only a failed attempt costs this round trip: the daemon logs the wait, so the session
        # shows it, and counts the failure.
        await _checked(
            recorder.send(
                ModelCallFailed(
                    worker_id,
                    run.session_id,
                    run.agent,
                    run.epoch,
                    step=step + 1,
                    attempt=failed.attempt,
                    reason=failed.error.message,
                    seconds=failed.seconds,
                    status=failed.error.status,
                    retry_in=failed.retry_in,
                )
            )
        )

    async def report(
        source: str, reset: bool = False, turn: RecordedTurn | None = None, hold: bool = False
    ) -> None:
        """Report the node that ends here: held for the next turn to carry (``hold``: the loop
        asks the model next), else sent now, after any node still held."""
        nonlocal pending, finished
        node = NodeReport(
            worker_id,
            run.session_id,
            run.agent,
            run.epoch,
            step=step,
            model_call=recorder.unsent_call(),
            new_messages=recorder.node_messages(pending),
            model=model_memory,
            budget=spent(),
            source=source,
            reset=reset,
            prompt=prompt,
            call_counts=call_counts.unsent(),
            results=finished,
            turn=turn,
            tool_timings=ctx.take_tool_timings(),
        )
        pending = []
        finished = []
        if hold:
            await recorder.hold(node)
        else:
            await _checked(recorder.send(node))
            call_counts.sent(node.call_counts)

    async def stream_delta(delta: ModelDelta) -> None:
        if publish_delta is not None:
            await publish_delta(
                TurnDelta(worker_id, run.session_id, run.agent, run.epoch, step + 1, delta)
            )

    streaming = MODEL_DELTAS.set(stream_delta if publish_delta is not None else None)
    try:
        while True:
            trace.start_node()
            if replay is not None:
                # Recorded before a crash cut it short: acted on again, never asked again.
                turn, replay = replay, None
                step = turn.step
            else:
                exhausted = _budget_exhausted(run, spent())
                if exhausted:
                    if pending:
                        await report("node")
                    return done("budget_exhausted", reason=exhausted)
                request = ModelRequest(
                    instructions=_instructions(run),
                    messages=messages + pending,
                    tools=schemas,
                    memory=model_memory,
                    task=run.task,
                    task_index=run.task_index,
                    purpose=run.purpose,
                )
                try:
                    answer = await call_model(
                        model,
                        request,
                        run.config.model.retry,
                        time_left=time_left,
                        on_failure=tell_failure,
                    )
                except ModelGaveUp as gave_up:
                    if pending:
                        await report("node")
                    return done("waiting", reason=MODEL_CALL_FAILED + gave_up.reason)
                response = answer.response
                step += 1
                budget.steps += 1
                budget.tokens += response.tokens or (
                    response.prompt_tokens + response.completion_tokens
                )
                turn = RecordedTurn(step, response)
                recorder.wait(
                    TurnReport(
                        worker_id,
                        run.session_id,
                        run.agent,
                        run.epoch,
                        step=step,
                        turn=turn,
                        new_messages=list(pending),
                        model=dict(response.memory),
                        budget=spent(),
                        prompt=prompt,
                        call_counts=call_counts.unsent(),
                        model_call=ModelCall(
                            answer.seconds,
                            answer.attempts,
                            response.prompt_tokens,
                            response.completion_tokens,
                        ),
                    )
                )
            response = turn.response
            ctx.step = step
            model_memory = dict(response.memory)
            if turn.ends_agent:
                await recorder.flush()
                if response.plan is not None:
                    return done("plan", plan=list(response.plan))
                if run.config.affinity == "sticky":
                    # The agent is done with its worker: record the release point, so a later
                    # dispatch (another worker) starts from exactly what this one ended with.
                    await report("affinity_release", turn=turn)
                return done("final", output=response.final or "")
            pending.append(_turn_message(response))
            last_call = len(response.tool_calls) - 1
            for i, call in enumerate(response.tool_calls):
                budget.tool_calls += 1
                result = await _call_tool(
                    ctx,
                    tools,
                    allowed,
                    call.tool,
                    call.args,
                    call_counts,
                    defer=finished if i == last_call else None,
                )
                pending.append(
                    Message(role="tool", content=result, tool_call_id=f"{step}.{i}", name=call.tool)
                )
            messages.extend(pending)
            source = "explicit" if ctx.explicit_checkpoint else "node"
            ctx.explicit_checkpoint = False
            # The first supervisor that asks for a reset (later ones are not asked), before the
            # node is held: a reset node goes at once.
            reset_by = next(
                (p for p in supervisors if p.review(run.agent, step, messages[-12:]) == "reset"),
                None,
            )
            await report(source, hold=reset_by is None)
            trace.end_node(step)
            if reset_by is not None:
                await report("reset_point")
                note = Message(
                    role="user",
                    content=f"[supervisor {reset_by.name}] you were repeating yourself; start over: {prompt}",
                )
                messages = [note]
                pending = [note]
                await report("node", reset=True)
    except Stall as stall:
        return done(stall.outcome, reason=stall.reason)
    finally:
        MODEL_DELTAS.reset(streaming)


async def _call_tool(
    ctx: LoopContext,
    tools: dict[str, Tool],
    allowed: list[str],
    name: str,
    args: dict[str, Any],
    call_counts: CallCounts,
    defer: list[CallResult] | None = None,
) -> str:
    """Run one tool call. A journaled call's result goes to ``defer`` when given (the node
    report carries it, right after this call), else in its own ``JournalFinish``."""
    ctx.idempotency_key = ""  # a read-only call has none, whatever ran before it
    tool = tools.get(name)
    if tool is None or name not in allowed:
        return f"error: tool {name!r} is not available to this agent"
    if not tool.journaled(args) and not tool.async_job:
        try:
            return await tool.run(ctx, args)
        except Stall:
            raise
        except ApomeshError as exc:
            return f"error: {exc.message}"
        except Exception as exc:  # a tool's own failure is something the model should see
            return f"error: {type(exc).__name__}: {exc}"
    base = call_key(name, args)
    seen = call_counts.take(base)
    key = base if seen == 0 else f"{base}-{seen}"
    run = ctx.run
    if tool.async_job:
        reply = await _checked(
            ctx.send(JobStart(ctx.worker_id, run.session_id, run.agent, run.epoch, key, name, args))
        )
        if reply.decision == "done":
            return reply.result
        raise Stall("waiting", f"waiting for async job {name} {key[:12]}")
    ctx.call_key = key
    # One key for the probe and the run alike: a probe looks for the evidence the effect left
    # under it.
    ctx.idempotency_key = idempotency_key(run.session_id, run.agent, key)

    def begin(probed: str = "", reason: str = "", interrupted: str = "") -> JournalBegin:
        return JournalBegin(
            ctx.worker_id,
            run.session_id,
            run.agent,
            run.epoch,
            key=key,
            tool=name,
            args=args,
            idempotent=tool.idempotent,
            on_unknown=tool.on_unknown,
            probe=tool.probe is not None,
            probed=probed,
            probe_reason=reason,
            interrupted=interrupted,
        )

    def finish(
        outcome: Literal["ok", "error"], result: str, resolved_by: str = ""
    ) -> JournalFinish:
        return JournalFinish(
            ctx.worker_id,
            run.session_id,
            run.agent,
            run.epoch,
            key=key,
            tool=name,
            outcome=outcome,
            result=result,
            resolved_by=resolved_by,
        )

    interrupted = ""
    interruptions = 0
    reply = await _checked(ctx.send(begin()))
    outcome: Literal["ok", "error"]
    try:
        while True:
            if reply.decision == "probe" and tool.probe is not None:
                # An intent with no result (an earlier dispatch's, or this run's, interrupted):
                # ask the tool, here where the effect runs, whether it happened; the daemon
                # logs the answer.
                try:
                    probed = await tool.probe(ctx, args)
                except Exception as exc:
                    probed = ProbeResult("cannot_tell", reason=f"the probe failed: {exc}")
                if probed.status == "happened":
                    await _checked(ctx.send(finish("ok", probed.result, resolved_by="probe")))
                    return probed.result
                reply = await _checked(
                    ctx.send(begin(probed.status, probed.reason, interrupted=interrupted))
                )
            if reply.decision == "done":
                return reply.result if reply.outcome == "ok" else f"error: {reply.result}"
            if reply.decision == "failed":
                return f"error: outcome unknown for {name}: {reply.message}"
            if reply.decision == "hold":
                raise Stall(
                    "waiting", f"held for an operator: outcome of {name} {key[:12]} unknown"
                )
            if reply.decision != "run":
                raise ApomeshError(f"the daemon answered {reply.decision!r} to the journal intent")
            try:
                result = await tool.run(ctx, args)
                outcome = "ok"
            except OutcomeUnknown as exc:
                interruptions += 1
                if interruptions > MAX_INTERRUPTIONS:
                    result, outcome = exc.message, "error"
                    break
                # Whether the effect happened is not known (the tool says so): the daemon
                # decides as for an intent a crash left without its result (a probe, a re-run
                # of an idempotent call under its key, or the tool's ``on_unknown``).
                interrupted = exc.message
                reply = await _checked(ctx.send(begin(interrupted=interrupted)))
                continue
            except ApomeshError as exc:
                result, outcome = exc.message, "error"
            except Exception as exc:
                result, outcome = f"{type(exc).__name__}: {exc}", "error"
            break
    finally:
        ctx.idempotency_key = ""
    if defer is not None:
        defer.append(CallResult(key=key, tool=name, outcome=outcome, result=result))
        return result if outcome == "ok" else f"error: {result}"
    await _checked(ctx.send(finish(outcome, result)))
    return result if outcome == "ok" else f"error: {result}"
