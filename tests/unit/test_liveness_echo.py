"""The daemon's echo to itself (``WorkerPool.liveness_forever``): a control login that may not use
``apomesh.echo.*`` (an older ``accounts.conf``) gets no echo back; liveness must then judge as it
did before the echo, not stay deaf for good, and stop sending echoes after ``ECHO_TRIES``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from apomesh.runtime import workers as workers_module
from apomesh.runtime.config import load_config
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.protocol import Register
from apomesh.runtime.workers import WorkerPool

pytestmark = pytest.mark.anyio


class NoEchoNats:
    """Takes subscriptions and publishes; delivers nothing back (the echo refused)."""

    is_connected = True

    def __init__(self) -> None:
        self.echoes = 0

    async def subscribe(self, subject: str, cb: Any = None) -> Any:
        class Sub:
            async def unsubscribe(self) -> None:
                return None

        return Sub()

    async def publish(self, subject: str, data: bytes) -> None:
        self.echoes += subject.startswith("apomesh.echo.")


async def test_without_an_echo_a_silent_worker_is_still_declared_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(workers_module, "ECHO_TRIES", 5)
    nc = NoEchoNats()
    config = load_config(
        None,
        env={"APOMESH_LIVENESS_HEARTBEAT_INTERVAL": "0.04", "APOMESH_LIVENESS_MISSED_BEATS": "2"},
    )
    pool = WorkerPool(
        config,
        nc=cast(Any, nc),
        incarnation="inc-1",
        daemon_id="daemon-a",
        metrics=DaemonMetrics(),
        on_registered=lambda: asyncio.sleep(0),
    )
    await pool.register(Register("w1", "w1", [], ["scripted"], max_agents=1))
    judging = asyncio.ensure_future(
        pool.liveness_forever(pending_beats=lambda: 0, closing=lambda: False)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="apomesh.daemon"):
            for _ in range(200):
                await asyncio.sleep(0.01)
                if "w1" not in pool.workers:
                    break
            await asyncio.sleep(0.2)
    finally:
        judging.cancel()
        await asyncio.gather(judging, return_exceptions=True)
    assert "w1" not in pool.workers  # silent, and judged: the missing echo is no deafness
    assert nc.echoes == 5  # given up after ECHO_TRIES
    assert caplog.text.count("never came back") == 1
