"""Dispatches never outgrow the NATS payload limit (a fake NATS connection with a 64 KiB
``max_payload`` that records what it is asked to send): a working memory larger than a page stays
with the dispatch on the daemon and comes back whole page by page, each page within the limit; a
dispatch that can never be sent is refused with a typed error instead of being tried again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
from tests.writers import writer_deps

from apomesh.core.definition import AgentConfig, Budget, ModelSpec
from apomesh.core.errors import PayloadTooLarge
from apomesh.core.state import new_state
from apomesh.plugins.api import Message
from apomesh.runtime.config import load_config
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.protocol import (
    ENCODER,
    MEMORY_DECODER,
    AgentMemory,
    DispatchAck,
    MemoryFetch,
    Run,
)
from apomesh.runtime.sessions import DispatchSlot, SessionRuntime
from apomesh.runtime.workers import WorkerPool

pytestmark = pytest.mark.anyio
LIMIT = 64 * 1024


class FakeNats:
    max_payload = LIMIT

    def __init__(self) -> None:
        self.sent: list[int] = []

    async def request(
        self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> Any:
        self.sent.append(len(data))

        class Msg:
            data = ENCODER.encode(DispatchAck(True))

        return Msg()


def runtime(tmp_path: Path, pool: WorkerPool) -> SessionRuntime:
    return SessionRuntime(writer_deps(tmp_path, workers=pool), new_state("s-big"))


def run_with(memory: AgentMemory | None, instructions: str = "") -> Run:
    config = AgentConfig(
        name="big",
        version="1.0.0",
        role="root",
        instructions=instructions,
        model=ModelSpec(provider="scripted"),
        tools=[],
        skills=[],
        budget=Budget(),
    )
    return Run("s-big", "root", 1, config, "act", "go", memory=memory)


async def test_a_memory_over_a_page_is_fetched_back_whole_in_pages(tmp_path: Path) -> None:
    nc = FakeNats()
    pool = WorkerPool(
        load_config(None, env={}),
        nc=cast(Any, nc),
        incarnation="test",
        metrics=DaemonMetrics(),
        on_registered=lambda: asyncio.sleep(0),
    )
    writer = runtime(tmp_path, pool)
    messages = [Message(role="tool", content=f"{i}" * 10_000) for i in range(20)]
    memory = AgentMemory(messages=messages, step=20)
    slot = DispatchSlot("root", 1, "w1", cast(Any, None))
    run = writer._fit_to_payload(slot, run_with(memory))
    assert run.memory is None and run.memory_pages > 1
    assert await pool.send_run("w1", run)
    pages = []
    for page in range(run.memory_pages):
        reply = writer._on_memory(slot, MemoryFetch("w1", "s-big", "root", 1, page))
        assert reply.status == "ok"
        assert len(ENCODER.encode(reply)) < LIMIT
        pages.append(reply.data)
    assert MEMORY_DECODER.decode(b"".join(pages)) == memory
    beyond = writer._on_memory(slot, MemoryFetch("w1", "s-big", "root", 1, run.memory_pages))
    assert beyond.status == "error"
    assert max(nc.sent) < LIMIT
    # A small memory still travels with its dispatch.
    small = run_with(AgentMemory(messages=messages[:1]))
    assert writer._fit_to_payload(DispatchSlot("root", 2, "w1", cast(Any, None)), small) == small


async def test_a_dispatch_that_can_never_fit_is_refused_with_a_typed_error() -> None:
    nc = FakeNats()
    pool = WorkerPool(
        load_config(None, env={}),
        nc=cast(Any, nc),
        incarnation="test",
        metrics=DaemonMetrics(),
        on_registered=lambda: asyncio.sleep(0),
    )
    with pytest.raises(PayloadTooLarge, match="the dispatch of s-big/root"):
        await pool.send_run("w1", run_with(None, instructions="x" * (2 * LIMIT)))
    assert nc.sent == []  # never put on the wire
