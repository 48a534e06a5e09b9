"""The data dir's lock on an in-process ``Node`` (embedded nats-server, real LMDB): a second
``Node`` on a data dir in use, or on an embedded store dir another data dir's daemon uses, stops
with ``DataDirInUse`` naming this pid before it starts anything, and the first goes on serving;
a closed ``Node`` lets go of both."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from apomesh.adapters.private_files import DataDirInUse
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node


def node_config(data: Path, **nats: Any) -> Any:
    return load_config(
        None,
        env={},
        overrides={"daemon": {"data_dir": str(data), "workers": 1}, "nats": nats},
    )


async def run_one_session(node: Node, final: str) -> str:
    assert node.daemon is not None and node.service is not None
    definition = {
        "name": "one-turn",
        "coordination": "solo",
        "model": {"provider": "scripted", "turns": [{"final": final}]},
    }
    session_id = await node.service.create_session("go", agent=None, definition=definition, by="t")
    runtime = node.daemon.registry.live[session_id]
    assert runtime.task is not None
    await runtime.task
    return runtime.state.status


@pytest.mark.anyio
async def test_a_second_node_on_the_data_dir_stops_before_it_starts_anything(
    tmp_path: Path,
) -> None:
    config = node_config(tmp_path / "data")
    async with Node(config, http=False) as first:
        for _, worker in first.workers:
            await worker.wait_registered()
        server_pid = first.server.pid
        second = Node(config, http=False)
        with pytest.raises(DataDirInUse, match=f"in use by apomesh serve pid {os.getpid()}") as err:
            await second.start()
        assert err.value.pid == os.getpid()
        assert second.server is None and second.store is None and second.nc is None
        assert first.server.running and first.server.pid == server_pid
        assert await run_one_session(first, "still mine") == "completed"
    # Closed, it lets go: the next Node on the data dir starts.
    async with Node(config, http=False) as again:
        for _, worker in again.workers:
            await worker.wait_registered()
        assert await run_one_session(again, "next") == "completed"


@pytest.mark.anyio
async def test_an_embedded_store_dir_outside_the_data_dir_is_locked_too(tmp_path: Path) -> None:
    shared_store = tmp_path / "shared-nats"
    async with Node(node_config(tmp_path / "a", embedded_store_dir=str(shared_store)), http=False):
        other = Node(node_config(tmp_path / "b", embedded_store_dir=str(shared_store)), http=False)
        with pytest.raises(DataDirInUse, match="embedded nats-server store dir"):
            await other.start()
        assert other.server is None
    # The failed start let go of its own data dir.
    async with Node(node_config(tmp_path / "b"), http=False) as node:
        assert node.server is not None and node.server.running
