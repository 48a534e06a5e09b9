"""The operator console in a real headless Chromium (Playwright), served by uvicorn over the fake
daemon: sessions list and search, a session's spawn tree updating live over SSE (resumes marked),
answering a HITL pause, resuming a recoverable session after its preview, workers, and the token
prompt when auth is on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.browser import by_testid, wait_for
from tests.fakes.fake_service import FakeService, serving

from apomesh.api.app import create_app
from apomesh.api.auth import AuthSettings
from apomesh.api.tokens import TokenStore
from apomesh.core.events import AgentResumed, AgentResuming
from apomesh.core.views import PinDiff

pytestmark = pytest.mark.anyio


async def test_sessions_are_listed_searched_and_followed_live(page: Any) -> None:
    fake = FakeService()
    haiku = await fake.start("write a haiku")
    minutes = await fake.start("summarise the minutes")
    await fake.end(minutes)
    async with serving(create_app(fake, auth=AuthSettings.off())) as url:
        await page.goto(f"{url}/")
        await wait_for(page, by_testid("session-row", session_id=haiku, status="running"))
        await wait_for(page, by_testid("session-row", session_id=minutes, status="completed"))
        await page.fill(by_testid("session-search"), "haiku")
        await wait_for(page, by_testid("session-row", session_id=minutes), state="detached")
        assert await page.locator(by_testid("session-row")).count() == 1
        await page.fill(by_testid("session-search"), "")
        await page.select_option(by_testid("session-filter-status"), "completed")
        await wait_for(page, by_testid("session-row", session_id=haiku), state="detached")
        await page.select_option(by_testid("session-filter-status"), "")

        await page.click(
            f"{by_testid('session-row', session_id=haiku)} {by_testid('session-link')}"
        )
        await wait_for(page, by_testid("session-page", session_id=haiku))
        await wait_for(page, by_testid("agent-node", agent_ref="root", phase="running"))
        await wait_for(page, by_testid("stream-state", state="live"))
        assert await page.text_content(by_testid("session-goal")) == "write a haiku"

        # The tree follows the log as it grows.
        await fake.spawn(haiku, "root/0", "root", "first line")
        await fake.spawn(haiku, "root/1", "root", "second line")
        await fake.phase(haiku, "root/0", "running", worker="w2", epoch=1)
        child = await wait_for(page, by_testid("agent-node", agent_ref="root/0", phase="running"))
        assert "first line" in (await child.text_content())
        await wait_for(
            page,
            f"{by_testid('agent-node', agent_ref='root')} {by_testid('agent-node', agent_ref='root/1')}",
        )

        # A resume is marked on the agent and in the timeline.
        await fake.emit(haiku, AgentResuming(agent="root/0", reason="worker w2 lost", epoch=2))
        resuming = await wait_for(
            page, by_testid("agent-node", agent_ref="root/0", resuming="true")
        )
        assert await resuming.query_selector(by_testid("agent-resuming-badge")) is not None
        item = await wait_for(page, by_testid("timeline-item", kind="AgentResuming"))
        assert "resume" in (await item.get_attribute("class"))
        assert "worker w2 lost" in (await item.text_content())
        await fake.emit(haiku, AgentResumed(agent="root/0", epoch=2))
        resumed = await wait_for(
            page, by_testid("agent-node", agent_ref="root/0", resuming="false")
        )
        assert "resumes: 1" in (await resumed.text_content())
        await wait_for(page, by_testid("timeline-item", kind="AgentResumed"))

        await fake.end(haiku, output="an old silent pond")
        await wait_for(page, by_testid("session-status", status="completed"))
        await wait_for(page, by_testid("stream-state", state="ended"))
        assert await page.text_content(by_testid("session-output")) == "an old silent pond"
        indexes = await page.eval_on_selector_all(
            by_testid("timeline-item"), "items => items.map(i => Number(i.dataset.index))"
        )
        assert indexes == list(range(len(indexes))) and len(indexes) == 9
        await page.screenshot(
            path=str(Path(os.environ.get("APOMESH_SHOTS", "/tmp")) / "console-session.png")
        )


async def test_a_pause_is_answered_through_the_form(page: Any) -> None:
    fake = FakeService()
    session_id = await fake.start("write a letter")
    pause_id = await fake.pause(session_id, "root", "Formal or casual?")
    async with serving(create_app(fake, auth=AuthSettings.off())) as url:
        await page.goto(f"{url}/#/sessions/{session_id}")
        pause = await wait_for(page, by_testid("hitl-pause", pause_id=pause_id))
        assert await (await pause.query_selector(by_testid("hitl-question"))).text_content() == (
            "Formal or casual?"
        )
        await wait_for(page, by_testid("session-status", status="paused"))
        await page.click(
            f"{by_testid('hitl-pause', pause_id=pause_id)} {by_testid('hitl-answer-submit')}"
        )
        await wait_for(page, f'{by_testid("hitl-error")}:has-text("Write an answer first.")')
        await page.fill(by_testid("hitl-answer-input"), "Casual, but kind.")
        await page.click(by_testid("hitl-answer-submit"))
        await wait_for(page, by_testid("hitl-pause", pause_id=pause_id), state="detached")
        await wait_for(page, by_testid("timeline-item", kind="HitlAnswered"))
        await wait_for(page, by_testid("session-status", status="running"))
    assert ("answer_hitl", session_id, pause_id, "Casual, but kind.", "operator") in fake.calls


async def test_a_recoverable_session_is_resumed_after_its_preview(page: Any) -> None:
    fake = FakeService()
    session_id = await fake.start("send the invoices")
    await fake.side_effect(
        session_id, "root", "fs.append", {"path": "sent.log", "line": "inv-7"}, recorded=False
    )
    fake.make_recoverable(session_id, pin_diff=[PinDiff(name="apomesh-mail", old="1.0", new="1.2")])
    async with serving(create_app(fake, auth=AuthSettings.off())) as url:
        await page.goto(f"{url}/#/recoverable")
        row = await wait_for(page, by_testid("recoverable-row", session_id=session_id))
        assert "side effects logged" in (await row.text_content())
        await wait_for(page, f'{by_testid("recoverable-count")}:has-text("1")')
        await page.click(
            f"{by_testid('recoverable-row', session_id=session_id)} {by_testid('recoverable-resume')}"
        )
        preview = await wait_for(page, by_testid("resume-preview", session_id=session_id))
        unknown = await preview.query_selector(by_testid("preview-unknown-outcome"))
        assert "fs.append" in (await unknown.text_content())
        assert "inv-7" in (await unknown.text_content())
        pin = await preview.query_selector(by_testid("preview-pin-diff", plugin="apomesh-mail"))
        assert [c.strip() for c in (await pin.inner_text()).split("\t")] == [
            "apomesh-mail",
            "1.0",
            "1.2",
        ]
        assert not any(call[0] == "resume" for call in fake.calls)

        # Without migrating the pins the daemon refuses, and the console says why.
        await page.click(by_testid("resume-confirm"))
        await wait_for(page, f'{by_testid("resume-error")}:has-text("apomesh-mail")')
        await page.check(by_testid("resume-migrate-pins"))
        await page.click(by_testid("resume-confirm"))
        await wait_for(page, by_testid("session-page", session_id=session_id))
        await wait_for(page, by_testid("timeline-item", kind="SessionRecovered"))
        await page.screenshot(
            path=str(Path(os.environ.get("APOMESH_SHOTS", "/tmp")) / "console-resumed.png")
        )
        await page.goto(f"{url}/#/recoverable")
        await wait_for(page, by_testid("recoverable-empty"))
    assert ("resume", session_id, {"apomesh-mail": "1.2"}, "operator") in fake.calls


async def test_workers_are_shown(page: Any) -> None:
    fake = FakeService()
    fake.add_worker("w-1", "edge-1", ["s1/root"])
    fake.add_worker("w-2", "edge-2", [], alive=False, last_heartbeat=1.0)
    async with serving(create_app(fake, auth=AuthSettings.off())) as url:
        await page.goto(f"{url}/#/workers")
        alive = await wait_for(page, by_testid("worker-row", worker_id="w-1", alive="true"))
        assert "s1/root" in (await alive.text_content())
        assert "s ago" in (
            await (await alive.query_selector(by_testid("worker-heartbeat"))).text_content()
        )
        await wait_for(page, by_testid("worker-row", worker_id="w-2", alive="false"))


async def test_the_console_asks_for_a_token_and_streams_with_it(page: Any, tmp_path: Path) -> None:
    fake = FakeService()
    session_id = await fake.start("guarded work")
    tokens = TokenStore.in_dir(tmp_path)
    _, operator = tokens.create("operator", "alice")
    app = create_app(fake, auth=AuthSettings(enabled=True, token_store=tokens))
    async with serving(app) as url:
        await page.goto(f"{url}/")
        await wait_for(page, by_testid("token-dialog"))
        await page.fill(by_testid("token-input"), "apm_wrong_token")
        await page.click(by_testid("token-submit"))
        await wait_for(page, f'{by_testid("token-error")}:has-text("not accepted")')
        await page.fill(by_testid("token-input"), operator)
        await page.click(by_testid("token-submit"))
        await wait_for(page, by_testid("session-row", session_id=session_id))
        assert await page.evaluate("sessionStorage.getItem('apomesh.token')") == operator
        await page.click(by_testid("session-link"))
        await wait_for(page, by_testid("stream-state", state="live"))
        await fake.spawn(session_id, "root/0", "root", "guarded part")
        await wait_for(page, by_testid("agent-node", agent_ref="root/0"))
        await wait_for(page, by_testid("timeline-item", kind="AgentLifecycle", index="3"))
        # The token never travels in a URL.
        urls: list[str] = []
        page.on("request", lambda request: urls.append(request.url))
        await page.reload()
        await wait_for(page, by_testid("stream-state", state="live"))
        await anyio.sleep(0.2)
        assert urls and not any(operator in u for u in urls)
