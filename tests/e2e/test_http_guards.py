"""What keeps other web pages, other local processes and stale credentials out of the HTTP API, on
real daemons: a cross-site page in headless Chromium (a ``text/plain`` form and a ``no-cors``
fetch, from another port and from a page the browser treats as public) starts nothing, whether
the daemon asks for tokens (its default, on loopback too) or was told not to; writes that are not
JSON get 415, a foreign ``Host`` 400, a foreign ``Origin`` 403; ``X-Forwarded-For`` does not
escape rate limiting and a valid token works while its address is limited; concurrent ``apomesh
tokens`` processes lose no revocation; a revoked token's event stream ends with an error frame;
deeply nested bodies and definitions are refused with typed errors; and the command line works
against a default daemon with the token it finds in the data dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.browser import CHROMIUM, CHROMIUM_ARGS
from tests.e2e.api_support import ECHO, bearer, start, start_mesh, stop_mesh

from apomesh.api.tokens import TokenStore
from apomesh.testing import DaemonProcess, Mesh

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def guarded() -> Iterator[Mesh]:
    """A daemon left at its defaults: auth on, on loopback. No workers: nothing needs to run."""
    yield from _mesh("guarded", auth=None)


@pytest.fixture(scope="module")
def open_daemon() -> Iterator[Mesh]:
    """A daemon told not to ask for tokens (``[http] auth = "off"``): the browser guards stand
    on their own."""
    yield from _mesh("open", auth=False)


def _mesh(name: str, *, auth: bool | None) -> Iterator[Mesh]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"guards-{name}-") as tmp:
        system = start_mesh(Path(tmp), workers=0, auth=auth)
        try:
            yield system
        finally:
            stop_mesh(system)


def goals(mesh: Mesh) -> list[str]:
    response = httpx.get(
        f"{mesh.url}/v1/sessions", headers=bearer(mesh.daemon.token if mesh.daemon.auth else None)
    )
    assert response.status_code == 200, response.text
    return [s["goal"] for s in response.json()["sessions"]]


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) >= {"error", "message"}, body
    return str(body["error"])


# --- a cross-site page in a real browser ------------------------------------------------------


class AttackerSite:
    """Another origin on this machine (an HTTP server on another port) serving attack pages."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}
        pages = self.pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pages.get(self.path, "not found").encode()
                self.send_response(200 if self.path in pages else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def attacker() -> Iterator[AttackerSite]:
    site = AttackerSite()
    try:
        yield site
    finally:
        site.close()


def form_page(target: str, goal: str) -> str:
    # A text/plain form sends `name=value`: this one sends {"goal": "<goal>="}, valid JSON.
    name = '{"goal": "' + goal
    return (
        "<!doctype html><html><body>"
        f"<form id='f' method='post' enctype='text/plain' action='{target}/v1/sessions'>"
        f"<input type='hidden' name='{name}' value='\"}}'></form>"
        "<script>document.getElementById('f').submit()</script></body></html>"
    )


def fetch_page(target: str, goal: str) -> str:
    body = json.dumps({"goal": goal})
    return (
        "<!doctype html><html><body><script>"
        f"window.attack = fetch('{target}/v1/sessions', {{method: 'POST', mode: 'no-cors',"
        f" headers: {{'Content-Type': 'text/plain'}}, body: {json.dumps(body)}}})"
        ".then(() => 'sent', (e) => 'error: ' + e);"
        "</script></body></html>"
    )


@pytest.mark.parametrize("space", ["local", "public"])
@pytest.mark.parametrize("daemon", ["guarded", "open_daemon"])
async def test_a_cross_site_page_starts_no_session(
    request: pytest.FixtureRequest, attacker: AttackerSite, daemon: str, space: str
) -> None:
    from playwright.async_api import async_playwright

    mesh: Mesh = request.getfixturevalue(daemon)
    form_goal, fetch_goal = f"pwned by a {space} form", f"pwned by a {space} fetch"
    attacker.pages["/form"] = form_page(mesh.url, form_goal)
    attacker.pages["/fetch"] = fetch_page(mesh.url, fetch_goal)
    args = list(CHROMIUM_ARGS)
    if space == "public":
        # Chromium then treats the attacker's pages as served from the public internet.
        args.append(f"--ip-address-space-overrides=127.0.0.1:{attacker.port}=public")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=args, headless=True
        )
        try:
            page = await browser.new_page()
            await page.goto(f"{attacker.url}/fetch")
            outcome = await page.evaluate("window.attack")
            if space == "local":
                # The request left the browser (its answer is opaque to the page). From a
                # public page Chromium may refuse the fetch itself; the form still goes.
                assert outcome == "sent", outcome
            async with page.expect_navigation(url=f"{mesh.url}/v1/sessions"):
                await page.goto(f"{attacker.url}/form")
            answer = json.loads(await page.inner_text("body"))
            assert "error" in answer, f"the form was accepted: {answer}"
            assert answer["error"] in ("cross_origin", "unsupported_media_type", "unauthorized")
        finally:
            await browser.close()
    started = goals(mesh)
    assert not [g for g in started if g.startswith((form_goal, fetch_goal))], started


# --- the same checks without a browser ----------------------------------------------------------


def test_a_write_that_is_not_json_is_415_with_a_typed_error(
    open_daemon: Mesh, guarded: Mesh
) -> None:
    payload = json.dumps({"goal": "not json, says the header"})
    for mesh in (open_daemon, guarded):
        headers = bearer(mesh.daemon.token if mesh.daemon.auth else None)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            sent = {**headers, **({"Content-Type": content_type} if content_type else {})}
            response = httpx.post(f"{mesh.url}/v1/sessions", content=payload, headers=sent)
            assert response.status_code == 415, (content_type, response.text)
            assert error_of(response) == "unsupported_media_type"
        response = httpx.delete(f"{mesh.url}/v1/skills/some-skill", headers=headers)
        assert response.status_code == 415 and error_of(response) == "unsupported_media_type"
    assert "not json, says the header" not in goals(open_daemon) + goals(guarded)


def test_a_foreign_host_header_is_400(open_daemon: Mesh) -> None:
    for host in ("evil.example", "evil.example:80", f"rebound.example:{open_daemon.daemon.port}"):
        response = httpx.get(f"{open_daemon.url}/v1/sessions", headers={"Host": host})
        assert response.status_code == 400, host
        assert error_of(response) == "invalid_host"
    for host in ("127.0.0.1", "localhost", f"localhost:{open_daemon.daemon.port}"):
        response = httpx.get(f"{open_daemon.url}/v1/sessions", headers={"Host": host})
        assert response.status_code == 200, host


def test_a_cross_site_origin_is_403_and_the_console_s_own_origin_works(open_daemon: Mesh) -> None:
    url = open_daemon.url
    refused = [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": f"http://127.0.0.1:{open_daemon.daemon.port + 1}"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ]
    for headers in refused:
        response = httpx.post(
            f"{url}/v1/sessions", json={"goal": "from elsewhere"}, headers=headers
        )
        assert response.status_code == 403, headers
        assert error_of(response) == "cross_origin"
    assert "from elsewhere" not in goals(open_daemon)
    same = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    response = httpx.post(f"{url}/v1/sessions", json={"goal": "from the console"}, headers=same)
    assert response.status_code == 201, response.text


def test_without_a_token_a_default_loopback_daemon_answers_401(guarded: Mesh) -> None:
    response = httpx.get(f"{guarded.url}/v1/sessions")
    assert response.status_code == 401 and error_of(response) == "unauthorized"
    response = httpx.post(f"{guarded.url}/v1/sessions", json={"goal": "anonymous"})
    assert response.status_code == 401
    token_file = guarded.daemon.data_dir / "http.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert httpx.get(f"{guarded.url}/v1/sessions", headers=bearer(guarded.daemon.token)).is_success
    assert httpx.get(f"{guarded.url}/healthz").status_code == 200


# --- bodies nested too deep -----------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_deeply_nested_body_is_a_typed_400_not_a_500(guarded: Mesh) -> None:
    headers = {**bearer(guarded.daemon.token), "Content-Type": "application/json"}
    body = '{"goal": "deep", "definition": {"name": "x", "model": {"extra": ' + nested(1000) + "}}}"
    for path in ("/v1/sessions", "/v1/agents"):
        response = httpx.post(f"{guarded.url}{path}", content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert error_of(response) == "invalid_body"


def test_a_definition_nested_past_the_limit_is_refused_at_submit(guarded: Mesh) -> None:
    headers = {**bearer(guarded.daemon.token), "Content-Type": "application/json"}
    for depth in (40, 960):
        # Written out by hand: Python's own json module recurses too deep for 960 levels.
        definition = json.dumps({**ECHO, "model": {**ECHO["model"], "extra": "DEEP"}})
        definition = definition.replace('"DEEP"', nested(depth))
        body = '{"goal": "deep definition", "definition": ' + definition + "}"
        response = httpx.post(f"{guarded.url}/v1/sessions", content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert error_of(response) in ("invalid_definition", "invalid_body")
    assert "deep definition" not in goals(guarded)
    # A sane definition still starts.
    start(guarded.url, "shallow definition", ECHO, token=guarded.daemon.token)


# --- tokens: the command line, concurrent changes, revocation of a stream ------------------------


def apomesh(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    run_env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", **(env or {})}
    for name in ("APOMESH_URL", "APOMESH_TOKEN"):
        if env is None or name not in env:
            run_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=run_env,
        cwd=cwd,
    )


def test_the_command_line_finds_the_token_of_a_default_local_daemon(
    tmp_path: Path, guarded: Mesh
) -> None:
    # A daemon started with no flags keeps its data in ./.apomesh: the command line run from the
    # same directory, with no flags, finds its first token there.
    daemon = DaemonProcess([guarded.nats_url], tmp_path / ".apomesh", auth=None)
    daemon.start()
    try:
        env = {"APOMESH_URL": daemon.url}
        started = apomesh("run", "a goal from the command line", env=env, cwd=tmp_path)
        assert started.returncode == 0, started.stderr
        listed = apomesh("sessions", "list", env=env, cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert "a goal from the command line" in listed.stdout
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        refused = apomesh("sessions", "list", env=env, cwd=elsewhere)
        assert refused.returncode == 1 and "UnauthorizedError" in refused.stderr
        found = apomesh(
            "sessions", "list", "--data", str(tmp_path / ".apomesh"), env=env, cwd=elsewhere
        )
        assert found.returncode == 0, found.stderr
        by_env = apomesh(
            "sessions", "list", env={**env, "APOMESH_TOKEN": daemon.token}, cwd=elsewhere
        )
        assert by_env.returncode == 0, by_env.stderr
    finally:
        daemon.stop()


def test_concurrent_token_revocations_all_stay_revoked(tmp_path: Path) -> None:
    store = TokenStore.in_dir(tmp_path)
    ids = [store.create("read", f"t{i}")[0] for i in range(40)]
    revoked, kept = ids[:30], ids[30:]
    data = ["--data", str(tmp_path)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "apomesh", "tokens", "revoke", token_id, *data],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for token_id in revoked
    ] + [
        subprocess.Popen(
            [sys.executable, "-m", "apomesh", "tokens", "create", "--name", f"new{i}", *data],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for i in range(10)
    ]
    for proc in procs:
        assert proc.wait(120) == 0, proc.stderr.read() if proc.stderr else ""
    left = {t.id: t.name for t in TokenStore.in_dir(tmp_path).list()}
    assert not set(revoked) & set(left), "a revoked token came back"
    assert set(kept) <= set(left)
    assert sorted(n for n in left.values() if n.startswith("new")) == [f"new{i}" for i in range(10)]
    assert (tmp_path / "tokens.json").stat().st_mode & 0o777 == 0o600


def test_a_revoked_token_loses_the_event_stream_it_opened(guarded: Mesh) -> None:
    data = ["--data", str(guarded.daemon.data_dir)]
    made = apomesh("tokens", "create", "--role", "read", "--name", "stream-reader", *data)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip().splitlines()[-1]
    token_id = secret.split("_")[1]
    # No worker: the session stays open, so only a revocation can end its stream.
    session_id = start(guarded.url, "a stream to lose", ECHO, token=guarded.daemon.token)
    lines: list[str] = []
    deadline = time.monotonic() + 30
    with (
        httpx.Client(timeout=httpx.Timeout(10)) as client,
        client.stream(
            "GET", f"{guarded.url}/v1/sessions/{session_id}/events", headers=bearer(secret)
        ) as response,
    ):
        assert response.status_code == 200
        revoked = False
        for line in response.iter_lines():
            lines.append(line)
            if not revoked and line.startswith("id: 0"):
                revoke = apomesh("tokens", "revoke", token_id, *data)
                assert revoke.returncode == 0, revoke.stderr
                revoked = True
            if (line.startswith("data:") and "unauthorized" in line) or time.monotonic() > deadline:
                break
    assert "event: error" in lines, lines[-5:]
    error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
    assert error["error"] == "unauthorized"
    refused = httpx.get(f"{guarded.url}/v1/sessions/{session_id}", headers=bearer(secret))
    assert refused.status_code == 401


# --- rate limiting (last: it leaves 127.0.0.1 with recent failures) -------------------------------


def test_forwarded_for_does_not_escape_rate_limiting_and_a_valid_token_still_works(
    guarded: Mesh,
) -> None:
    statuses = []
    with httpx.Client() as client:
        for attempt in range(30):
            headers = {
                "Authorization": f"Bearer apm_guess{attempt}_nope",
                "X-Forwarded-For": f"198.51.100.{attempt}",
                "X-Real-IP": f"198.51.100.{attempt}",
            }
            statuses.append(client.get(f"{guarded.url}/v1/sessions", headers=headers).status_code)
        assert statuses[0] == 401 and 429 in statuses, statuses
        assert all(status == 429 for status in statuses[statuses.index(429) :])
        valid = client.get(f"{guarded.url}/v1/sessions", headers=bearer(guarded.daemon.token))
        assert valid.status_code == 200, valid.text


def test_forwarded_for_counts_only_from_a_configured_proxy(tmp_path: Path, guarded: Mesh) -> None:
    # Behind a proxy listed in [http] trusted_proxies, each forwarded address is limited on its
    # own: one client's failures do not lock out the others behind the same proxy.
    daemon = DaemonProcess(
        [guarded.nats_url],
        tmp_path / "proxied",
        auth=True,
        env={"APOMESH_HTTP_TRUSTED_PROXIES": "127.0.0.1"},
    )
    daemon.start()
    try:
        with httpx.Client() as client:
            for _ in range(12):
                headers = {"Authorization": "Bearer apm_x_nope", "X-Forwarded-For": "203.0.113.7"}
                last = client.get(f"{daemon.url}/v1/sessions", headers=headers).status_code
            assert last == 429
            other = {"Authorization": "Bearer apm_x_nope", "X-Forwarded-For": "203.0.113.8"}
            assert client.get(f"{daemon.url}/v1/sessions", headers=other).status_code == 401
    finally:
        daemon.stop()
