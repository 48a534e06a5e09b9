"""The Python API on real processes: the README's script killed with SIGKILL and rerun, a changed
tool set stranded by its pin, an unknown outcome a ``hold`` tool leaves for the person, and
docs/python.md's example run as a script and served to a fleet.

The README's script is run exactly as the README has it, as a script of its own (its embedded
nats-server, daemon and workers in its process). Its kill points are exact, not raced: the
greetings file starts as a named pipe, so the script's ``send`` blocks opening it, after the call's
intent is on the log and before its effect, until the test kills the script (the kernel shows
the wait in ``/proc/<pid>/wchan``). The next run is killed right after an effect, before or after
its result is on the log, and the last one completes: each greeting is in the file once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from apomesh.adapters.natsserver import NatsServer
from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess, WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
README_SCRIPT = "greet.py"
GREETINGS = "sent.txt"
DONE = "hello ada\nhello alan\n"


def python_block(path: Path, heading: str) -> str:
    """The first ```python block after the line ``heading`` in the markdown file ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    opening = next(i for i in range(start, len(lines)) if lines[i] == "```python")
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i] == "```")
    return "\n".join(lines[opening + 1 : closing]) + "\n"


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"{what} within {timeout} s")


class Script:
    """A Python script in its own directory, run as ``python NAME`` there."""

    def __init__(self, directory: Path, name: str, text: str) -> None:
        self.directory = directory
        self.path = directory / name
        self.path.write_text(text, encoding="utf-8")
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        self.runs += 1
        out = (self.directory / f"run{self.runs}.out").open("wb")
        err = (self.directory / f"run{self.runs}.err").open("wb")
        # faulthandler: a run that outlives its timeout is ended with SIGABRT, which prints
        # every thread's stack to its stderr, so a hang says where it is.
        self.proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", self.path.name, *args],
            cwd=self.directory,
            stdout=out,
            stderr=err,
        )
        return self.proc

    def output(self) -> tuple[str, str]:
        return (
            (self.directory / f"run{self.runs}.out").read_text(),
            (self.directory / f"run{self.runs}.err").read_text(),
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None and self.alive(), f"the script ended: {self.output()}"
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def run_to_end(self, *args: str, timeout: float = 120.0) -> tuple[int, str, str]:
        """Run the script with ``args`` to its end; one still running after ``timeout`` fails
        the test with the stacks of its threads."""
        proc = self.start(*args)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            raise AssertionError(
                f"the script {' '.join([self.path.name, *args])} did not end within"
                f" {timeout:g} s; its output: {self.output()}"
            ) from None
        return (proc.returncode, *self.output())

    def blocked_on_pipe(self) -> bool:
        """True while the script waits inside ``open`` of a named pipe nobody reads."""
        assert self.proc is not None
        if not self.alive():
            raise AssertionError(f"the script ended: {self.output()}")
        return Path(f"/proc/{self.proc.pid}/wchan").read_text() == "wait_for_partner"

    def close(self) -> None:
        if self.alive():
            self.kill()


@pytest.fixture
def readme_script(tmp_path: Path) -> Iterator[Script]:
    script = Script(
        tmp_path, README_SCRIPT, python_block(ROOT / "README.md", "## Agents and tools in Python")
    )
    try:
        yield script
    finally:
        script.close()


def kill_inside_first_send(script: Script) -> None:
    """Run the script until its first ``send`` has its intent logged and blocks before its
    effect; SIGKILL it there."""
    greetings = script.directory / GREETINGS
    os.mkfifo(greetings)
    script.start()
    wait_until(script.blocked_on_pipe, "the first send blocked on the greetings pipe")
    script.kill()
    greetings.unlink()
    assert script.output()[0] == "", "the killed run printed an output"


def test_readme_script_survives_kill_9_after_an_intent_and_after_an_effect(
    readme_script: Script,
) -> None:
    greetings = readme_script.directory / GREETINGS
    # Killed after the intent of `send(ada)`, before its effect.
    kill_inside_first_send(readme_script)
    assert not greetings.exists()
    # The rerun resumes the session: the probe finds ada not greeted, so it runs; killed just
    # after that effect (its result on the log or not).
    readme_script.start()
    wait_until(lambda: greetings.exists() and "hello ada" in greetings.read_text(), "ada greeted")
    readme_script.kill()
    assert readme_script.output()[0] == ""
    # The last run completes the same session: no greeting twice, none missing.
    code, out, err = readme_script.run_to_end()
    assert code == 0, err
    assert out == "greeted both\n"
    assert greetings.read_text() == DONE
    # Run again, the finished session answers its output and sends nothing.
    code, out, err = readme_script.run_to_end()
    assert (code, out) == (0, "greeted both\n"), err
    assert greetings.read_text() == DONE


def test_a_changed_tool_set_strands_the_session_until_it_is_restored(
    readme_script: Script,
) -> None:
    greetings = readme_script.directory / GREETINGS
    kill_inside_first_send(readme_script)
    original = readme_script.path.read_text()
    changed = original.replace('    return "sent"\n', '    return "delivered"\n')
    assert changed != original
    readme_script.path.write_text(changed)
    code, out, err = readme_script.run_to_end()
    assert code != 0 and out == ""
    assert "PluginPinMismatch" in err and "python:__main__" in err, err
    assert "other Python tools" in err
    assert not greetings.exists()
    readme_script.path.write_text(original)
    code, out, err = readme_script.run_to_end()
    assert (code, out) == (0, "greeted both\n"), err
    assert greetings.read_text() == DONE


@pytest.fixture
def notes_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """docs/python.md's example as ``notes.py`` in a directory of its own, importable."""
    text = python_block(ROOT / "docs" / "python.md", "## A runnable example")
    (tmp_path / "notes.py").write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("notes", None)


def test_the_docs_example_runs_as_a_script(notes_dir: Path) -> None:
    script = Script(notes_dir, "notes.py", (notes_dir / "notes.py").read_text())
    code, out, err = script.run_to_end()
    assert (code, out) == (0, "kept two notes\n"), err
    # The session's own workspace: <data dir>/workspace/<session id>/notes.
    kept = sorted(p.read_text() for p in (notes_dir / ".apomesh/notes/workspace").glob("*/notes/*"))
    assert kept == ["[home] buy milk", "[misc] call ada"]


def test_the_docs_tools_serve_a_fleet_pinned_by_module_and_digest(
    notes_dir: Path, nats_server: NatsServer
) -> None:
    import notes  # type: ignore[import-not-found]

    from apomesh.plugins.python_tools import tool_sets

    env = {"PYTHONPATH": str(notes_dir)}
    daemon = DaemonProcess(
        [nats_server.url], notes_dir / "daemon", env=env, extra_args=("--tools", "notes:tools")
    )
    worker = WorkerProcess(
        [nats_server.url],
        notes_dir / "fleet",
        "py-tools",
        env=env,
        extra_args=("--tools", "notes:tools"),
    )
    daemon.start()
    worker.start()
    try:

        async def run() -> tuple[Any, Any]:
            async with Client(daemon.url) as client:
                session_id = await client.start_session(
                    "note two", definition=notes.agent.definition()
                )
                view = await client.wait(session_id, timeout=60)
                started = [r async for r in client.events(session_id) if r.kind == "SessionStarted"]
                return view, started

        view, started = anyio.run(run)
    finally:
        worker.stop()
        daemon.stop()
    assert (view.status, view.output) == ("completed", "kept two notes"), daemon.output_tail()
    kept = sorted(p.read_text() for p in (notes_dir / "fleet").glob("*/notes/*"))  # per session
    assert kept == ["[home] buy milk", "[misc] call ada"]
    (tool_set,) = tool_sets(notes.tools)
    pins = started[0].event["shape"]["plugins"]
    assert {"name": "python:notes", "version": tool_set.apomesh_plugin_version} in pins


HOLD_SCRIPT = """
import asyncio
import sys
from pathlib import Path

import apomesh


@apomesh.tool(side_effect=True, on_unknown="hold")
async def charge(amount: int) -> str:
    with Path("charges.txt").open("a") as out:
        out.write(f"{amount}\\n")
    return "charged"


agent = apomesh.Agent("biller", tools=[charge], model={"provider": "scripted", "turns": [
    {"tool_calls": [{"tool": "charge", "args": {"amount": 5}}]}, {"final": "billed"}]})


async def main() -> None:
    async with apomesh.local() as mesh:
        try:
            print(await mesh.run(agent, "bill 5"))
        except apomesh.SessionNotCompleted as exc:
            if sys.argv[1:] != ["resume"]:
                raise
            await mesh.resume(exc.session_id)
            print(await mesh.wait(exc.session_id))


asyncio.run(main())
"""


def test_an_unknown_outcome_held_without_a_probe_waits_for_the_person(tmp_path: Path) -> None:
    script = Script(tmp_path, "bill.py", HOLD_SCRIPT)
    charges = tmp_path / "charges.txt"
    os.mkfifo(charges)
    script.start()
    try:
        wait_until(script.blocked_on_pipe, "the charge blocked on the charges pipe")
        script.kill()
    finally:
        script.close()
    charges.unlink()
    # The rerun does not resume past the lost outcome of a `hold` tool by itself.
    code, out, err = script.run_to_end()
    assert code != 0 and out == ""
    assert "SessionNotCompleted" in err and "holds unknown outcomes for you to decide" in err, err
    assert "charge by root" in err
    # The person looked (nothing was charged) and resumes past it: the call is not run again.
    code, out, err = script.run_to_end("resume")
    assert (code, out) == (0, "billed\n"), err
    assert not charges.exists()
