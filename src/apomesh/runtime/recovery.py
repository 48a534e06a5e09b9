"""The boot scan: every session found on the log classified after a daemon (re)start.

``BootScan.run`` skips sessions with a completed record, folds the rest (in one pass over the
stream when the log adapter can, ``fold_all``; one by one otherwise, and for the sessions the pass
cannot vouch for; each from its fold checkpoint when the log confirms it,
``runtime.fold_checkpoints``), books terminal ones as completed, auto-resumes the safe ones through
the registry (a drained session under its own agent refs; waiting for a lease another owner still
holds; each adopted as it is classified, all started once every session is) and strands the others
on the recoverable list with their category (``recoverable``, ``pin_mismatch``, ``undecodable``, ...).
``classify`` is the verdict for one folded session: the plugins' recovery classifiers first, then
the core rules. A session whose lease another daemon holds is not classified: it is that daemon's,
and ``Takeover`` watches it.

``Takeover`` is how a live peer adopts the sessions of a daemon that is gone. Every sweep it reads
the presence records (``runtime.presence``) and remembers which daemon drives which session; the
sessions of a daemon whose record aged out (it died) or that says ``drained`` (it handed them
over) are adopted once their lease is free, under their own agent refs (``fresh_children`` is
False), many at a time (their leases read, their logs folded and their leases taken together,
then started in waves as the boot scan starts its own), exactly as after a worker loss: journaled
effects are served from the log, an intent without its result goes through the tool's probe and
``on_unknown``. Two peers racing for one
session are decided by its lease: exactly one adopts it. (The lone-daemon rule of the boot scan
is untouched: a daemon restarting on its own data dir classifies its own sessions.) Nothing is
adopted while this daemon's own presence record is not ``steady`` (``Presence.steady``): after
NATS stood still, every record aged out at once, the live peers' too. A session whose writer
stopped here after a conflict, leaving it to another writer (``let_go``), is watched until a live
peer lists it or it ends: when two thawed writers each stopped on the other's append, neither
driving it, it is adopted here once its lease is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from apomesh.adapters.jetstream_log import MessageCounts
from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.stream_fold import ResumePoint, StreamFold
from apomesh.core import decisions
from apomesh.core.errors import ApomeshError, CodecError, CorruptPin, FoldError
from apomesh.core.events import PluginPin
from apomesh.core.ports import EventLog
from apomesh.core.state import SessionState
from apomesh.plugins.api import Tool
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.fold_checkpoints import KnowsSequences
from apomesh.runtime.pinning import corrupt_bootstrap, shape_problem
from apomesh.runtime.presence import Presence
from apomesh.runtime.progress import PROGRESS_EVERY, ProgressLog
from apomesh.runtime.registry import Recoverable, SessionRegistry
from apomesh.runtime.sessions import SessionRuntime

log = logging.getLogger("apomesh.daemon")


START_WAVE = 256
"""Sessions started at once (``start_in_waves``): the boot scan's once every session is
classified, a takeover's once they are adopted."""

UNCLAIMED = ""
"""The owner a takeover names for a session let go here after a conflict (``Takeover.let_go``)."""

WAVE_WAIT = 10.0
"""The longest ``start_in_waves`` waits for a wave of sessions to log their openings."""

FOLD_TOGETHER = 32
"""How many sessions a takeover folds at once."""

TAKE_TOGETHER = 1024
"""How many sessions of gone daemons one step of a takeover sweep adopts together."""


@runtime_checkable
class FoldsInOnePass(Protocol):
    """A log that can fold every session in one pass over its stream (``JetStreamLog``)."""

    async def fold_all(
        self,
        skip: set[str],
        *,
        resume: Mapping[str, ResumePoint] | None = None,
        sessions: Collection[str] | None = None,
        counts: MessageCounts | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> StreamFold: ...


@runtime_checkable
class CountsMessages(Protocol):
    """A log that can tell how many messages each session holds (``JetStreamLog``)."""

    async def count_messages(self) -> MessageCounts: ...


Listing = tuple[list[str], MessageCounts | None]
"""The log's sessions, and their message counts when the log can tell them."""


class Classifier:
    """Recovery verdicts for folded, non-terminal sessions classified at one moment: the plugins'
    tools and recovery classifiers are asked for once, and a pin problem is checked once per shape
    and effective plugin pins (a boot scan's sessions of one definition share one shape object).
    """

    def __init__(self, plugins: PluginHost) -> None:
        self.plugins = plugins
        self.tools: dict[str, Tool] = plugins.tools()
        self.classifiers = plugins.recovery_classifiers()
        self._problems: dict[tuple[int, tuple[PluginPin, ...]], tuple[object, str | None]] = {}

    def __call__(self, state: SessionState) -> decisions.Classification:
        problem = self._pin_problem(state) if state.bootstrap is not None else None
        for classifier in self.classifiers:
            verdict = classifier.classify(state, problem, self.tools)
            if verdict is not None:
                return verdict
        return decisions.classify(state, problem)

    def _pin_problem(self, state: SessionState) -> str | None:
        shape = state.effective_shape
        key = (id(shape), tuple(state.plugin_pins))
        known = self._problems.get(key)
        if known is None or known[0] is not shape:  # the shape is kept: its id is not reused
            known = self._problems[key] = (shape, shape_problem(self.plugins, state))
        return known[1]


def classify(plugins: PluginHost, state: SessionState) -> decisions.Classification:
    """The recovery verdict for one folded, non-terminal session."""
    return Classifier(plugins)(state)


def fresh_children(state: SessionState) -> bool:
    """Whether an auto-resumed session's unfinished children start again under fresh refs: yes
    after a crash, no after a drained shutdown (``SessionSuspended``), whose agents all stopped at
    a node boundary and continue from their snapshots, journaled effects served from the log."""
    return not state.cleanly_suspended


async def start_in_waves(
    adopted: Sequence[SessionRuntime],
    closing: Callable[[], bool],
    progress_every: float = PROGRESS_EVERY,
) -> None:
    """Start auto-resumed sessions ``START_WAVE`` at a time: the next wave once this one has
    logged its openings (or after ``WAVE_WAIT`` seconds); tens of thousands of openings sent at
    once time out on the log. Stops when ``closing()``. How many are started is logged every
    ``progress_every`` seconds while it lasts."""
    progress = ProgressLog(log, "resuming", "sessions started", every=progress_every)
    for first in range(0, len(adopted), START_WAVE):
        progress(first, len(adopted))
        wave = adopted[first : first + START_WAVE]
        for runtime in wave:
            if closing():
                return
            runtime.start("auto")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WAVE_WAIT):
                await asyncio.gather(*(runtime.opened.wait() for runtime in wave))
    progress.finish(len(adopted))


class BootScan:
    """Classifies every session on the log at boot; see the module docstring."""

    def __init__(
        self,
        *,
        log_adapter: EventLog,
        store: AsyncStore,
        registry: SessionRegistry,
        plugins: PluginHost,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        closing: Callable[[], bool],
        logger: logging.Logger | None = None,
        takeover: Takeover | None = None,
        progress_every: float = PROGRESS_EVERY,
    ) -> None:
        self.log_adapter = log_adapter
        self.progress_every = progress_every
        self.store = store
        self.registry = registry
        self.plugins = plugins
        self.spawn = spawn
        self.closing = closing
        self.log = logger or log
        self.takeover = takeover
        self.waiting_for_lease: set[str] = set()

    async def run(self) -> dict[str, Any]:
        """Classify every session on the log; auto-resume the safe ones, strand the others.

        The collector is paused for the scan, and what it leaves is kept out of the collector's
        walks (``gc.freeze``) until its sessions are started (the end of ``start_in_waves``
        gives it back): one state per session is allocated and kept, and every collection the scan's
        allocations triggered walked them all over again (half of the scan of 100,000 sessions).
        Reference counting still frees what is dropped."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return await self._scan()
        finally:
            if collecting:
                gc.enable()

    async def _scan(self) -> dict[str, Any]:
        started = time.perf_counter()
        # The log's list of sessions is read while the pass runs: the pass needs it only when there
        # are fold checkpoints (to know which are current, and to start past the stream's first
        # message), and the server's answer for 100,000 sessions takes a quarter of a second.
        listing = asyncio.ensure_future(self._listing())
        try:
            return await self._classify(started, listing)
        finally:
            if not listing.done():
                listing.cancel()
            with contextlib.suppress(BaseException):
                await listing

    async def _listing(self) -> Listing:
        if isinstance(self.log_adapter, CountsMessages):
            counts = await self.log_adapter.count_messages()
            return sorted(counts.counts), counts
        return await self.log_adapter.list_sessions(), None

    async def _classify(self, started: float, listing: asyncio.Future[Listing]) -> dict[str, Any]:
        completed = {sid for sid, _ in await self.store.list_completed()}
        gate = asyncio.Semaphore(32)
        counts: dict[str, Any] = {
            "completed_skipped": len(completed),
            "terminal": 0,
            "auto_resume": 0,
            "recoverable": 0,
            "undecodable": 0,
            "owned_by_peers": 0,
        }
        checkpoints = self.registry.fold_checkpoints
        before = copy.copy(checkpoints.stats)
        # Every lease in one read (not one per session; asked one by one only if that fails),
        # while the log is read: a lease that moves meanwhile is met by the compare-and-set that
        # takes it, as one that moves after the read.
        pass_result, holders = await asyncio.gather(
            self._fold_in_one_pass(completed, listing), self.registry.lease_holders()
        )
        session_ids = [s for s in (await listing)[0] if s not in completed]
        scanned = pass_result.states if pass_result is not None else {}
        verdict_of = Classifier(self.plugins)
        ended: list[SessionState] = []
        auto: list[SessionState] = []
        stranded: list[SessionState] = []
        adopted: list[SessionRuntime] = []

        def sort(state: SessionState, holder: str | None) -> None:
            """Book one folded session: ended, another daemon's, auto-resumable (``auto``, adopted
            together below) or stranded for an operator."""
            if state.terminal:
                counts["terminal"] += 1
                ended.append(state)
                return
            if self.takeover is not None and holder not in (None, self.registry.owner):
                # Another daemon drives it (its presence record keeps the lease): its, not ours.
                counts["owned_by_peers"] += 1
                self.takeover.watch(state.session_id, holder)
                return
            verdict = verdict_of(state)
            if verdict.verdict == "auto_resume":
                counts["auto_resume"] += 1
                auto.append(state)
                return
            counts["recoverable"] += 1
            stranded.append(state)
            self.registry.strand(
                Recoverable(
                    state.session_id,
                    state.goal,
                    verdict.reason,
                    verdict.category,
                    state.side_effects,
                    state.last_ts,
                    state,
                )
            )

        async def one(session_id: str) -> None:
            """A session the pass did not fold (read one by one), or any session when the leases
            could not be read in one go (its holder asked for alone)."""
            state = scanned.pop(session_id, None)
            async with gate:
                try:
                    if state is None:
                        state = await checkpoints.fold(self.log_adapter, session_id)
                except (CodecError, FoldError) as exc:
                    self._strand_undecodable(
                        session_id, exc, counts, await self._corrupt(exc, session_id)
                    )
                    return
                if state.terminal:
                    holder = None
                elif holders is not None:
                    holder = holders.get(session_id)
                else:
                    holder = await self.registry.lease_owner(session_id)
            sort(state, holder)

        alone: list[str] = []
        for session_id in session_ids:
            state = scanned.pop(session_id, None) if holders is not None else None
            if state is None:
                alone.append(session_id)
            else:
                sort(state, holders.get(session_id) if holders is not None else None)
        try:
            await asyncio.gather(*(one(s) for s in alone))
            await self.registry.write_completed_many(ended)
            adopted, refused = await self.registry.adopt_many(auto, fresh_children=fresh_children)
            self.registry.keep_stranded_lease_reads()
            if refused:
                self.log.warning(
                    "%d auto-resumable sessions not resumed yet (their lease is held or NATS did"
                    " not answer); each is tried again every 2 s",
                    len(refused),
                )
            for state in refused:
                self.spawn(self._adopt_when_free(state))
            if pass_result is not None:
                self._checkpoint_stranded(stranded, pass_result)
        finally:
            # Started once every session is classified, not as each is adopted (thousands of
            # sessions driving their first steps would share the interpreter with the scan), and
            # in waves (tens of thousands of openings sent at once time out on the log).
            if adopted:
                gc.freeze()
                # Unfrozen when the waves end, however they end (also when the daemon closes
                # before their task has run at all).
                waves = start_in_waves(adopted, self.closing, self.progress_every)
                self.spawn(waves).add_done_callback(lambda _: gc.unfreeze())
        stats = checkpoints.stats
        resumed = len(pass_result.resumed) if pass_result is not None else 0
        current = len(pass_result.current) if pass_result is not None else 0
        folded = pass_result.folded if pass_result is not None else 0
        counts["from_checkpoints"] = current + resumed + stats.used - before.used
        counts["current_checkpoints"] = current
        counts["checkpoints_ignored"] = stats.ignored - before.ignored
        counts["events_folded"] = (
            folded
            + stats.events_after
            - before.events_after
            + stats.events_whole
            - before.events_whole
        )
        counts["seconds"] = round(time.perf_counter() - started, 3)
        self.log.info("boot scan: %s", counts)
        return counts

    def _checkpoint_stranded(self, stranded: list[SessionState], folded: StreamFold) -> None:
        """Store, in the background, the checkpoints of the stranded sessions the pass folded
        (no writer here drives them, so none would): the next start reads them from there. A
        session current in its checkpoint has one already."""
        sequences = self.log_adapter if isinstance(self.log_adapter, KnowsSequences) else None
        if sequences is None:
            return
        made = []
        for state in stranded:
            session_id = state.session_id
            end, event_id = folded.ends.get(session_id), folded.last_ids.get(session_id)
            if session_id in folded.current or end is None or event_id is None:
                continue
            if end[0] != state.last_index:
                continue
            made.append((state, event_id, end[1], folded.counts.get(session_id)))
        if made:
            self.spawn(self.registry.fold_checkpoints.write_folded(made, sequences.log_id))

    def _strand_undecodable(
        self,
        session_id: str,
        exc: CodecError | FoldError,
        counts: dict[str, Any],
        corrupt: CorruptPin | None,
    ) -> None:
        if corrupt is not None:
            self.log.error("session %s is stranded by a corrupt pin: %s", session_id, corrupt)
            counts["recoverable"] += 1
            reason = f"{decisions.REASON_PIN_MISMATCH}: {corrupt.message}"
            self.registry.strand(
                Recoverable(session_id, "", reason, "pin_mismatch", 0, 0.0, error=corrupt)
            )
            return
        self.log.error("session %s cannot be decoded whole: %s", session_id, exc)
        counts["undecodable"] += 1
        reason = f"{decisions.REASON_UNDECODABLE}: {exc}"
        self.registry.strand(Recoverable(session_id, "", reason, "undecodable", 0, 0.0))

    async def _corrupt(self, exc: CodecError | FoldError, session_id: str) -> CorruptPin | None:
        """The corrupt pin that makes a session's ``SessionStarted`` undecodable, if that is why."""
        if exc.index not in (0, None):
            return None
        with contextlib.suppress(Exception):
            first = await self.log_adapter.read_raw(session_id, -1)
            if first:
                return corrupt_bootstrap(first[0][1])
        return None

    async def _fold_in_one_pass(
        self, completed: set[str], listing: asyncio.Future[Listing]
    ) -> StreamFold | None:
        """Every session folded in one pass over the log stream (each from its fold checkpoint
        when it has one, and not read at all when the log's counts show that one current), when
        the log can; the sessions the pass cannot vouch for are left out of its states (read one
        by one). The log's list of sessions (``listing``) is waited for only when there are fold
        checkpoints (the pass may then start past the stream's first message, or not be needed);
        without any, the pass starts at once."""
        if not isinstance(self.log_adapter, FoldsInOnePass):
            return None
        resume = await self.registry.fold_checkpoints.load_all()
        session_ids, counts = None, None
        if resume:
            listed, counts = await listing
            session_ids = [s for s in listed if s not in completed]
        try:
            progress = ProgressLog(
                self.log, "boot scan", "log messages read", every=self.progress_every
            )
            result = await self.log_adapter.fold_all(
                completed, resume=resume, sessions=session_ids, counts=counts, progress=progress
            )
        except ApomeshError as exc:
            self.log.warning(
                "boot scan: one pass over the log failed (%s); reading sessions one by one", exc
            )
            return None
        self.log.info(
            "boot scan: %s events read in one pass (%s pages, %s folded), %s sessions (%s current"
            " in their fold checkpoint, %s folded on from one), %s to read one by one",
            *(
                f"{n:,}"
                for n in (
                    result.events,
                    result.pages,
                    result.folded,
                    len(result.states),
                    len(result.current),
                    len(result.resumed),
                    len(result.suspect),
                )
            ),
        )
        return result

    async def _adopt_when_free(self, state: SessionState) -> None:
        """Auto-resume a session whose lease another owner still holds, once it expires (a
        daemon that died holding it) or is released."""
        session_id = state.session_id
        self.waiting_for_lease.add(session_id)
        try:
            while not self.closing() and self.registry.writer(session_id) is None:
                await asyncio.sleep(2.0)
                try:
                    await self.registry.adopt(
                        state, recovered="auto", fresh_children=fresh_children(state)
                    )
                    self.log.info("session %s resumed after its lease came free", session_id)
                    return
                except ApomeshError as exc:
                    self.log.debug("session %s still waits: %s", session_id, exc)
        finally:
            self.waiting_for_lease.discard(session_id)


class Takeover:
    """Adopts the sessions of daemons that are gone; see the module docstring."""

    def __init__(
        self,
        *,
        log_adapter: EventLog,
        registry: SessionRegistry,
        presence: Presence,
        plugins: PluginHost,
        stopped: Callable[[], bool],
        settle: float,
        logger: logging.Logger | None = None,
    ) -> None:
        self.log_adapter = log_adapter
        self.registry = registry
        self.presence = presence
        self.plugins = plugins
        self.stopped = stopped
        self.settle = settle
        """How long this daemon's record must have been renewed without a gap (the lease TTL)
        before a peer's missing record counts as that peer gone."""
        self.log = logger or log
        self.held_off = False
        """Whether the last sweep adopted nothing because this daemon's record was not steady."""
        self.owned_by: dict[str, str] = {}
        """Session -> the other daemon last seen driving it (or holding its lease)."""
        self.stranded_by: dict[str, str] = {}
        """Session -> the other daemon whose recoverable list it was last seen on."""
        self.settled: set[tuple[str, str]] = set()
        """(session, daemon) pairs resolved here: the session no longer waits for that daemon."""
        self.unclaimed: set[str] = set()
        """Sessions whose writer here stopped after a conflict, left to another writer
        (``let_go``): watched until a live peer lists them or they end."""
        self.adopted = 0

    def watch(self, session_id: str, owner: str) -> None:
        """Remember that ``owner`` drives the session (adopted here should it go away)."""
        if owner != self.registry.owner:
            self.owned_by[session_id] = owner

    def let_go(self, session_id: str) -> None:
        """The writer of ``session_id`` here stopped after a conflict and left it to another
        writer (the registry's ``let_go``): make sure one drives it."""
        self.unclaimed.add(session_id)

    async def sweep_forever(self, interval: float) -> None:
        while not self.stopped():
            try:
                await self.sweep()
            except Exception as exc:
                self.log.warning("takeover sweep failed: %s", exc)
            await asyncio.sleep(interval)

    async def sweep(self) -> int:
        """One look at the presence records; answers how many sessions were adopted."""
        records = await self.presence.peers()
        me = self.registry.owner
        listed: dict[str, set[str]] = {}
        for record in records.values():
            if record.id == me:
                continue
            listed[record.id] = set(record.sessions)
            for session_id in record.stranded:
                self.stranded_by[session_id] = record.id
            for session_id in record.sessions:
                if record.gone and (session_id, record.id) in self.settled:
                    continue  # handed over, and already adopted or ended
                self.owned_by[session_id] = record.id
        for record in records.values():
            if record.id != me and not record.gone:
                self.unclaimed.difference_update(record.sessions)  # driven there
                self.unclaimed.difference_update(record.stranded)  # an operator's there
        if me not in records or not self.presence.steady(self.settle):
            if not self.held_off:
                self.log.info(
                    "takeover held off: this daemon's presence record was not renewed all along, "
                    "so its peers' records may have aged out while they are alive"
                )
            self.held_off = True
            return 0
        if self.held_off:
            self.log.info("takeover looks at its peers' records again: this daemon's is steady")
        self.held_off = False
        due: list[tuple[str, str]] = []
        for session_id, owner in list(self.owned_by.items()):
            seen = records.get(owner)
            if seen is not None and not seen.gone:
                if session_id not in listed.get(owner, ()):
                    del self.owned_by[session_id]  # it finished or moved: its owner says so
                continue
            due.append((session_id, owner))
        due += [(s, UNCLAIMED) for s in sorted(self.unclaimed) if s not in self.owned_by]
        adopted = 0
        for first in range(0, len(due), TAKE_TOGETHER):
            if self.stopped():
                break
            adopted += await self._take(due[first : first + TAKE_TOGETHER])
        for session_id, owner in due:
            if owner == UNCLAIMED:
                if self.registry.writer(session_id) is not None:
                    self.unclaimed.discard(session_id)
            elif self.owned_by.get(session_id) != owner:
                self.settled.add((session_id, owner))
        for session_id, owner in list(self.stranded_by.items()):
            seen = records.get(owner)
            if seen is not None and not seen.gone:
                if session_id not in seen.stranded:
                    del self.stranded_by[session_id]  # resumed, cancelled or ended there
                continue
            del self.stranded_by[session_id]
            await self._list_here(session_id, owner)
        return adopted

    async def _list_here(self, session_id: str, owner: str) -> None:
        """A session that waited for an operator on a daemon that is gone waits here now, on this
        daemon's recoverable list (classified again), so no operator loses sight of it."""
        if session_id in self.registry.stranded or self.registry.writer(session_id) is not None:
            return
        try:
            state = await self.registry.fold_checkpoints.fold(self.log_adapter, session_id)
        except (CodecError, FoldError) as exc:
            reason = f"{decisions.REASON_UNDECODABLE}: {exc}"
            self.registry.strand(Recoverable(session_id, "", reason, "undecodable", 0, 0.0))
            return
        if state.terminal:
            return
        verdict = classify(self.plugins, state)
        self.registry.strand(
            Recoverable(
                session_id,
                state.goal,
                f"{verdict.reason} (listed on daemon {owner}, which is gone)",
                verdict.category,
                state.side_effects,
                state.last_ts,
                state,
            )
        )
        self.log.info("session %s of daemon %s waits for an operator here now", session_id, owner)

    async def _take(self, due: list[tuple[str, str]]) -> int:
        """Adopt the sessions of daemons that are gone (``due``: session, its owner) whose
        leases are free, together: their leases read ``READ_TOGETHER`` at a time, their logs
        folded ``FOLD_TOGETHER`` at a time, their leases taken together (``adopt_many``: a gone
        owner's lease set at the revision read) and the adopted started in waves. One by one, a
        session cost a fold, a lease read, four lease requests and its start in turn: 10,000
        sessions of a killed daemon were all running again 67 s after the kill (lease TTL 3 s),
        28.5 s now. The sweep hands them
        over ``TAKE_TOGETHER`` at a time, so the first are driven again without waiting for the
        last to be folded. Answers how many were adopted."""
        due = [(s, owner) for s, owner in due if self._not_driven_here(s)]
        if not due or self.stopped():
            return 0
        holders = await self.registry.lease_owners([s for s, _ in due])
        if holders is None:
            return 0  # NATS cannot say who holds them: the next sweep asks again
        free: list[tuple[str, str]] = []
        for session_id, owner in due:
            holder = holders.get(session_id)
            if holder == owner:
                continue  # not expired (nor released) yet
            if holder is not None and holder != self.registry.owner:
                self.owned_by[session_id] = holder  # another peer took it: watch that one now
                continue
            free.append((session_id, owner))
        gate = asyncio.Semaphore(FOLD_TOGETHER)
        folded = await asyncio.gather(*(self._fold(s, owner, gate) for s, owner in free))
        states = [state for state in folded if state is not None]
        adopted, refused = await self.registry.adopt_many(states, fresh_children=lambda _: False)
        owner_of = dict(free)
        for runtime in adopted:
            session_id = runtime.state.session_id
            self.owned_by.pop(session_id, None)
            if owner_of[session_id] == UNCLAIMED:
                self.log.warning(
                    "session %s is driven here: its writers stopped on each other's appends and "
                    "no daemon drove it",
                    session_id,
                )
                continue
            self.log.info("took over session %s from daemon %s", session_id, owner_of[session_id])
        for state in refused:  # held by a peer that won the race, or not answered for
            self.log.info(
                "session %s of daemon %s not adopted yet: its lease is not free here",
                state.session_id,
                owner_of[state.session_id] or "none",
            )
        self.adopted += len(adopted)
        await start_in_waves(adopted, self.stopped)
        return len(adopted)

    def _not_driven_here(self, session_id: str) -> bool:
        """False (and no longer watched) when this daemon drives the session already."""
        if self.registry.writer(session_id) is None:
            return True
        self.owned_by.pop(session_id, None)
        return False

    async def _fold(
        self, session_id: str, owner: str, gate: asyncio.Semaphore
    ) -> SessionState | None:
        """The session's state to adopt it with; None (and no longer watched) when it cannot be
        folded, has ended or never durably started (the boot scan lists the latter)."""
        async with gate:
            try:
                state = await self.registry.fold_checkpoints.fold(self.log_adapter, session_id)
            except (CodecError, FoldError) as exc:
                self.log.error(
                    "session %s of daemon %s cannot be folded: %s", session_id, owner, exc
                )
                self.owned_by.pop(session_id, None)
                self.unclaimed.discard(session_id)
                return None
        if state.terminal or state.bootstrap is None:
            self.owned_by.pop(session_id, None)
            self.unclaimed.discard(session_id)
            return None
        return state
