"""The operator console in a real headless Chromium (Playwright) on a real daemon with worker
processes: a fanout session followed live while the worker running a sub-agent is SIGKILLed (the
timeline marks the resume, the tree drops "resuming" once the new dispatch runs, the agent
timeline shows a bar per agent with the resume mark, timeline rows open to their payload and
filter by kind and agent, the agent's conversation shows its calls, the sessions list searches
by id, goal, status and date); a pause answered through the form (the conversation shows the
question and the answer, the completed agent no longer waits for one); and a session stranded by
a daemon SIGKILL (its agent shown stopped, not running) resumed from its own page after its
preview. The daemon asks
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
    sse,
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


def session_events(mesh: Mesh, session_id: str) -> list[dict[str, Any]]:
    """Every event of an ended session (envelopes as JSON), from its event stream."""
    with httpx.Client(timeout=30, headers=bearer(mesh.daemon.token)) as client:
        return [item.data for item in sse(client, mesh.url, session_id) if item.data is not None]


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

    # The timeline highlights the resume; the tree marks the agent "resuming" only until its
    # new dispatch runs: it then reads running, with no badge, while it still works.
    item = await wait_for(page, by_testid("timeline-item", kind="AgentResuming"))
    assert "resume" in (await item.get_attribute("class"))
    assert "lost" in (await item.text_content())
    await page.screenshot(path=str(SHOTS / "console-e2e-resuming.png"), full_page=True)
    resumed = await wait_for(
        page, by_testid("agent-node", agent_ref=agent, phase="running", resuming="false")
    )
    assert await resumed.query_selector(by_testid("agent-resuming-badge")) is None
    assert "resumes: 1" in (await resumed.text_content())
    assert (await anyio.to_thread.run_sync(view, mesh, session_id))["status"] == "running"
    await wait_for(page, by_testid("timeline-item", kind="AgentResumed"))

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

    # The agent timeline beside the tree: a bar per agent, the killed one with its resume mark.
    bars = page.locator(by_testid("agent-bar"))
    assert await bars.count() == 4
    killed = page.locator(by_testid("agent-bar", agent_ref=agent))
    assert await killed.get_attribute("data-resumes") == "1"
    assert await killed.locator(by_testid("agent-bar-resume")).is_visible()
    resumes = {
        a["ref"]: a["resumes"]
        for a in (await anyio.to_thread.run_sync(view, mesh, session_id))["agents"]
    }
    assert resumes[agent] == 1
    for ref in ("root", "root/0", "root/1", "root/2"):
        bar = page.locator(by_testid("agent-bar", agent_ref=ref))
        assert await bar.get_attribute("data-phase") == "completed"
        assert await bar.locator(".seg.phase-running").count() >= 1
        assert await bar.locator(by_testid("agent-bar-resume")).count() == resumes[ref]
    await page.locator(by_testid("agent-timeline")).screenshot(
        path=str(SHOTS / "console-e2e-agent-timeline.png")
    )

    # A timeline row opens to its payload, and closes again.
    recorded = page.locator(by_testid("timeline-item", kind="ToolCallRecorded", agent=agent)).first
    await recorded.click()
    payload = recorded.locator(by_testid("timeline-payload"))
    assert await payload.is_visible()
    text = await payload.text_content()
    assert (
        '"outcome": "ok"' in text
        and f'"agent": "{agent}"' in text
        and '"tool": "fs.append"' in text
    )
    await recorded.screenshot(path=str(SHOTS / "console-e2e-payload.png"))
    await recorded.locator(".what").click()
    assert await payload.count() == 0

    # Filters on the timeline: by kind, then by agent too.
    total = len(indexes)
    await page.select_option(by_testid("timeline-filter-kind"), "ToolCallRecorded")
    shown = page.locator(f"{by_testid('timeline-item')}:visible")
    assert await shown.count() == 15  # five appends by each of three sub-agents
    assert set(await shown.evaluate_all("rows => rows.map(r => r.dataset.kind)")) == {
        "ToolCallRecorded"
    }
    assert await page.text_content(by_testid("timeline-count")) == f"15 of {total} events"
    await page.select_option(by_testid("timeline-filter-agent"), agent)
    assert await shown.count() == 5
    assert set(await shown.evaluate_all("rows => rows.map(r => r.dataset.agent)")) == {agent}
    await page.select_option(by_testid("timeline-filter-kind"), "")
    agent_rows = await shown.evaluate_all("rows => rows.map(r => r.dataset.kind)")
    assert "AgentResuming" in agent_rows and "ToolCallIntent" in agent_rows
    await page.select_option(by_testid("timeline-filter-agent"), "")
    assert await shown.count() == total

    # The agent's conversation: its task, each call with its arguments, each result, its output.
    await page.click(
        f"{by_testid('agent-node', agent_ref=agent)} >> {by_testid('agent-open')} >> nth=0"
    )
    talk = await wait_for(page, by_testid("conversation", agent_ref=agent))
    await wait_for(page, by_testid("conversation-entry", kind="output"))
    calls = page.locator(by_testid("conversation-entry", kind="tool_call"))
    assert await calls.count() == 5
    first_args = await calls.first.locator(by_testid("conversation-args")).text_content()
    task = next(
        a["task"]
        for a in (await anyio.to_thread.run_sync(view, mesh, session_id))["agents"]
        if a["ref"] == agent
    )
    assert f'"line": "{task}: line 1"' in first_args
    results = page.locator(by_testid("conversation-entry", kind="tool_result", outcome="ok"))
    assert await results.count() == 5
    output = await talk.query_selector(by_testid("conversation-entry", kind="output"))
    assert f"wrote {task}" in (await output.text_content())
    await page.locator(by_testid("conversation-panel")).screenshot(
        path=str(SHOTS / "console-e2e-conversation.png")
    )

    # The sessions list shows it, found by part of its id, its goal, its status and its date;
    # the workers page shows the one killed and its replacement.
    await page.click('a[href="#/sessions"] >> nth=0')
    row = by_testid("session-row", session_id=session_id, status="completed")
    await wait_for(page, row)
    await page.fill(by_testid("session-search"), session_id[4:14])
    await wait_for(page, row)
    await page.fill(by_testid("session-search"), "THREE parts")
    await wait_for(page, row)
    await page.select_option(by_testid("session-filter-status"), "running")
    await wait_for(page, by_testid("sessions-empty"))
    await page.select_option(by_testid("session-filter-status"), "completed")
    await wait_for(page, row)
    today = await page.evaluate(
        "() => { const d = new Date(); return [d.getFullYear(), d.getMonth() + 1, d.getDate()]"
        ".map((n, i) => String(n).padStart(i ? 2 : 4, '0')).join('-'); }"
    )
    await page.fill(by_testid("session-filter-date"), today)
    await wait_for(page, row)
    await page.screenshot(path=str(SHOTS / "console-e2e-sessions.png"), full_page=True)
    await page.fill(by_testid("session-filter-date"), "2999-01-01")
    await wait_for(page, by_testid("sessions-empty"))
    await page.fill(by_testid("session-filter-date"), "")
    await page.fill(by_testid("session-search"), "")
    await page.select_option(by_testid("session-filter-status"), "")
    await wait_for(page, row)

    # The console has its icon.
    icon = await page.request.get(f"{mesh.url}/favicon.ico")
    assert icon.status == 200 and icon.headers["content-type"] == "image/x-icon"
    assert (await icon.body())[:4] == b"\x00\x00\x01\x00"
    assert await page.get_attribute('link[rel="icon"]', "href") == "/favicon.ico"
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
    # Completed, the agent no longer reads "waiting for a human answer".
    root = await wait_for(page, by_testid("agent-node", agent_ref="root", phase="completed"))
    assert "waiting for a human answer" not in (await root.text_content())
    assert await root.query_selector(".agent-reason") is None
    # Its conversation shows the question and the answer, and who gave it.
    await page.click(by_testid("agent-open"))
    await wait_for(page, by_testid("conversation-entry", kind="output"))
    question = page.locator(by_testid("conversation-entry", kind="question"))
    assert "Which colour should the cover be?" in (await question.text_content())
    answer = page.locator(by_testid("conversation-entry", kind="answer"))
    assert "Deep blue." in (await answer.text_content())
    assert "answer by " in (await answer.text_content()).lower()
    talk = await page.text_content(by_testid("conversation"))
    assert "null" not in talk and "undefined" not in talk
    await page.screenshot(path=str(SHOTS / "console-e2e-answered.png"), full_page=True)
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
    # Nothing runs in a session waiting for an operator: its agent is not shown "running".
    stopped = await wait_for(page, by_testid("agent-node", agent_ref="root", shown="stopped"))
    assert await stopped.get_attribute("data-phase") in ("running", "dispatched")
    phase_badge = await stopped.query_selector(by_testid("agent-phase"))
    assert await phase_badge.text_content() == "stopped"
    assert await page.locator(f'{by_testid("agent-tree")} >> text="running"').count() == 0
    assert (
        await page.locator(by_testid("agent-bar", agent_ref="root"))
        .locator(".seg.phase-stopped")
        .count()
        == 1
    )

    # The recoverable page finds it by search, and shows its preview.
    await page.click(by_testid("nav-recoverable"))
    row = await wait_for(page, by_testid("recoverable-row", session_id=session_id))
    assert "side effects" in (await row.text_content())
    await page.fill(by_testid("recoverable-search"), "no such goal")
    await wait_for(page, by_testid("recoverable-empty"))
    await page.fill(by_testid("recoverable-search"), "SIX lines")
    await wait_for(page, by_testid("recoverable-row", session_id=session_id))
    await page.click(
        f"{by_testid('recoverable-row', session_id=session_id)} {by_testid('recoverable-resume')}"
    )
    await wait_for(page, by_testid("resume-preview", session_id=session_id))
    await page.click(by_testid("resume-back"))
    await wait_for(page, by_testid("resume-preview"), state="hidden")

    # Resume from the session's own page, after the same preview.
    await page.click(f"{by_testid('recoverable-row', session_id=session_id)} a")
    await wait_for(page, by_testid("session-status", status="recoverable"))
    await page.click(by_testid("session-resume"))
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
    done = await wait_for(page, by_testid("agent-node", agent_ref="root", phase="completed"))
    assert await done.get_attribute("data-resuming") == "false"
    assert await page.locator(by_testid("agent-resuming-badge")).count() == 0
    assert await page.locator(by_testid("session-resume")).count() == 0
    await wait_for(page, by_testid("recoverable-count"), state="hidden")
    # The agent timeline keeps the time the session stood stopped, and the resume.
    bar = page.locator(by_testid("agent-bar", agent_ref="root"))
    assert await bar.locator(".seg.phase-stopped").count() == 1
    events = await anyio.to_thread.run_sync(session_events, mesh, session_id)
    action = next(i for i, e in enumerate(events) if e["kind"] == "OperatorAction")
    recovered = next(e for e in events if e["kind"] == "SessionRecovered")
    stopped_segment = bar.locator(".seg.phase-stopped")
    assert float(await stopped_segment.get_attribute("data-from")) == events[action - 1]["ts"]
    assert float(await stopped_segment.get_attribute("data-until")) == recovered["ts"]
    assert await bar.locator(by_testid("agent-bar-resume")).count() == 1
    await page.screenshot(path=str(SHOTS / "console-e2e-resumed.png"), full_page=True)

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
