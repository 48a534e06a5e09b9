"""A worker whose event loop is held up (blocking work in an async tool, a stopped process) sends
no heartbeat meanwhile: it says so once it runs again, with what it was running, since its
daemons may have declared it lost for that silence."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from apomesh.runtime.worker import Worker

pytestmark = pytest.mark.anyio


class QuietNats:
    """Takes the worker's subscription and beats; answers nothing."""

    def __init__(self) -> None:
        self.beats = 0

    async def subscribe(self, subject: str, cb: Any = None) -> Any:
        return object()

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.beats += subject.startswith("apomesh.hb.")


async def test_a_held_up_event_loop_is_said_with_the_agents_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nc = QuietNats()
    worker = Worker(
        cast(Any, nc), tools={}, providers={}, workspace=tmp_path, heartbeat_interval=0.05
    )
    await worker.start()
    try:
        await asyncio.sleep(0.2)
        assert nc.beats >= 2
        assert "no heartbeat" not in caplog.text  # beats on time: nothing said
        worker.running[("s1", "root")] = cast(Any, SimpleNamespace(epoch=1))
        with caplog.at_level(logging.WARNING, logger="apomesh.worker"):
            time.sleep(0.4)  # what a blocking call in an async tool does to the loop
            await asyncio.sleep(0.1)
        worker.running.clear()
    finally:
        await worker.aclose()
    said = [r.getMessage() for r in caplog.records if "no heartbeat" in r.getMessage()]
    assert len(said) == 1, said
    assert "held up" in said[0] and "running: s1/root" in said[0]


async def test_a_worker_in_the_daemons_own_process_leaves_its_stalls_to_the_daemon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An in-process worker (one with a local link to its daemon) shares the daemon's event loop:
    a boot scan holds both up, and the daemon allows for its own stalls; nothing is said."""
    nc = QuietNats()
    worker = Worker(
        cast(Any, nc), tools={}, providers={}, workspace=tmp_path, heartbeat_interval=0.05
    )
    worker.local_links["daemon-a"] = cast(Any, None)
    await worker.start()
    try:
        with caplog.at_level(logging.WARNING, logger="apomesh.worker"):
            await asyncio.sleep(0.1)
            time.sleep(0.4)
            await asyncio.sleep(0.1)
    finally:
        await worker.aclose()
    assert "no heartbeat" not in caplog.text
