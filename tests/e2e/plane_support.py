"""What the configuration-plane and pinning tests share: installing the plugin packages they use,
running the ``apomesh`` command line, polling a daemon, building a plugin at another version, and
writing raw entries onto a session's log subject.

The packages (``plugins/apomesh-debate``, ``plugins/apomesh-skillpack`` and the test-only
``tests/e2e/pinprobe``, whose ``probe`` model provider records the instructions each model call
received) are installed editable into the running environment when missing, so the daemon and
worker processes of ``mesh`` load them through the ``apomesh`` entry-point group like any
installed plugin.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from apomesh.testing import install_plugin_package

REPO = Path(__file__).resolve().parents[2]
DEBATE_PROJECT = REPO / "plugins" / "apomesh-debate"
SKILLPACK_PROJECT = REPO / "plugins" / "apomesh-skillpack"
PROBE_PROJECT = Path(__file__).resolve().parent / "pinprobe"
DEBATE = "apomesh-debate"
TERMINAL = ("completed", "failed", "cancelled")


def install_test_plugins() -> None:
    for project in (DEBATE_PROJECT, SKILLPACK_PROJECT, PROBE_PROJECT):
        install_plugin_package(project)


def run_cli(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``apomesh ARGS --url URL`` as a user runs it; stdout and stderr captured as text."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "apomesh", *args, "--url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"apomesh {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it answers something true; answer it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def session_view(url: str, session_id: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    view: dict[str, Any] = response.json()
    return view


def wait_terminal(url: str, session_id: str, timeout: float = 60.0) -> dict[str, Any]:
    view: dict[str, Any] = wait_until(
        lambda: (v := session_view(url, session_id))["status"] in TERMINAL and v,
        timeout,
        f"the end of session {session_id}",
    )
    return view


def recoverable(url: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{url}/v1/recoverable")
    assert response.status_code == 200, response.text
    return {r["session_id"]: r for r in response.json()["sessions"]}


def events(url: str, session_id: str) -> list[dict[str, Any]]:
    """Every event of a session that has ended, from the SSE stream (which closes after the end)."""
    out: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{url}/v1/sessions/{session_id}/events", timeout=30.0) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
    return out


def probe_records(path: Path) -> list[dict[str, Any]]:
    """The model calls the ``probe`` provider recorded so far, in order."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def build_at_version(project: Path, version: str, into: Path) -> Path:
    """Build and install a copy of ``project`` at ``version`` into a directory of its own (not
    the environment), and answer that directory: a daemon started with it first on
    ``PYTHONPATH`` finds the plugin at ``version`` instead of the installed one."""
    source = into / f"src-{version}"
    shutil.copytree(
        project,
        source,
        ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"),
    )
    pyproject = source / "pyproject.toml"
    lines = pyproject.read_text(encoding="utf-8").splitlines(keepends=True)
    rewritten = [
        f'version = "{version}"\n' if line.startswith("version = ") else line for line in lines
    ]
    assert rewritten != lines, "the project has no `version = ...` line"
    pyproject.write_text("".join(rewritten), encoding="utf-8")
    site = into / f"site-{version}"
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
            "--no-build-isolation", "--target", str(site), str(source),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return site


def publish_raw(nats_url: str, session_id: str, entries: list[bytes]) -> None:
    """Append raw bytes to a session's log subject, as entries 0, 1, ... (with their message ids)."""

    async def publish() -> None:
        import nats

        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            for index, data in enumerate(entries):
                await js.publish(
                    f"apomesh.log.{session_id}",
                    data,
                    headers={"Nats-Msg-Id": f"{session_id}:{index}"},
                )
        finally:
            await nc.close()

    asyncio.run(publish())


def stored_count(nats_url: str, session_id: str) -> int:
    """How many events a session's log holds (an append's events share one message)."""

    async def count() -> int:
        import nats

        from apomesh.adapters.jetstream_log import JetStreamLog

        nc = await nats.connect(nats_url)
        try:
            return len(await JetStreamLog(nc, ensure_heartbeats=False).read_raw(session_id))
        finally:
            await nc.close()

    return asyncio.run(count())
