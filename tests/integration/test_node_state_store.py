"""The daemon's state store as ``Node`` wires it: LMDB alone on the embedded server by default,
LMDB written through to the replicated ``APOMESH_STATE`` bucket with ``[store] replicated =
"on"`` (here on the embedded server, logged in as the daemon): a session's snapshots, segments,
definition and journal copy are in the bucket, the daemon's identity is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apomesh.adapters.lmdb_store import LmdbStore
from apomesh.adapters.replicated_store import ReplicatedStore
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node

WRITER = {
    "name": "writer",
    "version": "1.0.0",
    "coordination": "solo",
    "tools": ["fs.write"],
    "model": {
        "provider": "scripted",
        "turns": [
            {"tool_calls": [{"tool": "fs.write", "args": {"path": "a.txt", "content": "one"}}]},
            {"final": "written"},
        ],
    },
}


def _config(tmp_path: Path, **store: Any) -> Any:
    return load_config(
        None,
        env={},
        overrides={
            "daemon": {"data_dir": str(tmp_path / "data"), "workers": 1},
            "plugins": {"allow": ["apomesh"]},
            "store": store,
        },
    )


async def _run_session(node: Node) -> str:
    assert node.daemon is not None and node.service is not None
    for _, worker in node.workers:
        await worker.wait_registered()
    session_id = await node.service.create_session("w", agent=None, definition=WRITER, by="t")
    runtime = node.daemon.registry.live[session_id]
    assert runtime.task is not None
    await runtime.task
    assert runtime.state.status == "completed"
    return session_id


@pytest.mark.anyio
async def test_the_embedded_default_keeps_lmdb_alone(tmp_path: Path) -> None:
    async with Node(_config(tmp_path), http=False) as node:
        assert node.config.store.replicated == "auto"  # auto: no NATS URLs given, so off
        assert node.store is not None and isinstance(node.store.store, LmdbStore)
        await _run_session(node)
        streams = await node.nc.jetstream().streams_info()
        assert all(info.config.name != "KV_APOMESH_STATE" for info in streams)


@pytest.mark.anyio
async def test_replicated_on_writes_what_recovery_reads_to_the_bucket(tmp_path: Path) -> None:
    async with Node(_config(tmp_path, replicated="on"), http=False) as node:
        assert node.store is not None
        store = node.store.store
        assert isinstance(store, ReplicatedStore)
        session_id = await _run_session(node)
        agent = f"{session_id}/root"
        for db, prefix in (("snapshots", agent + "\x00"), ("segments", agent + "\x00")):
            in_bucket = store._run(store.replica.scan(db, prefix))
            assert in_bucket and in_bucket == store.local.scan(db, prefix)
        assert store._run(store.replica.get("defs", agent)) == store.local.get("defs", agent)
        assert len(store._run(store.replica.scan("journal", agent + "\x00"))) == 1
        assert store._run(store.replica.get("completed", session_id)) is not None
        assert store.local.get("meta", "daemon_id") is not None
        assert store._run(store.replica.get("meta", "daemon_id")) is None
