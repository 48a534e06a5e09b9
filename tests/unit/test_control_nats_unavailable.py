"""The control plane when NATS does not answer what a session's writer needs for a report: the
report is asked of the writer again (a worker's resend is settled the same way) and answered
once NATS answers; a writer that drains, or a wait past ``REPORT_RETRY_SECONDS``, fences the
dispatch off (it is dispatched again from its last stored node) instead of failing the agent."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from apomesh.core.errors import LogUnavailable
from apomesh.runtime import control
from apomesh.runtime.config import load_config
from apomesh.runtime.control import ControlPlane
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.protocol import Done, Reply

pytestmark = pytest.mark.anyio


class Writer:
    """A session's writer whose first ``unanswered`` reports meet NATS not answering."""

    def __init__(self, unanswered: int, *, draining: bool = False) -> None:
        self.unanswered = unanswered
        self.asked = 0
        self.draining = draining
        self.stopped = False

    async def handle_report(self, report: Any, size: int) -> Reply:
        self.asked += 1
        if self.asked <= self.unanswered:
            raise LogUnavailable("direct get on APOMESH_LOG: NATS is unavailable (timeout)")
        return Reply("ok")


def plane(writer: Writer) -> ControlPlane:
    return ControlPlane(
        nc=cast(Any, None),
        limits=load_config(None, env={}).limits,
        workers=cast(Any, SimpleNamespace()),
        route=lambda session_id: cast(Any, writer),
        metrics=DaemonMetrics(),
        spawn=asyncio.ensure_future,
    )


REPORT = Done("w1", "s1", "root", 1, outcome="final", output="done")


async def test_a_report_is_answered_once_nats_answers_again() -> None:
    writer = Writer(unanswered=3)
    assert await plane(writer)._decide(REPORT, 10) == Reply("ok")
    assert writer.asked == 4


async def test_a_draining_writer_fences_the_dispatch_off_instead_of_failing_it() -> None:
    writer = Writer(unanswered=1, draining=True)
    reply = await plane(writer)._decide(REPORT, 10)
    assert reply.status == "fenced" and "NATS did not answer" in reply.message
    assert writer.asked == 1


async def test_past_the_retry_time_the_dispatch_is_fenced_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control, "REPORT_RETRY_SECONDS", 0.5)
    writer = Writer(unanswered=1_000)
    reply = await plane(writer)._decide(REPORT, 10)
    assert reply.status == "fenced" and 2 <= writer.asked <= 5
