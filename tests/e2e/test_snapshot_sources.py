"""Snapshot sources are a closed set, on real processes: an ``apomesh serve`` daemon on a real
nats-server, and a worker of the test's own (the real ``Worker`` class, registered over NATS like
any worker) that answers its dispatch with a node report whose source is ``hitl``. A HITL pause is
recovered by re-running the loop, never by a snapshot, so the daemon refuses the report with the
closed set it knows, and the log holds no such snapshot; a report with a built-in source is
taken."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from apomesh.adapters.nats_connect import connect
from apomesh.plugins.api import Message
from apomesh.runtime.protocol import BudgetState, NodeReport, Reply, Run, worker_inbox_prefix
from apomesh.runtime.worker import Worker
from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess


class ReportingWorker(Worker):
    """Answers its first dispatch with one node report per source in ``sources``."""

    def __init__(self, *args: Any, sources: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sources = sources
        self.replies: dict[str, Reply] = {}
        self.reported = asyncio.Event()

    async def _run(self, run: Run, headers: dict[str, str] | None = None) -> None:
        for step, source in enumerate(self.sources, start=1):
            report = NodeReport(
                self.worker_id,
                run.session_id,
                run.agent,
                run.epoch,
                step=step,
                new_messages=[Message(role="assistant", content=f"node {step}")],
                model={},
                budget=BudgetState(steps=step),
                source=source,
            )
            self.replies[source] = await self.send(report, run.daemon)
        self.reported.set()


@pytest.fixture
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, DaemonProcess]]:
    from apomesh.adapters.natsserver import NatsServer, single_node

    base = tmp_path_factory.mktemp("sources")
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    process = DaemonProcess([server.url], base / "daemon")
    try:
        process.start()
        yield server.url, process
    finally:
        process.stop()
        server.stop()


@pytest.mark.anyio
async def test_a_node_report_with_a_source_outside_the_closed_set_is_refused(
    daemon: tuple[str, DaemonProcess], tmp_path: Any
) -> None:
    nats_url, process = daemon
    worker_id = "rogue-1"
    nc = await connect([nats_url], inbox_prefix=worker_inbox_prefix(worker_id))
    from apomesh.builtin.models import ScriptedProvider

    worker = ReportingWorker(
        nc,
        tools={},
        providers={"scripted": ScriptedProvider()},
        workspace=tmp_path / "ws",
        worker_id=worker_id,
        heartbeat_interval=0.3,
        sources=["hitl", "node"],
    )
    await worker.start()
    try:
        await worker.wait_registered()
        definition = {
            "name": "quiet",
            "version": "1.0.0",
            "coordination": "solo",
            "tools": [],
            "model": {"provider": "scripted", "turns": [{"final": "done"}]},
        }
        async with httpx.AsyncClient(base_url=process.url) as http:
            response = await http.post(
                "/v1/sessions", json={"goal": "report", "definition": definition}
            )
            assert response.status_code == 201, response.text
            session_id = response.json()["session_id"]
        await asyncio.wait_for(worker.reported.wait(), 30)
        refused = worker.replies["hitl"]
        assert refused.status == "error", refused
        assert "unknown snapshot source 'hitl'" in refused.message
        assert "node" in refused.message  # it names the closed set it knows
        assert worker.replies["node"].status == "ok", worker.replies["node"]
        async with Client(process.url) as client:
            sources = []
            async for record in client.events(session_id):
                if record.kind == "AgentSnapshotted":
                    sources.append(record.event["source"])
                    break
            await client.cancel(session_id)
        assert sources == ["node"]
    finally:
        await worker.aclose()
        await nc.close()
