"""A session's single writer (``SessionRuntime.decide``) on the in-memory log: commands decided
against the folded state under one lock, checked by the pure fold before they are appended; a
duplicate or stale one refused with nothing written; an append conflict ends the writer's run."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
from tests.strategies import born, session_started
from tests.writers import writer_deps

from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.memory_log import MemoryLog
from apomesh.core import envelope
from apomesh.core.errors import (
    ApomeshError,
    AppendConflict,
    CommandRefused,
    Fenced,
    LogUnavailable,
    NotFound,
    StoreUnavailable,
)
from apomesh.core.events import (
    AsyncJobStarted,
    CoordinatorCheckpoint,
    Event,
    HitlAnswered,
    HitlPaused,
    OperatorAction,
    SessionEnded,
)
from apomesh.core.state import SessionState, fold, new_state
from apomesh.plugins.manager import PluginHost
from apomesh.runtime import registry as registry_module
from apomesh.runtime.registry import SessionRegistry
from apomesh.runtime.sessions import Ending, SessionRuntime

pytestmark = pytest.mark.anyio
SID = "s-writer"


def writer(
    log: MemoryLog, tmp_path: Path, ended: list[Ending], state: SessionState | None = None
) -> SessionRuntime:
    async def on_end(runtime: SessionRuntime, ending: Ending) -> None:
        ended.append(ending)

    return SessionRuntime(writer_deps(tmp_path, log=log, on_end=on_end), state or new_state(SID))


async def paused_writer(tmp_path: Path, ended: list[Ending]) -> tuple[MemoryLog, SessionRuntime]:
    log = MemoryLog()
    runtime = writer(log, tmp_path, ended)
    await runtime.append(session_started(), born("root"), HitlPaused("root", "p1", "go?"))
    return log, runtime


async def test_concurrent_answers_to_one_pause_store_exactly_one(tmp_path: Path) -> None:
    log, runtime = await paused_writer(tmp_path, [])
    results = await asyncio.gather(
        *(runtime.answer_hitl("p1", f"answer {i}", by=f"op{i}") for i in range(5)),
        return_exceptions=True,
    )
    assert [r for r in results if r is not None and not isinstance(r, CommandRefused)] == []
    assert sum(r is None for r in results) == 1
    stored = [e.event for e in await log.read(SID) if isinstance(e.event, HitlAnswered)]
    assert len(stored) == 1 and runtime.state.hitl_answers == {"p1": stored[0].answer}
    assert fold(await log.read(SID), SID).hitl_answers == runtime.state.hitl_answers


async def test_a_step_the_fold_refuses_is_never_appended(tmp_path: Path) -> None:
    log, runtime = await paused_writer(tmp_path, [])
    job = AsyncJobStarted("root", "job-1", "jobs.sleep", {"seconds": 1})

    def always(state: SessionState) -> tuple[list[Event], None]:
        return [job], None  # a rule that forgets to look: the fold check still refuses

    results = await asyncio.gather(
        runtime.decide(always), runtime.decide(always), return_exceptions=True
    )
    assert results[0] is None and isinstance(results[1], CommandRefused)
    assert "started twice" in str(results[1])
    kinds = [type(e.event).__name__ for e in await log.read(SID)]
    assert kinds.count("AsyncJobStarted") == 1
    assert runtime.state.last_index == len(kinds) - 1


async def test_an_answer_to_a_closed_pause_writes_nothing(tmp_path: Path) -> None:
    log, runtime = await paused_writer(tmp_path, [])
    await runtime.answer_hitl("p1", "yes", by="alice")
    before = await log.last_index(SID)
    with pytest.raises(CommandRefused, match="already answered"):
        await runtime.answer_hitl("p1", "no", by="bob")
    assert await log.last_index(SID) == before == runtime.state.last_index


async def test_a_command_to_an_ended_session_is_refused_as_its_state_refuses_it(
    tmp_path: Path,
) -> None:
    """While the ended session's writer is still there, a pause answered twice is refused as
    such (as it is once the writer is gone), an unknown pause is not found, and anything the
    state would accept is fenced by the end: nothing is written in any case."""
    log, runtime = await paused_writer(tmp_path, [])
    await runtime.answer_hitl("p1", "yes", by="alice")
    await runtime.append(SessionEnded(status="completed", output="done"))
    before = await log.last_index(SID)
    with pytest.raises(CommandRefused, match="already answered"):
        await runtime.answer_hitl("p1", "no", by="bob")
    with pytest.raises(NotFound):
        await runtime.answer_hitl("p2", "no", by="bob")
    with pytest.raises(Fenced, match="has ended"):
        await runtime.decide(lambda state: ([OperatorAction(action="cancel", by="carol")], None))
    assert await log.last_index(SID) == before == runtime.state.last_index


async def test_an_append_conflict_ends_the_writers_run(tmp_path: Path) -> None:
    ended: list[Ending] = []
    log, runtime = await paused_writer(tmp_path, ended)
    # Another writer appends behind this one's back.
    index = await log.last_index(SID) + 1
    foreign = CoordinatorCheckpoint(position="elsewhere", state=b"")
    await log.append(SID, [envelope.make(SID, index, time.time(), uuid.uuid4().hex, foreign)])
    with pytest.raises(AppendConflict):
        await runtime.answer_hitl("p1", "yes", by="alice")
    await asyncio.sleep(0)  # the on_end callback runs as its own task
    assert [e.kind for e in ended] == ["conflict"]
    assert runtime.conflict is not None
    with pytest.raises(Fenced, match="another writer"):
        await runtime.answer_hitl("p1", "yes", by="alice")
    assert await log.last_index(SID) == index  # nothing of this writer's after the conflict
    assert runtime.state.last_index == index - 1


class LostAck:
    """A log whose first append lands and then never answers (its acknowledgement lost), so the
    caller can be cancelled while the step is on the log; later appends pass through."""

    def __init__(self, log: MemoryLog) -> None:
        self.log = log
        self.landed = asyncio.Event()
        self.calls = 0

    async def append(self, session_id: str, envelopes: Any) -> None:
        self.calls += 1
        await self.log.append(session_id, envelopes)
        if self.calls == 1:
            self.landed.set()
            await asyncio.Event().wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log, name)


async def answer_cut_off(
    tmp_path: Path, lossy_log: type[LostAck]
) -> tuple[MemoryLog, SessionRuntime, LostAck, asyncio.Future[None], list[Ending]]:
    """A paused writer on ``lossy_log`` whose answer's caller is cancelled once the append has
    landed unanswered: the log, the writer, the lossy log, the cancelled call and the endings."""
    ended: list[Ending] = []
    log, runtime = await paused_writer(tmp_path, ended)
    lossy = lossy_log(log)
    runtime.deps = msgspec.structs.replace(runtime.deps, log=cast(Any, lossy))
    answering = asyncio.ensure_future(runtime.answer_hitl("p1", "yes", by="alice"))
    await lossy.landed.wait()
    answering.cancel()
    return log, runtime, lossy, answering, ended


async def test_a_caller_cancelled_mid_append_leaves_the_step_whole_and_the_state_on_the_log(
    tmp_path: Path,
) -> None:
    """The caller of a decision is cancelled while its append is on the log and unanswered: the
    writer sends the same envelopes again (the log settles the resend: written once) and applies
    them before the cancellation goes on, so its state is what its log holds and the next step
    follows on."""
    log, runtime, _, answering, _ = await answer_cut_off(tmp_path, LostAck)
    with pytest.raises(asyncio.CancelledError):
        await answering
    stored = await log.read(SID)
    assert [type(e.event).__name__ for e in stored].count("HitlAnswered") == 1
    assert runtime.state.last_index == stored[-1].index
    assert "p1" in runtime.state.hitl_answers
    with pytest.raises(CommandRefused):  # the answer is in the state: a second one is refused
        await runtime.answer_hitl("p1", "again", by="bob")
    await runtime.append(OperatorAction(action="resume", by="carol"))
    assert await log.last_index(SID) == runtime.state.last_index == stored[-1].index + 1


class SlowResend(LostAck):
    """``LostAck`` whose second append (the resend of the first) waits for ``go``."""

    def __init__(self, log: MemoryLog) -> None:
        super().__init__(log)
        self.resending = asyncio.Event()
        self.go = asyncio.Event()

    async def append(self, session_id: str, envelopes: Any) -> None:
        if self.calls == 1:
            self.calls += 1
            self.resending.set()
            await self.go.wait()
            await self.log.append(session_id, envelopes)
            return
        await super().append(session_id, envelopes)


async def test_a_caller_cancelled_again_during_the_resend_holds_the_writer_until_it_is_done(
    tmp_path: Path,
) -> None:
    """Cancelled while its append is unanswered, and cancelled again while the writer sends it
    again: the writer still holds its lock until the resend is done, so a decision asked for
    meanwhile waits and follows on (it would otherwise put other events at the same index)."""
    log, runtime, lossy, answering, ended = await answer_cut_off(tmp_path, SlowResend)
    assert isinstance(lossy, SlowResend)
    await lossy.resending.wait()
    answering.cancel()  # again, during the resend
    await asyncio.sleep(0.01)
    resuming = asyncio.ensure_future(runtime.append(OperatorAction(action="resume", by="carol")))
    await asyncio.sleep(0.01)
    assert not answering.done() and not resuming.done()  # both wait for the resend
    lossy.go.set()
    with pytest.raises(asyncio.CancelledError):
        await answering
    await resuming
    stored = [type(e.event).__name__ for e in await log.read(SID)]
    assert stored[-2:] == ["HitlAnswered", "OperatorAction"] and ended == []
    assert runtime.state.last_index == await log.last_index(SID)


class SlowLeases:
    """Leases that are always free, granted after a pause (another task runs meanwhile)."""

    async def acquire(self, session_id: str, owner: str) -> bool:
        await asyncio.sleep(0.01)
        return True

    async def release(self, session_id: str, owner: str) -> bool:
        return True

    async def owner(self, session_id: str) -> str | None:
        return None

    async def holders(self) -> dict[str, str]:
        return {}

    async def position(self) -> int:
        raise NotImplementedError

    async def watch(self, on_change: Any, **_: Any) -> Any:
        raise NotImplementedError


async def test_two_concurrent_opens_of_one_session_make_one_writer(tmp_path: Path) -> None:
    log, _ = await paused_writer(tmp_path, [])
    state = fold(await log.read(SID), SID)
    registry = SessionRegistry(
        log_adapter=log,
        leases=SlowLeases(),
        store=cast(Any, None),
        snapshots=cast(Any, None),
        spawn=asyncio.ensure_future,
    )
    registry.make_runtime = lambda state, fresh: writer(log, tmp_path, [], state)
    resume = OperatorAction(action="resume", by="op")
    results = await asyncio.gather(
        *(
            registry.adopt(
                state, recovered=None, fresh_children=False, opening=[resume], start=False
            )
            for _ in range(2)
        ),
        return_exceptions=True,
    )
    opened = [r for r in results if isinstance(r, SessionRuntime)]
    refused = [r for r in results if isinstance(r, ApomeshError)]
    assert len(opened) == 1 and len(refused) == 1 and "already running" in str(refused[0])
    assert registry.writer(SID) is opened[0]
    kinds = [type(e.event).__name__ for e in await log.read(SID)]
    assert kinds.count("OperatorAction") == 1


class CountedLeases(SlowLeases):
    """Leases that are always free, counting what is taken and given back."""

    def __init__(self) -> None:
        self.acquired = 0
        self.released = 0
        self.holder: str | None = None
        """What ``owner`` answers (None: nobody holds it; ``acquire`` then takes it)."""

    async def acquire(self, session_id: str, owner: str) -> bool:
        self.acquired += 1
        await asyncio.sleep(0.01)
        return self.holder in (None, owner)

    async def owner(self, session_id: str) -> str | None:
        return self.holder

    async def release(self, session_id: str, owner: str) -> bool:
        self.released += 1
        return True


def lease_registry(log: MemoryLog, leases: Any) -> SessionRegistry:
    registry = SessionRegistry(
        log_adapter=log,
        leases=leases,
        store=cast(Any, None),
        snapshots=cast(Any, None),
        spawn=asyncio.ensure_future,
    )
    registry.owner = "daemon-here"
    return registry


async def test_a_lease_taken_by_another_owner_stops_the_writer(tmp_path: Path) -> None:
    ended: list[Ending] = []
    log, runtime = await paused_writer(tmp_path, ended)
    leases = CountedLeases()
    registry = lease_registry(log, leases)
    registry.live[SID] = runtime
    registry._lease_changed(SID, "daemon-here")  # its own adoption: nothing to do
    registry._lease_changed("some-other-session", "daemon-elsewhere")  # not driven here
    leases.holder = "daemon-here"
    registry._lease_changed(SID, "daemon-elsewhere")  # seen late: the lease is ours again now
    await asyncio.sleep(0.05)
    assert ended == [] and runtime.conflict is None
    leases.holder = "daemon-elsewhere"
    registry._lease_changed(SID, "daemon-elsewhere")
    for _ in range(100):
        await asyncio.sleep(0.01)  # the lease is looked at, then on_end runs as its own task
        if ended:
            break
    assert [e.kind for e in ended] == ["conflict"]
    assert "daemon-elsewhere" in ended[0].reason
    with pytest.raises(Fenced):
        await runtime.answer_hitl("p1", "yes", by="alice")


async def test_a_lease_deleted_while_driven_is_taken_again_unless_the_session_ended(
    tmp_path: Path,
) -> None:
    """A lease deleted under a live session is taken again; if the session ends (giving its lease
    back) while that retake waits, the lease taken is given back: nothing is left held."""
    log, runtime = await paused_writer(tmp_path, [])
    leases = CountedLeases()
    registry = lease_registry(log, leases)
    registry.live[SID] = runtime
    registry._lease_changed(SID, None)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if leases.acquired:
            break
    await asyncio.sleep(0.05)
    assert (leases.acquired, leases.released) == (1, 0) and runtime.conflict is None
    registry._lease_changed(SID, None)
    await asyncio.sleep(0)  # the retake is waiting on the lease table
    del registry.live[SID]  # the session ended meanwhile
    await asyncio.sleep(0.1)
    assert (leases.acquired, leases.released) == (2, 1)
    registry._lease_changed(SID, None)  # a deletion of a session no longer driven: ignored
    await asyncio.sleep(0.05)
    assert leases.acquired == 2


async def test_a_session_cut_off_at_hand_over_keeps_its_lease_a_lease_ttl_then_gives_it_back(
    tmp_path: Path,
) -> None:
    """A drained daemon that goes on running (maintenance) renews its presence record, which keeps
    its leases: a session the drain cut off (an effect may still be in flight on its worker) is
    held as long as a crashed daemon's lease would be, then given back for a peer to adopt."""
    log, runtime = await paused_writer(tmp_path, [])
    leases = CountedLeases()
    registry = lease_registry(log, leases)
    registry.snapshots = cast(Any, SimpleNamespace(forget=lambda key: None))
    registry.live[SID] = runtime
    assert not runtime.state.cleanly_suspended
    assert await registry.hand_over(hold_cut_off=0.3) == [SID]
    assert SID not in registry.live
    await asyncio.sleep(0.1)
    assert leases.released == 0  # still held: a peer waits
    for _ in range(100):
        await asyncio.sleep(0.02)
        if leases.released:
            break
    assert leases.released == 1


class StoreAnswersLate:
    """A state store whose first ``put_completed`` the replicated bucket does not confirm."""

    def __init__(self) -> None:
        self.completed: list[str] = []
        self.refused = 0

    async def put_completed(self, session_id: str, record: bytes) -> None:
        if not self.refused:
            self.refused += 1
            raise StoreUnavailable("the replicated state store is out of reach: TimeoutError()")
        self.completed.append(session_id)


async def test_a_session_ending_while_the_store_does_not_answer_is_booked_and_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session ends on its log while the replicated store does not answer: its end is booked
    all the same (out of the live set, its lease given back, no error out of the writer's task),
    and its completed record is written once the store answers."""
    monkeypatch.setattr(registry_module, "UNAVAILABLE_PAUSE", 0.01)
    log, runtime = await paused_writer(tmp_path, [])
    await runtime.append(SessionEnded(status="completed", output="done"))
    leases = CountedLeases()
    registry = lease_registry(log, leases)
    store = StoreAnswersLate()
    registry.store = cast(Any, store)
    registry.snapshots = cast(Any, SimpleNamespace(forget=lambda key: None))
    registry.live[SID] = runtime
    await registry.end(runtime, Ending("finished"))
    assert SID not in registry.live and leases.released == 1
    for _ in range(100):
        await asyncio.sleep(0.01)
        if store.completed:
            break
    assert store.completed == [SID]


async def test_a_writer_stopped_by_nats_not_answering_during_a_drain_is_handed_over(
    tmp_path: Path,
) -> None:
    """A writer whose coordinator meets NATS not answering while the daemon drains is not driven
    again here; it is handed over with the rest, its lease held a lease TTL (a dispatch of it may
    still run) and then given back: a drained daemon living on never keeps it."""
    log, runtime = await paused_writer(tmp_path, [])
    leases = CountedLeases()
    registry = lease_registry(log, leases)
    registry.snapshots = cast(Any, SimpleNamespace(forget=lambda key: None))
    registry.closing = lambda: True  # the drain has begun
    registry.live[SID] = runtime
    await registry.end(runtime, Ending("unavailable", "read session: NATS is unavailable"))
    assert SID not in registry.live
    assert await registry.hand_over(hold_cut_off=0.2) == [SID]
    assert leases.released == 0  # still held: a dispatch of it may still run
    for _ in range(100):
        await asyncio.sleep(0.02)
        if leases.released:
            break
    assert leases.released == 1
    assert await registry.hand_over(hold_cut_off=0.2) == []  # handed over once


async def test_a_coordinator_that_nats_does_not_answer_is_driven_again_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NATS does not answer what a coordinator needs (``LogUnavailable`` escapes it): the
    session is not ended ``failed`` (a passing outage would lose it); its writer stops, and the
    registry folds its log and drives it on under its lease (``SessionRecovered`` auto), to the
    end. Real LMDB for the registry's records."""
    monkeypatch.setattr(registry_module, "UNAVAILABLE_PAUSE", 0.01)
    log = MemoryLog()
    runs: list[SessionRuntime] = []

    class OutageOnce:
        async def run(self, session: SessionRuntime) -> str:
            runs.append(session)
            if len(runs) == 1:
                raise LogUnavailable("read session s-writer: NATS is unavailable (timeout)")
            return "done"

    host = PluginHost()
    monkeypatch.setattr(host, "coordination_kinds", lambda: {"solo": OutageOnce()})
    async with AsyncStore(LmdbStore(tmp_path / "lmdb")) as store:
        registry = SessionRegistry(
            log_adapter=log,
            leases=cast(Any, CountedLeases()),
            store=store,
            snapshots=cast(Any, SimpleNamespace(forget=lambda key: None)),
            spawn=asyncio.ensure_future,
        )
        registry.owner = "daemon-here"
        deps = writer_deps(tmp_path, log=log, plugins=host, on_end=registry.end)
        registry.make_runtime = lambda state, fresh: SessionRuntime(
            deps, state, fresh_children=fresh
        )
        await registry.adopt(
            new_state(SID),
            recovered=None,
            fresh_children=False,
            opening=[session_started(), born("root")],
        )
        for _ in range(300):
            await asyncio.sleep(0.01)
            if [r.session_id for r in await registry.completed_records()] == [SID]:
                break
        events = [e.event for e in await log.read(SID)]
    assert len(runs) == 2 and runs[0] is not runs[1]
    kinds = [type(event).__name__ for event in events]
    assert kinds == [
        "SessionStarted",
        "AgentLifecycle",
        "SessionRecovered",
        "SessionEnded",
    ], kinds
    assert events[-1] == SessionEnded(status="completed", output="done")


class LandsUnanswered:
    """A log whose appends are stored and then reported as not answered (``LogUnavailable``)."""

    def __init__(self, log: MemoryLog) -> None:
        self.log = log

    async def append(self, session_id: str, envelopes: Any) -> None:
        await self.log.append(session_id, envelopes)
        raise LogUnavailable(f"append to session {session_id}: not acknowledged within 5 s")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log, name)


async def test_an_append_given_up_at_shutdown_stops_the_writer_from_appending_more(
    tmp_path: Path,
) -> None:
    """At shutdown a step's append is not waited for once NATS does not answer; it may be stored
    all the same, so the writer no longer knows where its log ends: its next decision is refused
    (it would put other events at the same index), and the log keeps the given-up step."""
    log, runtime = await paused_writer(tmp_path, [])
    runtime.deps = msgspec.structs.replace(
        runtime.deps, log=cast(Any, LandsUnanswered(log)), closing=lambda: True
    )
    with pytest.raises(LogUnavailable):
        await runtime.answer_hitl("p1", "yes", by="alice")
    with pytest.raises(Fenced, match="stopped"):
        await runtime.append(OperatorAction(action="resume", by="carol"))
    kinds = [type(e.event).__name__ for e in await log.read(SID)]
    assert kinds[-1] == "HitlAnswered" and "OperatorAction" not in kinds
