"""A start waits for JetStream to answer its streams too, not only its KV buckets: a real daemon
(``Node`` with its embedded nats-server, one in-process worker, LMDB) whose log stream does not
answer its first two ensures (``LogUnavailable``, as a cluster electing the stream's leader
answers) tries again every second, warns once for the whole start, starts and runs a session;
given too short a ``[nats] jetstream_ready_timeout`` it stops with ``LogUnavailable`` and takes
down what it had started (its server among them)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
from tests.integration.test_node_reports import one_worker_config

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.core.errors import LogUnavailable
from apomesh.runtime.node import Node

pytestmark = pytest.mark.anyio

WARNING = "JetStream does not answer yet"


def config_for(tmp_path: Path, **nats: Any) -> Any:
    return one_worker_config(tmp_path, nats=nats)


def failing_ensure(monkeypatch: pytest.MonkeyPatch, failures: int | None) -> list[float]:
    """Make the log stream's ``ensure`` answer ``LogUnavailable`` ``failures`` times (always,
    for None) before it runs; the list fills with the attempts' loop times."""
    ensure = JetStreamLog.ensure
    attempts: list[float] = []

    async def unanswered(self: JetStreamLog) -> None:
        import asyncio

        attempts.append(asyncio.get_running_loop().time())
        if failures is None or len(attempts) <= failures:
            raise LogUnavailable("ensure stream APOMESH_LOG: NATS is unavailable (TimeoutError)")
        await ensure(self)

    monkeypatch.setattr(JetStreamLog, "ensure", unanswered)
    return attempts


async def test_a_start_waits_for_the_log_stream_then_runs_a_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = failing_ensure(monkeypatch, failures=2)
    caplog.set_level(logging.WARNING, logger="apomesh")
    async with Node(config_for(tmp_path), http=False) as node:
        assert node.daemon is not None and node.service is not None
        session_id = await node.service.create_session(
            "after-the-wait",
            agent=None,
            definition={
                "name": "answer",
                "version": "1.0.0",
                "coordination": "solo",
                "model": {"provider": "scripted", "turns": [{"final": "done"}]},
            },
            by="t",
        )
        runtime = node.daemon.registry.live[session_id]
        assert runtime.task is not None
        await runtime.task
        assert runtime.state.status == "completed"
    assert len(attempts) == 3
    assert all(b - a >= 0.9 for a, b in itertools.pairwise(attempts)), attempts
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1 and "APOMESH_LOG" in warnings[0], warnings


async def test_a_start_that_waits_past_its_limit_stops_with_log_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = failing_ensure(monkeypatch, failures=None)
    node = Node(config_for(tmp_path, jetstream_ready_timeout=2.5), http=False)
    with pytest.raises(LogUnavailable, match="APOMESH_LOG"):
        await node.start()
    # Every second from the start's first JetStream request (the KV buckets) until 2.5 s.
    assert 2 <= len(attempts) <= 3, attempts
    assert node.server is not None and not node.server.running
