"""The operator console in a real headless Chromium (Playwright) on a real daemon with worker
processes: a fanout session followed live while the worker running a sub-agent is SIGKILLed (the
tree marks the agent resuming, then resumed), a pause answered through the form, and a session
stranded by a daemon SIGKILL resumed from the recoverable page after its preview. The daemon asks
for tokens as it does by default: each test signs in through the console's token dialog with the
operator token the daemon wrote into its data dir. Screenshots go to ``$APOMESH_SHOTS`` (default
/tmp)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from tests.browser import by_testid, wait_for
from tests.e2e.api_support import (
    appender,
    asker,
    bearer,
    fanout_writer,
    journal_lines,
    start_mesh,
    stop_mesh,
    wait_event,
    wait_until,
)
from tests.e2e.api_support import view as api_view

from apomesh.testing import Mesh

SHOTS = Path(os.environ.get("APOMESH_SHOTS", "/tmp"))
pytestmark = pytest.mark.anyio


@pytest.fixture
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A fresh system whose daemon asks for tokens (its default), with two workers."""
    system = start_mesh(tmp_path_factory.mktemp("console"), auth=True)
    try:
        yield system
    finally:
        stop_mesh(system)


async def sign_in(page: Any, mesh: Mesh, path: str) -> None:
    """Open the console at ``path``: it asks for a token, and gets the daemon's first one."""
    await page.goto(f"{mesh.url}/{path}")
    await wait_for(page, by_testid("token-dialog"))
    await page.fill(by_testid("token-input"), mesh.daemon.token)
    await page.click(by_testid("token-submit"))
    await wait_for(page, by_testid("token-dialog"), state="hidden")


async def start(mesh: Mesh, goal: str, definition: dict[str, Any]) -> str:
    async with httpx.AsyncClient(timeout=30, headers=bearer(mesh.daemon.token)) as client:
        response = await client.post(
            f"{mesh.url}/v1/sessions", json={"goal": goal, "definition": definition}
        )
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def view(mesh: Mesh, session_id: str) -> dict[str, Any]:
    return api_view(mesh.url, session_id, mesh.daemon.token)


async def timeline_indexes(page: Any) -> list[int]:
    indexes: list[int] = await page.eval_on_selector_all(
        by_testid("timeline-item"), "items => items.map(i => Number(i.dataset.index))"
    )
    return indexes


async def test_a_fanout_session_is_followed_through_a_worker_kill(page: Any, mesh: Mesh) -> None:
    session_id = await start(mesh, "write three parts", fanout_writer("console", 5, 0.5))
    await sign_in(page, mesh, f"#/sessions/{session_id}")
    await wait_for(page, by_testid("session-page", session_id=session_id))
    await wait_for(page, by_testid("stream-state", state="live"))
    assert await page.text_content(by_testid("session-goal")) == "write three parts"

    # A sub-agent shows up running in the tree; SIGKILL the worker process running it.
    running = await wait_for(
        page, f'{by_testid("agent-node", phase="running")}[data-agent-ref*="/"]'
    )
    agent = await running.get_attribute("data-agent-ref")
    effect = await anyio.to_thread.run_sync(
        lambda: wait_event(
            mesh.url,
            session_id,
            lambda e: e["kind"] == "ToolCallRecorded" and e["event"]["agent"] == agent,
            token=mesh.daemon.token,
        )
    )
    assert effect["event"]["outcome"] == "ok"
    state = await anyio.to_thread.run_sync(view, mesh, session_id)
    worker_id = next(a["worker"] for a in state["agents"] if a["ref"] == agent)
    workers = httpx.get(f"{mesh.url}/v1/workers", headers=bearer(mesh.daemon.token)).json()[
        "workers"
    ]
    name = next(w["name"] for w in workers if w["id"] == worker_id)
    victim = next(w for w in mesh.workers if w.name == name)
    await anyio.to_thread.run_sync(victim.kill)
    await anyio.to_thread.run_sync(mesh.worker)

    # The tree marks the agent while it is being resumed, the timeline highlights the pair.
    resuming = await wait_for(page, by_testid("agent-node", agent_ref=agent, resuming="true"))
    assert await resuming.query_selector(by_testid("agent-resuming-badge")) is not None
    item = await wait_for(page, by_testid("timeline-item", kind="AgentResuming"))
    assert "resume" in (await item.get_attribute("class"))
    assert "lost" in (await item.text_content())
    await page.screenshot(path=str(SHOTS / "console-e2e-resuming.png"), full_page=True)
    resumed = await wait_for(page, by_testid("agent-node", agent_ref=agent, resuming="false"))
    await wait_for(page, by_testid("timeline-item", kind="AgentResumed"))
    assert "resumes: 1" in (await resumed.text_content())

    await wait_for(page, by_testid("session-status", status="completed"))
    await wait_for(page, by_testid("stream-state", state="ended"))
    assert await page.text_content(by_testid("session-output")) == "three parts"
    for ref in ("root", "root/0", "root/1", "root/2"):
        await wait_for(page, by_testid("agent-node", agent_ref=ref, phase="completed"))
    indexes = await timeline_indexes(page)
    assert indexes == list(range(len(indexes)))
    assert indexes[-1] == (await anyio.to_thread.run_sync(view, mesh, session_id))["last_index"]
    await page.screenshot(path=str(SHOTS / "console-e2e-session.png"), full_page=True)
    for index in range(3):
        lines = journal_lines(mesh.daemon.workspace / session_id, f"console-{index}.txt")
        assert len(lines) == len(set(lines)) == 5

    # The sessions list shows it, and the workers page the one killed and its replacement.
    await page.click('a[href="#/sessions"] >> nth=0')
    await wait_for(page, by_testid("session-row", session_id=session_id, status="completed"))
    await page.screenshot(path=str(SHOTS / "console-e2e-sessions.png"), full_page=True)
    await page.click(by_testid("nav-workers"))
    await wait_for(page, by_testid("worker-row", alive="true"))
    lost = await wait_for(page, by_testid("worker-row", worker_id=worker_id, alive="false"))
    assert "lost" in (await lost.text_content())
    assert await page.locator(by_testid("worker-row", alive="true")).count() == 2
    await page.screenshot(path=str(SHOTS / "console-e2e-workers.png"), full_page=True)


async def test_a_pause_is_answered_through_the_form(page: Any, mesh: Mesh) -> None:
    session_id = await start(mesh, "choose a cover", asker("Which colour should the cover be?"))
    await sign_in(page, mesh, f"#/sessions/{session_id}")
    pause = await wait_for(page, by_testid("hitl-pause"))
    question = await pause.query_selector(by_testid("hitl-question"))
    assert await question.text_content() == "Which colour should the cover be?"
    await wait_for(page, by_testid("session-status", status="paused"))
    await page.screenshot(path=str(SHOTS / "console-e2e-pause.png"), full_page=True)
    await page.fill(by_testid("hitl-answer-input"), "Deep blue.")
    await page.click(by_testid("hitl-answer-submit"))
    await wait_for(page, by_testid("hitl-pause"), state="detached")
    await wait_for(page, by_testid("timeline-item", kind="HitlAnswered"))
    await wait_for(page, by_testid("session-status", status="completed"))
    answered = await anyio.to_thread.run_sync(
        lambda: wait_event(
            mesh.url, session_id, lambda e: e["kind"] == "HitlAnswered", token=mesh.daemon.token
        )
    )
    assert answered["event"]["answer"] == "Deep blue."


async def test_a_session_stranded_by_a_daemon_kill_is_resumed_after_its_preview(
    page: Any, mesh: Mesh
) -> None:
    session_id = await start(mesh, "append six lines", appender("console-resume.txt"))
    await sign_in(page, mesh, f"#/sessions/{session_id}")
    await wait_for(page, by_testid("stream-state", state="live"))
    await wait_for(page, by_testid("timeline-item", kind="ToolCallRecorded"))

    # The daemon dies mid-session: the page notices and reconnects once it is back.
    await anyio.to_thread.run_sync(mesh.daemon.kill)
    await wait_for(page, by_testid("stream-state", state="reconnecting"))
    await anyio.to_thread.run_sync(mesh.daemon.start)
    await wait_for(page, by_testid("stream-state", state="live"))
    await wait_for(page, by_testid("session-status", status="recoverable"))
    await wait_for(page, f'{by_testid("recoverable-count")}:has-text("1")')

    await page.click(by_testid("nav-recoverable"))
    row = await wait_for(page, by_testid("recoverable-row", session_id=session_id))
    assert "side effects" in (await row.text_content())
    await page.click(
        f"{by_testid('recoverable-row', session_id=session_id)} {by_testid('recoverable-resume')}"
    )
    preview = await wait_for(page, by_testid("resume-preview", session_id=session_id))
    assert await preview.query_selector(by_testid("preview-no-pins")) is not None
    reason = await preview.query_selector(by_testid("preview-reason"))
    assert "side effect" in (await reason.text_content())
    outcomes = await preview.query_selector_all(by_testid("preview-unknown-outcome"))
    nothing_unknown = await preview.query_selector(by_testid("preview-no-unknown"))
    assert outcomes or nothing_unknown is not None
    await page.screenshot(path=str(SHOTS / "console-e2e-preview.png"), full_page=True)
    assert (await anyio.to_thread.run_sync(view, mesh, session_id))["status"] == "recoverable"

    await page.click(by_testid("resume-confirm"))
    await wait_for(page, by_testid("session-page", session_id=session_id))
    await wait_for(page, by_testid("timeline-item", kind="OperatorAction"))
    await wait_for(page, by_testid("timeline-item", kind="SessionRecovered"))
    await wait_for(page, by_testid("session-status", status="completed"))
    await wait_for(page, by_testid("stream-state", state="ended"))
    indexes = await timeline_indexes(page)
    assert indexes == list(range(len(indexes)))
    lines = journal_lines(mesh.daemon.workspace / session_id, "console-resume.txt")
    assert len(lines) == len(set(lines)) >= 5

    await page.click(by_testid("nav-recoverable"))
    await wait_for(page, by_testid("recoverable-empty"))
    wait_until(
        lambda: (
            httpx.get(f"{mesh.url}/v1/recoverable", headers=bearer(mesh.daemon.token)).json()[
                "sessions"
            ]
            == []
        ),
        10,
    )
