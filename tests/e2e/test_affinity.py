"""Sticky affinity: an agent that asks for it stays on its worker from one dispatch to the next,
and releases it with an ``affinity_release`` snapshot when it is done."""

from __future__ import annotations

from typing import Any

from tests.e2e.test_runtime import log_of, start, wait_ended

from apomesh.testing import Mesh

STICKY_FANOUT: dict[str, Any] = {
    "name": "sticky",
    "version": "1.0.0",
    "coordination": "fanout",
    "affinity": "sticky",
    "model": {"provider": "scripted", "turns": [{"plan": ["a", "b"]}, {"final": "joined"}]},
    "roles": {
        "worker": {
            "affinity": "",
            "model": {"provider": "scripted", "turns": [{"final": "did {task}"}]},
        }
    },
}


def test_sticky_root_keeps_its_worker_and_releases_it_at_the_end(mesh: Mesh) -> None:
    session_id = start(mesh.url, "stick", STICKY_FANOUT)
    assert wait_ended(mesh.url, session_id)["status"] == "completed"
    records = log_of(mesh.url, session_id)
    root_workers = [
        r.event["worker"]
        for r in records
        if r.kind == "AgentLifecycle"
        and r.event["agent"] == "root"
        and r.event["phase"] == "dispatched"
    ]
    resumed = any(r.kind == "AgentResuming" and r.event["agent"] == "root" for r in records)
    assert len(root_workers) == 2
    if not resumed:  # a worker wrongly declared lost under load may move the root; nothing else may
        assert root_workers[0] == root_workers[1]
    sources = [
        r.event["source"]
        for r in records
        if r.kind == "AgentSnapshotted" and r.event["agent"] == "root"
    ]
    assert sources[-1] == "affinity_release"
    child_sources = [
        r.event["source"]
        for r in records
        if r.kind == "AgentSnapshotted" and r.event["agent"] != "root"
    ]
    assert "affinity_release" not in child_sources
