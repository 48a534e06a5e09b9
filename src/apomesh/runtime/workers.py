"""The daemon's worker pool: registration, liveness by heartbeat, placement of agents on workers,
and the dispatches in flight on each worker.

``WorkerPool`` knows workers and dispatches, never sessions. Workers are shared by every daemon
on the NATS: the pool learns them from their beats and asks each to register with this daemon
(``runtime.protocol``). A session's writer asks it for a worker (``pick``: a capable worker with
room, by the load its beats report for every daemon plus this daemon's own dispatches), tracks the
dispatch it sends there (``track``/``send_run``, which names this daemon and incarnation), and
waits on the dispatch's future; when a worker is declared lost (missed heartbeats, or it
registered again from a new process) the pool fails that worker's own dispatches with
``WorkerLost`` and the writer re-dispatches, as it does for a dispatch the worker's later beats
no longer list (it abandoned it). The control plane hands it decoded registrations and beats;
nothing else writes its tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from apomesh.core.definition import AgentConfig
from apomesh.core.errors import PayloadTooLarge
from apomesh.core.events import PluginPin
from apomesh.plugins.pins import worker_pin_problem
from apomesh.runtime import tracing
from apomesh.runtime.config import Config
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.progress import Waiting
from apomesh.runtime.protocol import (
    DEFAULT_MAX_AGENTS,
    DISPATCH_ACK_DECODER,
    ECHO_PREFIX,
    ENCODER,
    Beat,
    Cancel,
    LocalDispatch,
    Register,
    RegisterReply,
    Reregister,
    Run,
    dispatch_subject,
)

LOST_WORKERS_KEPT = 64
"""How many workers declared lost the pool keeps listing (``GET /v1/workers``, ``alive`` false)."""
REFUSED_ASK_AGAIN = 30.0
"""Seconds before a worker whose registration was refused is asked to register again."""


class WorkerLost(Exception):
    """The worker a dispatch ran on was declared lost."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(reason)
        self.worker_id = worker_id
        self.reason = reason


ECHO_TRIES = 40
"""Liveness ticks the daemon sends its echo without any coming back before it gives up on it."""


class WorkerInfo(msgspec.Struct):
    worker_id: str
    name: str
    tools: list[str]
    providers: list[str]
    last_seen: float
    last_beat_wall: float
    agents: set[str] = msgspec.field(default_factory=set)
    """The agents (``session/agent``) its latest beat lists, for every daemon."""
    listed_mine: int = 0
    """How many of ``agents`` this daemon has a dispatch in flight for (kept as dispatches come
    and go, so placement never walks ``agents``)."""
    load: int = 0
    instance: str = ""
    plugins: dict[str, str] = msgspec.field(default_factory=dict)
    max_agents: int = DEFAULT_MAX_AGENTS
    full_at: int | None = None
    """The beat it had sent when it refused a dispatch for being full: it counts as full until
    a later beat says otherwise."""
    beat_seq: int = 0


class Dispatch(msgspec.Struct, eq=False):
    """One run sent to a worker: its outcome arrives on ``future`` (a ``Done``), or ``WorkerLost``."""

    worker_id: str
    session_id: str
    agent: str
    epoch: int
    future: asyncio.Future[Any]
    acked_seq: int | None = None
    """The worker's beat sequence number when it acknowledged the dispatch."""

    @property
    def key(self) -> str:
        """``session/agent``, as beats list the agents a worker runs."""
        return f"{self.session_id}/{self.agent}"


JUDGED_PAST_THRESHOLD = 0.002
"""Seconds past a worker's threshold of silence at which the judgement due then runs (its
silence must exceed the threshold, and the loop's clock has a millisecond's grain)."""


def next_judgement(now: float, tick: float, last_seen: Iterable[float], threshold: float) -> float:
    """Seconds from ``now`` to the next liveness judgement: one ``tick``, or less when a worker's
    silence (since ``last_seen``) passes ``threshold`` sooner, so a lost worker is declared just
    past its threshold rather than up to a tick later. A threshold already passed (its judgement
    deferred: beats still unread, a reconnection's grace) waits the tick."""
    wait = tick
    for seen in last_seen:
        due = seen + threshold - now + JUDGED_PAST_THRESHOLD
        if 0.0 < due < wait:
            wait = due
    return wait


class WorkerPool:
    """Registered workers, their liveness and load, and the dispatches in flight on each."""

    def __init__(
        self,
        config: Config,
        *,
        nc: NATS,
        incarnation: str,
        daemon_id: str = "",
        metrics: DaemonMetrics,
        on_registered: Callable[[], Awaitable[None]],
        logger: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.nc = nc
        self.incarnation = incarnation
        self.daemon_id = daemon_id or incarnation
        """This daemon's stable id (set by the daemon at start, before any worker is heard)."""
        self.metrics = metrics
        self.on_registered = on_registered
        self.log = logger or logging.getLogger("apomesh.daemon")
        self.interval = config.liveness.heartbeat_interval
        self.threshold = config.liveness.heartbeat_interval * config.liveness.missed_beats
        self.workers: dict[str, WorkerInfo] = {}
        self.lost_workers: dict[str, WorkerInfo] = {}
        """Workers declared lost, newest last, listed as such until they register again."""
        self._in_flight: dict[str, dict[str, set[Dispatch]]] = {}
        """Worker -> ``Dispatch.key`` -> the dispatches of that agent in flight on it (an ack, a
        delta's fence and placement look one agent up among thousands: never a walk of all)."""
        self._reregister_sent: dict[str, float] = {}
        self._dispatch_refused: dict[str, float] = {}
        self._registration_refused: dict[str, float] = {}
        self._reconnected_at = time.monotonic()
        self.waiting_for_room = Waiting()
        """Agents waiting in ``pick`` for room on a capable worker now, and their one warning."""
        self.local_workers: dict[str, LocalDispatch] = {}
        """Workers in this very process (``Worker.take_dispatch``), by id: dispatches and cancels
        to them skip the NATS round trip (a resumed agent's dispatch carries its whole memory)."""
        self._was_connected = True
        self._heard_at = time.monotonic()
        """When this daemon's echo last came back (``liveness_forever``)."""
        self._echo_works = False
        """Whether an echo ever came back: until one does (a control login not allowed
        ``apomesh.echo.*``), liveness judges as if it always did, and after ``ECHO_TRIES`` ticks
        stops sending them."""

    # --- registration and beats (handed over by the control plane) -------------------------------

    async def register(self, reg: Register) -> RegisterReply:
        """Admit (or refuse) a worker's registration; its identity was checked by the control plane."""
        allowed_tools = set(self.config.workers.allowed_tools)
        allowed_providers = set(self.config.workers.allowed_providers)
        bad = [t for t in reg.tools if allowed_tools and t not in allowed_tools]
        bad += [p for p in reg.providers if allowed_providers and p not in allowed_providers]
        if bad:
            self.log.warning("refused worker %s: not allowed: %s", reg.worker_id, ", ".join(bad))
            self._registration_refused[reg.worker_id] = time.monotonic()
            return RegisterReply(
                False,
                reason=f"not allowed by the daemon's config: {', '.join(bad)}",
                daemon=self.daemon_id,
            )
        self._registration_refused.pop(reg.worker_id, None)
        known = self.workers.get(reg.worker_id)
        if known is not None and known.instance and reg.instance and known.instance != reg.instance:
            # The same identity from a new process: whatever the old one ran died with it.
            await self.worker_lost(reg.worker_id, "it registered again from a new process")
            known = None
        self.workers[reg.worker_id] = WorkerInfo(
            reg.worker_id,
            reg.name,
            reg.tools,
            reg.providers,
            time.monotonic(),
            time.time(),
            load=known.load if known else 0,
            instance=reg.instance,
            plugins=dict(reg.plugins),
            max_agents=max(1, reg.max_agents),
            agents=known.agents if known else set(),
            listed_mine=known.listed_mine if known else 0,
            beat_seq=known.beat_seq if known else 0,
        )
        self.lost_workers.pop(reg.worker_id, None)
        self.log.info(
            "worker %s (%s) registered, %d agents at most", reg.worker_id, reg.name, reg.max_agents
        )
        return RegisterReply(
            True,
            incarnation=self.incarnation,
            heartbeat_interval=self.interval,
            daemon=self.daemon_id,
        )

    async def registered(self) -> None:
        """The registration was answered: wake whoever waits for a worker."""
        await self.on_registered()

    async def beat(self, beat: Beat) -> None:
        """A worker's beat: it is alive; it runs ``beat.agents`` (for every daemon); a dispatch
        of ours it acknowledged before this beat and no longer lists at its epoch was abandoned
        or replaced (its writer dispatches it again); a beat without our incarnation asks it to
        register with us."""
        self.metrics.heartbeats_received.inc()
        worker = self.workers.get(beat.worker_id)
        if worker is None or beat.daemons.get(self.daemon_id) != self.incarnation:
            await self.ask_reregister(beat.worker_id)
            if worker is None:
                return
        worker.last_seen = time.monotonic()
        worker.last_beat_wall = time.time()
        if beat.seq < worker.beat_seq:
            return  # an older beat (or a restarted process, which registers anew)
        worker.beat_seq = beat.seq
        worker.agents = set(beat.agents)
        mine = self._in_flight.get(beat.worker_id, {})
        worker.listed_mine = sum(1 for agent in worker.agents if agent in mine)
        worker.max_agents = max(1, beat.max_agents)
        if worker.full_at is not None and beat.seq > worker.full_at:
            worker.full_at = None
        for dispatch in self._dispatches_on(beat.worker_id):
            if (
                dispatch.acked_seq is not None
                and beat.seq > dispatch.acked_seq
                and beat.agents.get(dispatch.key) != dispatch.epoch
                and not dispatch.future.done()
            ):
                self.log.warning(
                    "worker %s no longer runs %s epoch %d: dispatching it again",
                    beat.worker_id,
                    dispatch.key,
                    dispatch.epoch,
                )
                dispatch.future.set_exception(
                    WorkerLost(beat.worker_id, f"worker {beat.worker_id} abandoned the dispatch")
                )

    def heard_from(self, worker_id: str) -> None:
        """A report from the worker passed its fence: it is alive at least as of the last beat."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = max(worker.last_seen, time.monotonic() - self.interval)

    async def ask_reregister(self, worker_id: str, force: bool = False) -> None:
        """Ask a worker to register with this daemon (at most once an interval; a worker whose
        registration was refused is asked again only after ``REFUSED_ASK_AGAIN`` seconds)."""
        now = time.monotonic()
        if not force and now - self._reregister_sent.get(worker_id, 0.0) < max(1.0, self.interval):
            return
        if not force and now - self._registration_refused.get(worker_id, -1e9) < REFUSED_ASK_AGAIN:
            return
        self._reregister_sent[worker_id] = now
        with contextlib.suppress(Exception):
            await self.nc.publish(
                dispatch_subject(worker_id),
                ENCODER.encode(Reregister(self.incarnation, daemon=self.daemon_id)),
            )

    # --- placement and dispatch --------------------------------------------------------------------

    async def pick(
        self,
        config: AgentConfig,
        prefer: str | None = None,
        *,
        pins: Sequence[PluginPin] = (),
        who: str = "",
        stop: Callable[[], bool] | None = None,
    ) -> str | None:
        """A live registered worker that has the agent's model provider and tools, whose
        plugin versions satisfy the session's ``pins`` and that has room for one more agent
        (``free_slots``); waits for one, or answers None once ``stop()`` is true. An agent
        waiting for room is counted (``placement_waits``, ``waiting_for_room``) and ``who``,
        the session and agent, may be the one the warning names (one line for all the agents
        waiting, every ``WAITING_EVERY`` seconds)."""
        warned = False
        waited_for_room = False
        try:
            while True:
                if stop is not None and stop():
                    return None
                picked, warned, waited = self._try_pick(
                    config, prefer, pins, who, warned, counted=waited_for_room
                )
                if waited and not waited_for_room:
                    waited_for_room = True
                    self.waiting_for_room.enter()
                    self.metrics.placement_waits.inc()
                if picked is not None:
                    return picked
                await asyncio.sleep(0.1)
        finally:
            if waited_for_room:
                self.waiting_for_room.leave()

    def _try_pick(
        self,
        config: AgentConfig,
        prefer: str | None,
        pins: Sequence[PluginPin],
        who: str,
        warned: bool,
        *,
        counted: bool,
    ) -> tuple[str | None, bool, bool]:
        """One look for a worker (see ``pick``): (the worker picked or None, whether the pins
        warning was given, whether every capable worker is full); ``counted``: this agent is
        among ``waiting_for_room`` already."""
        fresh = time.monotonic() - self.threshold
        capable = [
            w
            for w in self.workers.values()
            if w.last_seen >= fresh
            and config.model.provider in w.providers
            and all(t in w.tools for t in config.tools)
        ]
        candidates = [w for w in capable if worker_pin_problem(w.plugins, pins) is None]
        if not candidates and capable and not warned:
            problems = {w.worker_id: worker_pin_problem(w.plugins, pins) for w in capable}
            self.log.warning(
                "%s waits for a worker whose plugins match its pins: %s",
                who or config.name,
                "; ".join(f"{worker}: {problem}" for worker, problem in problems.items()),
            )
            warned = True
        roomy = [w for w in candidates if self.free_slots(w) > 0]
        full = bool(candidates) and not roomy
        if full:
            self._warn_full(who or config.name, candidates, counted)
        candidates = roomy
        # A worker that just refused or missed a dispatch is passed over while another can
        # take it (it is not declared lost for that: liveness alone decides).
        now = time.monotonic()
        answering = [
            w
            for w in candidates
            if now - self._dispatch_refused.get(w.worker_id, -1e9) > self.threshold
        ]
        candidates = answering or candidates
        if candidates:
            if (
                config.affinity == "sticky"
                and prefer
                and prefer in self.workers
                and prefer in [w.worker_id for w in candidates]
            ):
                self.workers[prefer].load += 1
                return prefer, warned, full
            chosen = min(candidates, key=lambda w: (w.load, w.worker_id))
            chosen.load += 1
            return chosen.worker_id, warned, full
        return None, warned, full

    def _warn_full(self, who: str, candidates: list[WorkerInfo], counted: bool) -> None:
        """Every capable worker is full: said for all the agents waiting at once (``who``, and
        how many others), at most once every ``WAITING_EVERY`` seconds (thousands of sessions
        resumed together wait at once: a line each would bury the log)."""
        if not self.waiting_for_room.due():
            return
        self.log.warning(
            "%s waits for room on a worker%s: %s",
            who,
            self.waiting_for_room.others(counted),
            "; ".join(
                f"{w.worker_id} runs {w.max_agents - self.free_slots(w)} of {w.max_agents}"
                for w in candidates
            ),
        )

    def alive_ids(self) -> list[str]:
        """The registered workers heard from within the liveness threshold."""
        fresh = time.monotonic() - self.threshold
        return [w.worker_id for w in self.workers.values() if w.last_seen >= fresh]

    def free_slots(self, worker: WorkerInfo) -> int:
        """How many more agents ``worker`` may take: its capacity less the agents its latest beat
        lists for other daemons (and for dispatches of ours it has not listed yet) and those this
        daemon placed on it; none after it refused a dispatch for being full, until its next
        beat."""
        if worker.full_at is not None:
            return 0
        others = len(worker.agents) - worker.listed_mine
        return worker.max_agents - others - worker.load

    def release(self, worker_id: str) -> None:
        """A dispatch picked for ``worker_id`` ended (answered, lost or refused)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.load = max(0, worker.load - 1)

    def track(self, worker_id: str, session_id: str, agent: str, epoch: int) -> Dispatch:
        """A dispatch about to be sent to ``worker_id``: failed with ``WorkerLost`` if it is lost."""
        dispatch = Dispatch(
            worker_id, session_id, agent, epoch, asyncio.get_running_loop().create_future()
        )
        on_worker = self._in_flight.setdefault(worker_id, {})
        same_agent = on_worker.get(dispatch.key)
        if same_agent is None:
            on_worker[dispatch.key] = same_agent = set()
            worker = self.workers.get(worker_id)
            if worker is not None and dispatch.key in worker.agents:
                worker.listed_mine += 1
        same_agent.add(dispatch)
        return dispatch

    def runs(self, worker_id: str, session_id: str, agent: str, epoch: int) -> bool:
        """Whether this daemon's dispatch of ``agent`` under ``epoch`` is in flight on
        ``worker_id``."""
        same_agent = self._in_flight.get(worker_id, {}).get(f"{session_id}/{agent}", ())
        return any(d.epoch == epoch for d in same_agent)

    def _dispatches_on(self, worker_id: str) -> list[Dispatch]:
        """Every dispatch in flight on ``worker_id`` (a copy: the caller may settle them)."""
        return [d for same in self._in_flight.get(worker_id, {}).values() for d in same]

    def untrack(self, dispatch: Dispatch) -> None:
        on_worker = self._in_flight.get(dispatch.worker_id)
        same_agent = on_worker.get(dispatch.key) if on_worker is not None else None
        if on_worker is None or same_agent is None or dispatch not in same_agent:
            return
        same_agent.discard(dispatch)
        if not same_agent:
            del on_worker[dispatch.key]
            worker = self.workers.get(dispatch.worker_id)
            if worker is not None and dispatch.key in worker.agents:
                worker.listed_mine -= 1
        if not on_worker:
            del self._in_flight[dispatch.worker_id]

    @property
    def page_bytes(self) -> int:
        """The most a dispatch or a page of memory sent to a worker carries: half the NATS
        ``max_payload``, leaving room for the rest of the message."""
        return max(4096, int(self.nc.max_payload) // 2)

    async def send_run(self, worker_id: str, run: Run) -> bool:
        """Send a dispatch; False when it was not acknowledged (try again), ``PayloadTooLarge``
        when it can never be sent. The dispatch names this daemon and incarnation: the worker
        reports it here, and only here."""
        run = msgspec.structs.replace(run, daemon=self.daemon_id, incarnation=self.incarnation)
        data = ENCODER.encode(run)
        limit = int(self.nc.max_payload)
        if len(data) > limit:
            raise PayloadTooLarge(f"the dispatch of {run.session_id}/{run.agent}", len(data), limit)
        local = self.local_workers.get(worker_id)
        try:
            # The agent span's context rides along: the worker's spans join the session's trace.
            if local is not None:
                ack = local(data, tracing.headers())
            else:
                msg = await self.nc.request(
                    dispatch_subject(worker_id), data, timeout=5.0, headers=tracing.headers()
                )
                ack = DISPATCH_ACK_DECODER.decode(msg.data)
        except Exception as exc:  # an RPC failure is never proof of death; liveness decides that
            self.log.warning(
                "dispatch of %s/%s to %s not acknowledged: %r",
                run.session_id,
                run.agent,
                worker_id,
                exc,
            )
            self._dispatch_refused[worker_id] = time.monotonic()
            self.metrics.dispatches_refused.labels("unanswered").inc()
            return False
        if not ack.ok:
            self.log.warning(
                "worker %s refused dispatch %s/%s: %s",
                worker_id,
                run.session_id,
                run.agent,
                ack.reason,
            )
            self._dispatch_refused[worker_id] = time.monotonic()
            self.metrics.dispatches_refused.labels("full" if ack.full else "refused").inc()
            worker = self.workers.get(worker_id)
            if ack.full and worker is not None:
                worker.full_at = ack.beat_seq
            return False
        self._dispatch_refused.pop(worker_id, None)
        for dispatch in self._in_flight.get(worker_id, {}).get(f"{run.session_id}/{run.agent}", ()):
            if dispatch.epoch == run.epoch:
                dispatch.acked_seq = ack.beat_seq
        return True

    async def send_cancel(
        self, worker_id: str, session_id: str, agent: str, epoch: int, reason: str
    ) -> None:
        data = ENCODER.encode(Cancel(session_id, agent, epoch, reason))
        local = self.local_workers.get(worker_id)
        if local is not None:
            local(data, None)
            return
        await self.nc.publish(dispatch_subject(worker_id), data)

    # --- liveness ----------------------------------------------------------------------------------

    async def liveness_forever(
        self, *, pending_beats: Callable[[], int], closing: Callable[[], bool]
    ) -> None:
        """Declare lost every worker silent for ``missed_beats`` intervals, never on silence this
        daemon could not hear: while its own event loop was too busy to read beats, while it is
        cut off from NATS, and while NATS does not deliver to it though the connection stands
        (a server frozen by a disk stall or a paused VM: every tick the daemon sends itself an
        echo, ``apomesh.echo.<incarnation>``, and is deaf while none came back for an
        interval)."""
        tick = min(self.interval / 4, 0.25)
        echo = f"{ECHO_PREFIX}{self.incarnation}"

        async def heard(_msg: Any) -> None:
            self._heard_at = time.monotonic()
            self._echo_works = True

        echoes = await self.nc.subscribe(echo, cb=heard)
        try:
            await self._judge_forever(tick, echo, pending_beats, closing)
        finally:
            with contextlib.suppress(Exception):
                await echoes.unsubscribe()

    async def _judge_forever(
        self,
        tick: float,
        echo: str,
        pending_beats: Callable[[], int],
        closing: Callable[[], bool],
    ) -> None:
        last_tick = time.monotonic()
        deferred_since: float | None = None
        deaf_since: float | None = None  # when the last echo before this deaf spell came back
        sent = 0
        while True:
            wait = next_judgement(
                time.monotonic(), tick, (w.last_seen for w in self.workers.values()), self.threshold
            )
            await asyncio.sleep(wait)
            if closing():
                return  # a daemon shutting down judges nobody
            if self._echo_works or sent < ECHO_TRIES:
                sent += 1
                with contextlib.suppress(Exception):  # a closed connection: ``connected`` says so
                    await self.nc.publish(echo, b"")
            elif sent == ECHO_TRIES:
                sent += 1
                self.log.warning(
                    "this daemon's echo on %s never came back (may its control login publish and"
                    " subscribe to apomesh.echo.*? see conf/nats/accounts.conf): a NATS that"
                    " delivers nothing is not told from silent workers",
                    echo,
                )
            connected = self.nc.is_connected
            now = time.monotonic()
            stalled = now - last_tick - wait
            last_tick = now
            if stalled > self.interval / 2:
                # Our own event loop was too busy to listen (a boot scan, a burst): the time we
                # were deaf is nobody's silence.
                for w in self.workers.values():
                    w.last_seen += stalled
                continue
            if pending_beats() > 0:
                # Beats we received but have not read yet are not silence: read them first, for
                # up to one interval (a queue that never drains must not stop all judgement).
                deferred_since = now if deferred_since is None else deferred_since
                if now - deferred_since < self.interval:
                    continue
            deferred_since = None
            if not connected:
                self._was_connected = False
                continue
            if not self._was_connected:
                # We were the ones cut off: nobody is judged on silence we could not hear.
                self._was_connected = True
                self._reconnected_at = now
                self._heard_at = now
                deaf_since = None
                self.log.info(
                    "reconnected to NATS: workers get %.1f s to be heard again", 2 * self.threshold
                )
                for w in self.workers.values():
                    w.last_seen = now
                continue
            if self._echo_works and now - self._heard_at > self.interval:
                # Connected, yet NATS delivers nothing to us, not even our own echo.
                if deaf_since is None:
                    deaf_since = self._heard_at
                    self.log.warning(
                        "NATS has delivered nothing to this daemon for %.1f s (its echo is not "
                        "back): no worker is judged on silence until it is",
                        now - deaf_since,
                    )
                continue
            if deaf_since is not None:
                # What we could not hear is nobody's silence: each worker's silence goes on
                # from where it stood when the spell began, the beats held up meanwhile arriving
                # with our echo.
                spell = self._heard_at - deaf_since
                for w in self.workers.values():
                    w.last_seen = min(now, w.last_seen + spell)
                self.log.info("NATS delivers to this daemon again after %.1f s", spell)
                deaf_since = None
                continue
            if now - self._reconnected_at < self.threshold:
                # Workers reconnect on their own schedule after a server restart: one more
                # threshold of grace before their silence counts.
                continue
            for worker in list(self.workers.values()):
                if now - worker.last_seen > self.threshold:
                    await self.worker_lost(
                        worker.worker_id, f"missed {self.config.liveness.missed_beats} heartbeats"
                    )

    async def worker_lost(self, worker_id: str, reason: str) -> None:
        """Unregister the worker and fail every dispatch it was running (their writers re-dispatch)."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self.lost_workers.pop(worker_id, None)
        self.lost_workers[worker_id] = worker
        while len(self.lost_workers) > LOST_WORKERS_KEPT:
            del self.lost_workers[next(iter(self.lost_workers))]
        self.metrics.workers_lost.inc()
        self.log.warning("worker %s lost: %s", worker_id, reason)
        for dispatch in self._dispatches_on(worker_id):
            if dispatch.future.done():
                continue
            with contextlib.suppress(Exception):
                await self.send_cancel(
                    worker_id,
                    dispatch.session_id,
                    dispatch.agent,
                    dispatch.epoch,
                    "worker declared lost",
                )
            if not dispatch.future.done():
                dispatch.future.set_exception(
                    WorkerLost(worker_id, f"worker {worker_id} lost: {reason}")
                )
