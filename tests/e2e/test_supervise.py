"""``apomesh serve --supervise`` on real processes: the daemon runs in a child of the supervisor;
that child SIGKILLed is forked again at once (warm: nothing imported again), the session it ran is
listed for the operator and, resumed, writes every line exactly once; SIGTERM to the supervisor
stops the daemon as a plain ``serve`` stops, with exit code 0, and leaves no child behind.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from tests.e2e.chaos_kit import appender, check_session
from tests.e2e.test_operator_recovery import finished, wait_for

from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess


def daemon_pid(data_dir: Path) -> int | None:
    """The pid the data dir's lock names: the supervised daemon's, not the supervisor's."""
    text = (data_dir / "daemon.lock").read_text().strip()
    return int(text) if text else None


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.anyio
async def test_a_supervised_daemon_killed_is_forked_again_and_its_session_finishes_exactly_once(
    tmp_path: Path,
) -> None:
    daemon = DaemonProcess([], tmp_path / "daemon", workers=2, extra_args=("--supervise",))
    await anyio.to_thread.run_sync(daemon.start)
    supervisor = daemon.proc.pid
    try:
        first = daemon_pid(daemon.data_dir)
        assert first is not None and first != supervisor
        async with Client(daemon.url) as client:
            session_id = await client.start_session("supervised", definition=appender(8, 0.3))

            async def made_effects() -> bool:
                view = await client.get_session(session_id)
                assert not view.terminal
                return view.side_effects >= 2

            await wait_for(made_effects, "the session made side effects")
        os.kill(first, signal.SIGKILL)

        async def forked_again() -> int | None:
            pid = daemon_pid(daemon.data_dir)
            return pid if pid not in (None, first) else None

        second = await wait_for(forked_again, "the supervisor forked a new daemon")
        await anyio.to_thread.run_sync(daemon.wait_ready)
        assert daemon.proc.poll() is None and not running(first)
        async with Client(daemon.url) as client:
            # A crash with side effects logged: the session waits for an operator, as ever.
            assert {r.session_id for r in await client.list_recoverable()} == {session_id}
            await client.resume(session_id)
            records = await finished(client, session_id)
            check = check_session(
                records, await client.verify_session(session_id), daemon.workspace
            )
            assert check.ok, check.problems
        assert f"the daemon (pid {first}) died of SIGKILL; forking a new one" in (
            daemon.output_tail()
        )
    finally:
        await anyio.to_thread.run_sync(daemon.stop)
    assert daemon.proc.returncode == 0
    assert not running(second)


def test_a_supervised_daemon_that_cannot_start_says_why_and_is_not_forked_again(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    first = DaemonProcess([], tmp_path / "daemon", workers=0)
    first.start()
    try:
        # The data dir is the first daemon's: the second one's child stops with a typed error.
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "apomesh",
                "serve",
                "--supervise",
                "--data",
                str(first.data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        first.stop()
    assert second.returncode == 1
    assert "error (data_dir_in_use)" in second.stderr
    assert "forking a new one" not in second.stderr
