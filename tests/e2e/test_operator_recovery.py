"""Recovery an operator relies on, on real processes (``mesh``: a nats-server, an ``apomesh serve``
process, worker processes): a graceful restart (SIGTERM) resumes every session by itself while a
crash (SIGKILL) lists those with side effects; a ``hold`` holds every new unknown outcome, even
after an earlier operator resume; bulk resume from the CLI and the API; and plugin pins that keep a
session's agents off a worker whose plugin versions differ.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import anyio.to_thread
import pytest
from tests.e2e.chaos_kit import appender, check_session

from apomesh.sdk.client import Client, EventRecord
from apomesh.testing import Mesh


async def finished(client: Client, session_id: str, timeout: float = 90) -> list[EventRecord]:
    with anyio.fail_after(timeout):
        return [record async for record in client.events(session_id)]


async def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> Any:
    with anyio.fail_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(0.1)


# --- a graceful restart resumes by itself; a crash lists the sessions with side effects ----------


@pytest.mark.anyio
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_a_graceful_restart_resumes_every_session_by_itself_and_a_crash_lists_them(
    mesh: Mesh, stop: str
) -> None:
    goals = [f"drain-{stop}-{n}-{uuid.uuid4().hex[:6]}" for n in range(3)]
    async with Client(mesh.url) as client:
        ids = [await client.start_session(g, definition=appender(8, delay=0.4)) for g in goals]

        async def all_have_effects() -> bool:
            views = [await client.get_session(s) for s in ids]
            return all(v.side_effects >= 2 and not v.terminal for v in views)

        await wait_for(all_have_effects, "every session made a side effect")
    await anyio.to_thread.run_sync(mesh.daemon.stop if stop == "sigterm" else mesh.daemon.kill)
    await anyio.to_thread.run_sync(mesh.daemon.start)
    async with Client(mesh.url) as client:
        listed = {r.session_id: r for r in await client.list_recoverable()}
        if stop == "sigkill":
            # A crash: side effects logged, so each waits for an operator, as the design says.
            assert set(listed) == set(ids)
            assert {r.category for r in listed.values()} == {"side_effects"}
            for session_id in ids:
                await client.resume(session_id)
        else:
            assert listed == {}
        for session_id in ids:
            records = await finished(client, session_id)
            check = check_session(
                records, await client.verify_session(session_id), mesh.daemon.workspace
            )
            assert check.ok, check.problems
            kinds = [r.kind for r in records]
            resumed = [r.event["reason"] for r in records if r.kind == "AgentResuming"]
            if stop == "sigterm":
                # Drained at a node boundary: suspended with nothing in flight, then resumed under
                # the same ref, its effects served from the journal (each line once, no unknown).
                assert "SessionSuspended" in kinds and "OperatorAction" not in kinds
                assert [r.event["path"] for r in records if r.kind == "SessionRecovered"] == [
                    "auto"
                ]
                assert resumed == ["daemon restart"]
                assert check.unknown_outcomes == 0
            else:
                assert "SessionSuspended" not in kinds
                assert resumed == ["operator resume"]
            assert {r.event["agent"] for r in records if r.kind == "AgentLifecycle"} == {"root"}
