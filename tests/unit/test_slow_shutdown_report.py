"""A shutdown that outlasts its grace period says what it waits on: the stage, and where each
other task of the event loop is suspended (followed down its ``await`` chain)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from apomesh.runtime import node as node_module
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node

pytestmark = pytest.mark.anyio


async def _waits_on_a_reply(never: asyncio.Event) -> None:
    await never.wait()


async def _held_open(never: asyncio.Event) -> None:
    await _waits_on_a_reply(never)


async def test_a_slow_shutdown_names_its_stage_and_the_innermost_awaits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(node_module, "SLOW_SHUTDOWN_MARGIN", 0.01)
    config = load_config(None, env={}, overrides={"daemon": {"shutdown_timeout": 0}})
    never = asyncio.Event()
    stuck = asyncio.create_task(_held_open(never), name="stuck-writer")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="apomesh.node"):
        await Node(config)._report_a_slow_shutdown(["the daemon"])
    stuck.cancel()
    (record,) = [r for r in caplog.records if r.name == "apomesh.node"]
    message = record.getMessage()
    assert "shutdown still waiting on the daemon" in message
    assert "stuck-writer:" in message and "in wait" in message, message
