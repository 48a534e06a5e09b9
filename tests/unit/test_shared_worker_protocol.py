"""The shared-worker protocol without a server: control subjects name the daemon and the worker;
the worker pool asks a worker it hears to register with this daemon, places agents only where
there is room (a worker's capacity less what its beats list for other daemons and what this
daemon placed there), marks a worker full when it refuses a dispatch for that, and fails a
dispatch that the worker's later beats no longer list at its epoch."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from apomesh.core.definition import AgentConfig, Budget, ModelSpec
from apomesh.runtime.config import load_config
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.protocol import (
    DISPATCH_DECODER,
    ENCODER,
    VERB_NODE,
    VERB_REGISTER,
    Beat,
    DispatchAck,
    Register,
    Reregister,
    Run,
    control_subject,
    daemon_control_wildcard,
    subject_verb,
    subject_worker,
    worker_control_subjects,
)
from apomesh.runtime.workers import WorkerLost, WorkerPool

pytestmark = pytest.mark.anyio

CONFIG = AgentConfig(
    name="a",
    version="1",
    role="root",
    instructions="",
    model=ModelSpec(provider="scripted"),
    tools=[],
    skills=[],
    budget=Budget(),
)


class FakeNats:
    """Records what the pool publishes and answers dispatches with the acks queued."""

    max_payload = 1 << 20
    is_connected = True

    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []
        self.dispatched: list[Run] = []
        self.acks: list[DispatchAck] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, DISPATCH_DECODER.decode(data)))

    async def request(
        self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> Any:
        message = DISPATCH_DECODER.decode(data)
        assert isinstance(message, Run)
        self.dispatched.append(message)

        class Msg:
            pass

        reply = Msg()
        reply.data = ENCODER.encode(self.acks.pop(0))  # type: ignore[attr-defined]
        return reply


def pool(nc: FakeNats) -> WorkerPool:
    return WorkerPool(
        load_config(None, env={}),
        nc=cast(Any, nc),
        incarnation="inc-2",
        daemon_id="daemon-a",
        metrics=DaemonMetrics(),
        on_registered=lambda: asyncio.sleep(0),
    )


def test_control_subjects_name_the_daemon_and_the_worker() -> None:
    subject = control_subject("daemon-a", VERB_NODE, "w1")
    assert subject == "apomesh.ctl.daemon-a.node.w1"
    assert (subject_worker(subject), subject_verb(subject)) == ("w1", "node")
    assert subject_worker("apomesh.ctl.node.w1") is None  # the subjects of earlier versions
    assert daemon_control_wildcard("daemon-a") == "apomesh.ctl.daemon-a.*.*"
    assert daemon_control_wildcard("daemon-a", VERB_REGISTER) == "apomesh.ctl.daemon-a.register.*"
    assert worker_control_subjects("w1") == "apomesh.ctl.*.*.w1"


async def test_a_beat_without_this_daemons_incarnation_asks_the_worker_to_register() -> None:
    nc = FakeNats()
    workers = pool(nc)
    await workers.beat(Beat("w1", "w1", daemons={"daemon-b": "x"}))
    assert nc.published == [("apomesh.dispatch.w1", Reregister("inc-2", daemon="daemon-a"))]
    reply = await workers.register(Register("w1", "w1", [], ["scripted"], max_agents=3))
    assert (reply.ok, reply.daemon, reply.incarnation) == (True, "daemon-a", "inc-2")
    nc.published.clear()
    await workers.beat(Beat("w1", "w1", daemons={"daemon-a": "inc-2", "daemon-b": "x"}, seq=1))
    assert nc.published == []


async def test_placement_leaves_room_for_other_daemons_agents() -> None:
    nc = FakeNats()
    workers = pool(nc)
    await workers.register(Register("w1", "w1", [], ["scripted"], max_agents=2))
    beat = Beat("w1", "w1", {"daemon-a": "inc-2"}, agents={"other/root": 1}, seq=1, max_agents=2)
    await workers.beat(beat)
    info = workers.workers["w1"]
    assert workers.free_slots(info) == 1
    assert await workers.pick(CONFIG) == "w1"
    assert workers.free_slots(info) == 0
    calls = 0

    def give_up() -> bool:
        nonlocal calls
        calls += 1
        return calls > 2

    assert await workers.pick(CONFIG, stop=give_up) is None  # full: it waits, never over-places
    assert workers.metrics.value("apomesh_placement_waits_total") == 1
    workers.release("w1")
    assert workers.free_slots(info) == 1


async def test_many_agents_waiting_for_room_at_once_make_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Thousands of sessions resumed together wait for room at once: each is counted, and one
    line says how many wait (not a line each), until room frees up."""
    nc = FakeNats()
    workers = pool(nc)
    await workers.register(Register("w1", "w1", [], ["scripted"], max_agents=1))
    assert await workers.pick(CONFIG) == "w1"
    with caplog.at_level(logging.WARNING, logger="apomesh.daemon"):
        waiting = [
            asyncio.ensure_future(workers.pick(CONFIG, who=f"session s{n} agent root"))
            for n in range(50)
        ]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if workers.waiting_for_room.count == 50:
                break
        await asyncio.sleep(0.3)  # every one of them looked again a few times
    said = [r.getMessage() for r in caplog.records if "waits for room" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("session s0 agent root waits for room")
    assert workers.metrics.value("apomesh_placement_waits_total") == 50
    workers.release("w1")
    done, pending = await asyncio.wait(waiting, timeout=2, return_when=asyncio.FIRST_COMPLETED)
    assert [task.result() for task in done] == ["w1"]  # one slot freed: one of them placed
    for task in pending:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert workers.waiting_for_room.count == 0


async def test_a_worker_that_refuses_for_being_full_is_full_until_its_next_beat() -> None:
    nc = FakeNats()
    workers = pool(nc)
    await workers.register(Register("w1", "w1", [], ["scripted"], max_agents=4))
    nc.acks.append(DispatchAck(False, "full: 4 of 4 agents running", full=True))
    run = Run("s1", "root", 1, CONFIG, "act", "go")
    assert not await workers.send_run("w1", run)
    # The dispatch named this daemon and incarnation.
    assert (nc.dispatched[0].daemon, nc.dispatched[0].incarnation) == ("daemon-a", "inc-2")
    assert workers.free_slots(workers.workers["w1"]) == 0
    assert workers.metrics.value("apomesh_dispatches_refused_total", reason="full") == 1
    await workers.beat(
        Beat("w1", "w1", {"daemon-a": "inc-2"}, agents={"x/root": 1}, seq=1, max_agents=4)
    )
    assert workers.free_slots(workers.workers["w1"]) == 3


async def test_a_dispatch_the_workers_later_beats_no_longer_list_is_lost() -> None:
    nc = FakeNats()
    workers = pool(nc)
    await workers.register(Register("w1", "w1", [], ["scripted"]))
    dispatch = workers.track("w1", "s1", "root", 1)
    nc.acks.append(DispatchAck(True, beat_seq=5))
    assert await workers.send_run("w1", Run("s1", "root", 1, CONFIG, "act", "go"))
    # A beat sent before the worker took it says nothing about it.
    await workers.beat(Beat("w1", "w1", {"daemon-a": "inc-2"}, agents={}, seq=5))
    assert not dispatch.future.done()
    await workers.beat(Beat("w1", "w1", {"daemon-a": "inc-2"}, agents={"s1/root": 1}, seq=6))
    assert not dispatch.future.done()
    await workers.beat(Beat("w1", "w1", {"daemon-a": "inc-2"}, agents={}, seq=7))
    with pytest.raises(WorkerLost, match="abandoned"):
        dispatch.future.result()


async def test_a_dispatch_the_worker_replaced_with_a_newer_epoch_is_lost() -> None:
    nc = FakeNats()
    workers = pool(nc)
    await workers.register(Register("w1", "w1", [], ["scripted"]))
    dispatch = workers.track("w1", "s1", "root", 3)
    nc.acks.append(DispatchAck(True, beat_seq=1))
    assert await workers.send_run("w1", Run("s1", "root", 3, CONFIG, "act", "go"))
    # Another daemon now drives the session and dispatched the agent again to the same worker.
    await workers.beat(Beat("w1", "w1", {"daemon-a": "inc-2"}, agents={"s1/root": 4}, seq=2))
    with pytest.raises(WorkerLost):
        dispatch.future.result()


async def test_placement_and_acks_find_a_dispatch_by_its_agent_as_dispatches_come_and_go() -> None:
    nc = FakeNats()
    workers = pool(nc)
    await workers.register(Register("w1", "w1", [], ["scripted"], max_agents=3))
    info = workers.workers["w1"]
    first = workers.track("w1", "s1", "root", 1)
    listed = {"s1/root": 1, "other/root": 1}
    await workers.beat(Beat("w1", "w1", {"daemon-a": "inc-2"}, agents=listed, seq=1, max_agents=3))
    assert workers.free_slots(info) == 2  # our s1/root is ours, not another daemon's
    workers.untrack(first)
    assert workers.free_slots(info) == 1  # listed, and no dispatch of ours: someone else's
    again = workers.track("w1", "s1", "root", 2)
    assert workers.free_slots(info) == 2
    assert workers.runs("w1", "s1", "root", 2) and not workers.runs("w1", "s1", "root", 1)
    stale = workers.track("w1", "s1", "root", 1)
    nc.acks.append(DispatchAck(True, beat_seq=4))
    assert await workers.send_run("w1", Run("s1", "root", 2, CONFIG, "act", "go"))
    assert (again.acked_seq, stale.acked_seq) == (4, None)  # the ack names one epoch
    # A worker registering again keeps what its beats said it runs.
    await workers.register(Register("w1", "w1", [], ["scripted"], max_agents=3))
    assert workers.free_slots(workers.workers["w1"]) == 2
    for dispatch in (again, stale):
        workers.untrack(dispatch)
    assert workers.free_slots(workers.workers["w1"]) == 1
