"""Sessions answered by the fresh-model server (``tests/fakes/fresh_model.py``) on real processes,
nothing killed: solo, fanout (children making the same ``jobs.sleep`` call) and refine sessions
complete through the ``openai`` provider, and the audit the chaos run applies
(``tests/e2e/chaos_audit.py``) finds them clean — the baseline the chaos run's kills are measured
against."""

from __future__ import annotations

import random

import pytest
from tests.e2e.chaos_kit import FreshChaos, use_fresh_model
from tests.fakes.fresh_model import FreshModelServer

from apomesh.sdk.client import Client
from apomesh.testing import Mesh


@pytest.mark.anyio
async def test_fresh_model_sessions_complete_and_audit_clean(bare_mesh: Mesh) -> None:
    mesh = bare_mesh
    with FreshModelServer() as server:
        mesh.start(2, config=use_fresh_model(mesh, server.base_url))
        async with Client(mesh.url) as client:
            chaos = FreshChaos(mesh, client, server.model, server.log, rng=random.Random(3))
            audits = []
            for shape in ("solo", "fanout", "refine"):
                session_id = await client.start_session(
                    f"calm {shape}", definition=chaos.definition(shape)
                )
                in_time = await chaos.settle(session_id)
                audits.append(await chaos.audit(session_id, shape, in_time=in_time))
    for audit in audits:
        assert audit.ok, audit.problems
        assert audit.status == "completed"
        assert audit.output_from_model is True
    effects = [c for c in server.log() if c.get("answer", {}).get("tool_calls")]
    jobs = [
        c
        for c in effects
        if any(t["function"]["name"] == "jobs__sleep" for t in c["answer"]["tool_calls"])
    ]
    assert len(jobs) >= 2, "the fanout children made no identical job calls"
    assert chaos.tally.sessions == 3 and chaos.tally.duplicates == 0
