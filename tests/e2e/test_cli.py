"""The ``apomesh`` command line as a user runs it: real ``apomesh`` processes against a real daemon,
its workers and nats-server. Help and usage errors, bad agent definitions refused with the field
named, ``run --follow`` showing the live tree, and ``sessions list|show|tail``; and what people and
scripts rely on: data printed verbatim (no markup read into goals or questions), ids whole in a
narrow pipe and on a narrow terminal, ``--output json`` on every listing, human times, events never
cut, ``--limit`` and cursors, ``workers list``, ``hitl list``, ``run --follow`` in a pipe showing a
pause's question and the command that answers it as it happens, and ``sessions cancel`` refusing
without a terminal to ask.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apomesh.cli import build_parser
from apomesh.sdk.client import SyncClient
from apomesh.testing import Mesh

DEFINITIONS = Path(__file__).parent / "definitions"


@pytest.fixture(scope="module")
def cli_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One system shared by the module's tests: nats-server, a daemon and one worker."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    base = tmp_path_factory.mktemp("cli-mesh")
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    system = Mesh(server, base)
    try:
        system.daemon.start()
        system.worker()
        system.wait_workers(1)
        yield system
    finally:
        system.close()
        server.stop()


def apomesh(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # Wide columns so rich neither wraps nor truncates what the assertions look for.
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
    env.pop("APOMESH_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def command_names() -> list[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    raise AssertionError("the parser has no commands")


# --- help and usage ------------------------------------------------------------------------------


def test_top_level_help_lists_every_command() -> None:
    result = apomesh("--help")
    assert result.returncode == 0, result.stderr
    for name in command_names():
        assert name in result.stdout


@pytest.mark.parametrize("command", command_names())
def test_every_command_has_help(command: str) -> None:
    result = apomesh(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: apomesh {command}")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((), id="no command"),
        pytest.param(("bogus",), id="unknown command"),
        pytest.param(("run",), id="run without a goal"),
        pytest.param(("sessions", "explode"), id="unknown sessions action"),
        pytest.param(("serve", "--workers", "many"), id="not a number"),
        pytest.param(("sessions", "show", "--url", "http://127.0.0.1:9"), id="show without an id"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    result = apomesh(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip()


# --- bad agent definitions -----------------------------------------------------------------------

BAD_FILES: list[tuple[str, dict[str, str], list[str]]] = [
    (
        "unknown key",
        {"agent.toml": 'name = "x"\n[budget]\nmax_stepz = 3\n'},
        ["agent.toml", "unknown field `max_stepz`", "$.budget"],
    ),
    (
        "unknown top-level key",
        {"agent.toml": 'name = "x"\ncoordinaton = "solo"\n'},
        ["agent.toml", "unknown field `coordinaton`"],
    ),
    (
        "wrong type",
        {"agent.toml": 'name = "x"\n[budget]\nmax_steps = "ten"\n'},
        ["agent.toml", "Expected `int | null`, got `str`", "$.budget.max_steps"],
    ),
    (
        "a turn with two kinds",
        {
            "agent.toml": 'name = "x"\n[model]\nturns = [{ final = "a" }, { final = "b", plan = ["c"] }]\n'
        },
        ["agent.toml $.model turn 1", "exactly one of `tool_calls`, `plan` or `final`"],
    ),
    (
        "a script turn with two kinds",
        {
            "agent.toml": 'name = "x"\n[model]\nscript = "x.script.toml"\n',
            "x.script.toml": '[[turns]]\nfinal = "a"\ntool_calls = [{ tool = "fs.list" }]\n',
        },
        ["x.script.toml turn 0", "exactly one of `tool_calls`, `plan` or `final`"],
    ),
    (
        "an unknown key in a script turn",
        {
            "agent.toml": 'name = "x"\n[model]\nscript = "x.script.toml"\n',
            "x.script.toml": '[[turns]]\nfinall = "a"\n',
        },
        ["x.script.toml", "unknown field `finall`"],
    ),
    (
        "a missing script file",
        {"agent.toml": 'name = "x"\n[model]\nscript = "nowhere.script.toml"\n'},
        ["agent.toml $.model.script", "'nowhere.script.toml' not found"],
    ),
    (
        "a missing role script file",
        {"agent.toml": 'name = "x"\n[roles.worker.model]\nscript = "gone.toml"\n'},
        ["agent.toml $.roles.worker.model.script", "'gone.toml' not found"],
    ),
    (
        "a TOML syntax error",
        {"agent.toml": 'name = "x\ntools = []\n'},
        ["agent.toml", "not valid TOML", "line 1"],
    ),
    (
        "a syntax error in the script",
        {
            "agent.toml": 'name = "x"\n[model]\nscript = "x.script.toml"\n',
            "x.script.toml": "[[turns]\n",
        },
        ["x.script.toml", "not valid TOML"],
    ),
    (
        "a missing name",
        {"agent.toml": 'coordination = "solo"\n'},
        ["agent.toml", "missing required field `name`"],
    ),
]


@pytest.mark.parametrize(
    ("files", "expected"), [(f, e) for _, f, e in BAD_FILES], ids=[c for c, _, _ in BAD_FILES]
)
def test_run_refuses_a_bad_definition_file(
    cli_mesh: Mesh, tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = httpx.get(f"{cli_mesh.url}/v1/sessions").json()["sessions"]
    result = apomesh(
        "run", "a goal", "--definition", str(tmp_path / "agent.toml"), "--url", cli_mesh.url
    )
    assert result.returncode == 1, result.stdout + result.stderr
    message = flat(result.stderr)
    assert "invalid_definition" in message
    for part in expected:
        assert part in message, message
    assert httpx.get(f"{cli_mesh.url}/v1/sessions").json()["sessions"] == before


def test_run_refuses_a_definition_file_that_does_not_exist(cli_mesh: Mesh, tmp_path: Path) -> None:
    result = apomesh(
        "run", "goal", "--definition", str(tmp_path / "absent.toml"), "--url", cli_mesh.url
    )
    assert result.returncode == 1
    assert "absent.toml" in flat(result.stderr)
    assert "not found" in flat(result.stderr)


@pytest.mark.parametrize(
    ("definition", "field"),
    [
        pytest.param(
            {"name": "x", "budget": {"max_steps": "ten"}}, "$.budget.max_steps", id="wrong type"
        ),
        pytest.param({"name": "x", "budgets": {}}, "budgets", id="unknown key"),
        pytest.param(
            {"name": "x", "model": {"turns": [{"final": "a", "plan": ["b"]}]}},
            "$.model turn 0",
            id="two kinds",
        ),
        pytest.param(
            {"name": "x", "roles": {"worker": {"tools": "fs.read"}}},
            "$.roles.worker",
            id="role type",
        ),
        pytest.param({"name": "x", "coordination": "swarm"}, "$.coordination", id="unknown kind"),
        pytest.param(
            {"name": "x", "coordination": "fanout", "coordination_params": {"max_parallel": 0}},
            "max_parallel",
            id="bad param",
        ),
        pytest.param(
            {"name": "x", "model": {"script": "a.toml"}}, "$.model", id="script not inlined"
        ),
    ],
)
def test_post_session_refuses_a_bad_inline_definition(
    cli_mesh: Mesh, definition: dict[str, object], field: str
) -> None:
    response = httpx.post(
        f"{cli_mesh.url}/v1/sessions", json={"goal": "g", "definition": definition}
    )
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["error"] == "invalid_definition"
    assert field in body["message"], body


# --- running and watching sessions ---------------------------------------------------------------


def test_run_follow_prints_the_live_tree_and_exits_0(cli_mesh: Mesh) -> None:
    result = apomesh(
        "run",
        "a three-part story",
        "--definition",
        str(DEFINITIONS / "fanout.toml"),
        "--follow",
        "--url",
        cli_mesh.url,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    session_id = lines[0].removeprefix("session ").strip()
    assert len(session_id) == 32
    assert any(line.startswith(session_id) and "completed" in line for line in lines)
    for ref in ("root", "root/0", "root/1", "root/2"):
        assert any(f"{ref} completed on " in line for line in lines), result.stdout
    assert lines[-1] == "completed: all parts written"


def test_run_follow_exits_1_when_the_session_fails(cli_mesh: Mesh) -> None:
    result = apomesh(
        "run",
        "spend",
        "--definition",
        str(DEFINITIONS / "budget.toml"),
        "--follow",
        "--url",
        cli_mesh.url,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith("failed:")
    assert "max_steps 2" in result.stdout


def test_run_without_a_definition_uses_the_default_agent(cli_mesh: Mesh) -> None:
    result = apomesh("run", "echo me", "--follow", "--url", cli_mesh.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "completed: done: echo me"


def test_sessions_list_show_and_tail(cli_mesh: Mesh) -> None:
    started = apomesh(
        "run",
        "list me",
        "--definition",
        str(DEFINITIONS / "solo.toml"),
        "--follow",
        "--url",
        cli_mesh.url,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    session_id = started.stdout.splitlines()[0].removeprefix("session ").strip()

    listed = apomesh("sessions", "list", "--url", cli_mesh.url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if session_id in line)
    assert "completed" in row and "list me" in row

    only_failed = apomesh("sessions", "list", "--status", "failed", "--url", cli_mesh.url)
    assert only_failed.returncode == 0
    assert session_id not in only_failed.stdout

    shown = apomesh("sessions", "show", session_id, "--output", "json", "--url", cli_mesh.url)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["session_id"] == session_id
    assert view["status"] == "completed"
    assert view["output"] == "wrote list me"
    assert view["side_effects"] == 1

    tailed = apomesh("sessions", "tail", session_id, "--url", cli_mesh.url)
    assert tailed.returncode == 0, tailed.stderr
    rows = [line.split() for line in tailed.stdout.splitlines() if line.strip()]
    assert [int(r[0]) for r in rows] == list(range(view["last_index"] + 1))
    assert rows[0][1] == "SessionStarted"
    assert rows[-1][1] == "SessionEnded"
    assert "ToolCallRecorded" in [r[1] for r in rows]

    after = apomesh(
        "sessions",
        "tail",
        session_id,
        "--after",
        str(view["last_index"] - 1),
        "--url",
        cli_mesh.url,
    )
    assert after.returncode == 0
    assert [line.split()[1] for line in after.stdout.splitlines() if line.strip()] == [
        "SessionEnded"
    ]


def test_sessions_show_of_an_unknown_session_exits_1(cli_mesh: Mesh) -> None:
    result = apomesh("sessions", "show", "0" * 32, "--url", cli_mesh.url)
    assert result.returncode == 1
    assert "not found" in flat(result.stderr).lower()


def test_a_daemon_that_is_not_there_exits_1() -> None:
    from apomesh.adapters.natsserver import free_port

    result = apomesh("sessions", "list", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert result.stderr.strip()


# --- the documented formats ------------------------------------------------------------------------

FORMATS_DOC = Path(__file__).parents[2] / "docs" / "formats.md"


def fenced_blocks(language: str) -> list[str]:
    blocks: list[str] = []
    current: list[str] = []
    inside = False
    for line in FORMATS_DOC.read_text().splitlines():
        if not inside and line.strip() == f"```{language}":
            inside, current = True, []
        elif inside and line.strip() == "```":
            inside = False
            blocks.append("\n".join(current) + "\n")
        elif inside:
            current.append(line)
    return blocks


def test_every_documented_example_is_valid() -> None:
    import tomllib

    from apomesh.core.definition import parse_definition, parse_script

    toml_blocks = fenced_blocks("toml")
    assert len(toml_blocks) >= 5
    for block in toml_blocks:
        data = tomllib.loads(block)
        if "name" in data:
            continue  # a whole definition: run below
        if "turns" in data:
            parse_script(data, where="docs/formats.md")
        else:
            parse_definition({"name": "doc-example", **data}, where="docs/formats.md")
    (json_block,) = fenced_blocks("json")
    parse_definition(json.loads(json_block)["definition"], where="docs/formats.md")


def test_the_documented_example_runs(cli_mesh: Mesh, tmp_path: Path) -> None:
    definition, script = fenced_blocks("toml")[:2]
    (tmp_path / "writer.toml").write_text(definition)
    (tmp_path / "writer-worker.script.toml").write_text(script)
    for earlier in cli_mesh.daemon.workspace.glob("*/done-*.txt"):
        earlier.unlink()
    result = apomesh(
        "run",
        "a story",
        "--definition",
        "writer.toml",
        "--follow",
        "--url",
        cli_mesh.url,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "completed: all parts written"
    (done,) = cli_mesh.daemon.workspace.glob("*/done-2.txt")  # in the session's own directory
    assert done.read_text() == "gamma done"
    # The JSON form, as the API takes it.
    response = httpx.post(f"{cli_mesh.url}/v1/sessions", json=json.loads(fenced_blocks("json")[0]))
    assert response.status_code == 201, response.text
    session_id = response.json()["session_id"]
    with SyncClient(cli_mesh.url) as client:
        ended = client.wait(session_id, timeout=60)
    assert (ended.status, ended.output) == ("completed", "wrote hello")
    assert (cli_mesh.daemon.workspace / session_id / "out.txt").read_text() == "hello"


# --- output for people and scripts ------------------------------------------------------------------

MARKUP_GOAL = "fix [bug] in [red]parser [/] and [bold]"
ASKER = """name = "bracket-asker"
version = "1.0.0"
coordination = "solo"
tools = ["ask_human"]

[model]
provider = "scripted"
turns = [
  { tool_calls = [{ tool = "ask_human", args = { question = "Which [red]colour[/] for the [model]?" } }] },
  { final = "chose {task}" },
]
"""


def narrow(*args: str) -> subprocess.CompletedProcess[str]:
    """``apomesh`` in a pipe at 40 columns, stdin not a terminal, as a script runs it."""
    env = {**os.environ, "COLUMNS": "40", "NO_COLOR": "1"}
    env.pop("APOMESH_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def start_asker(mesh: Mesh, tmp_path: Path, goal: str) -> str:
    definition = tmp_path / "asker.toml"
    definition.write_text(ASKER)
    started = narrow("run", goal, "--definition", str(definition), "--url", mesh.url)
    assert started.returncode == 0, started.stderr
    session_id = started.stdout.split()[-1]
    with SyncClient(mesh.url) as client:
        deadline = time.monotonic() + 60
        while not client.get_session(session_id).hitl_pending:
            assert time.monotonic() < deadline, "the session never paused"
            time.sleep(0.1)
    return session_id


def test_data_prints_verbatim_and_ids_whole_in_a_narrow_pipe(cli_mesh: Mesh) -> None:
    done = narrow("run", MARKUP_GOAL, "--follow", "--url", cli_mesh.url)
    assert done.returncode == 0, done.stdout + done.stderr
    session_id = done.stdout.splitlines()[0].removeprefix("session ")
    assert f"{session_id} completed — {MARKUP_GOAL}" in done.stdout.splitlines()
    assert done.stdout.splitlines()[-1] == f"completed: done: {MARKUP_GOAL}"

    listed = narrow("sessions", "list", "--query", "[red]parser", "--url", cli_mesh.url)
    assert listed.returncode == 0, listed.stderr
    # In a pipe a row is one line, however narrow COLUMNS is: the whole id, the whole goal.
    rows = [line for line in listed.stdout.splitlines() if session_id in line]
    assert len(rows) == 1 and MARKUP_GOAL in rows[0], listed.stdout

    shown = narrow("sessions", "show", session_id, "--url", cli_mesh.url)
    assert shown.returncode == 0, shown.stderr
    assert f"goal         {MARKUP_GOAL}" in shown.stdout
    assert f"output       done: {MARKUP_GOAL}" in shown.stdout
    # Human times, not unix seconds.
    assert re.search(r"started      \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(\d+[smhd] ago\)", shown.stdout)
    assert not re.search(r"\b1\d{9}\.\d+", shown.stdout)


def test_tail_prints_every_event_whole(cli_mesh: Mesh) -> None:
    goal = "a long goal " + "with many words " * 40 + "[and a tag]"
    done = narrow("run", goal, "--follow", "--url", cli_mesh.url)
    assert done.returncode == 0, done.stdout + done.stderr
    session_id = done.stdout.splitlines()[0].removeprefix("session ")
    tailed = narrow("sessions", "tail", session_id, "--url", cli_mesh.url)
    assert tailed.returncode == 0, tailed.stderr
    first = tailed.stdout.splitlines()[0]
    assert first.split()[:2] == ["0", "SessionStarted"]
    assert json.loads(first.split(None, 2)[2])["goal"] == goal
    as_json = narrow("sessions", "tail", session_id, "--output", "json", "--url", cli_mesh.url)
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert records[0]["event"]["goal"] == goal and records[-1]["kind"] == "SessionEnded"


LISTINGS = [
    ("sessions", "list"),
    ("recover", "list"),
    ("workers", "list"),
    ("hitl", "list"),
    ("daemons", "list"),
    ("skills", "list"),
    ("agents", "list"),
]


@pytest.mark.parametrize("command", LISTINGS, ids=[" ".join(c) for c in LISTINGS])
def test_every_listing_answers_json(cli_mesh: Mesh, command: tuple[str, str]) -> None:
    result = narrow(*command, "--output", "json", "--url", cli_mesh.url)
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), list)


def test_local_listings_answer_json(tmp_path: Path) -> None:
    plugins = narrow("plugins", "list", "--output", "json")
    assert plugins.returncode == 0, plugins.stderr
    assert "apomesh" in {p["name"] for p in json.loads(plugins.stdout)}
    created = narrow("tokens", "create", "--role", "read", "--data", str(tmp_path))
    assert created.returncode == 0, created.stderr
    tokens = narrow("tokens", "list", "--output", "json", "--data", str(tmp_path))
    assert [t["role"] for t in json.loads(tokens.stdout)] == ["read"]


def test_workers_list_shows_the_live_worker_whole(cli_mesh: Mesh) -> None:
    with SyncClient(cli_mesh.url) as client:
        worker = next(w for w in client.list_workers() if w.alive)
    listed = narrow("workers", "list", "--url", cli_mesh.url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if worker.id in line)
    assert "yes" in row
    rows = json.loads(narrow("workers", "list", "-o", "json", "--url", cli_mesh.url).stdout)
    assert worker.id in {w["id"] for w in rows}


def test_sessions_list_pages_with_limit_and_cursor(cli_mesh: Mesh) -> None:
    for n in range(3):
        done = narrow("run", f"paged {n}", "--follow", "--url", cli_mesh.url)
        assert done.returncode == 0, done.stderr
    seen: list[str] = []
    cursor: list[str] = []
    while True:
        page = narrow(
            "sessions",
            "list",
            "--query",
            "paged",
            "--limit",
            "1",
            "-o",
            "json",
            *cursor,
            "--url",
            cli_mesh.url,
        )
        assert page.returncode == 0, page.stderr
        rows = json.loads(page.stdout)
        seen += [r["session_id"] for r in rows]
        more = re.search(r"--cursor (\S+)", page.stderr)
        if more is None:
            break
        assert len(rows) == 1
        cursor = ["--cursor", more.group(1)]
    with SyncClient(cli_mesh.url) as client:
        everything = [s.session_id for s in client.list_sessions(query="paged")]
        first = client.list_sessions(query="paged", limit=2)
        second = client.list_sessions(query="paged", limit=2, cursor=first.next_cursor)
    assert seen == everything and len(seen) == len(set(seen)) == 3
    assert [s.session_id for s in [*first, *second]] == everything
    assert second.next_cursor is None
    bad = httpx.get(f"{cli_mesh.url}/v1/sessions", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_query"


def test_run_follow_in_a_pipe_shows_the_question_and_the_command_that_answers(
    cli_mesh: Mesh, tmp_path: Path
) -> None:
    definition = tmp_path / "asker.toml"
    definition.write_text(ASKER)
    env = {**os.environ, "COLUMNS": "40", "NO_COLOR": "1"}
    follow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apomesh",
            "run",
            "pick one",
            "--definition",
            str(definition),
            "--follow",
            "--url",
            cli_mesh.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in follow.stdout or ()], daemon=True
    ).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        # Each line arrives as it happens: the pause is shown while the session waits for it.
        while not any("answer with:" in line for line in seen):
            assert time.monotonic() < deadline, f"no answer command while paused: {seen}"
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1).rstrip("\n"))
        assert follow.poll() is None
        assert "root asks (" in "\n".join(seen)
        assert "Which [red]colour[/] for the [model]?" in "\n".join(seen)
        command = next(line for line in seen if "answer with:" in line).split("answer with: ")[1]
        words = shlex.split(command)
        assert words[:3] == ["apomesh", "hitl", "answer"] and "ANSWER" in words
        answered = subprocess.run(
            [sys.executable, "-m", *["blue [b]" if w == "ANSWER" else w for w in words]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert answered.returncode == 0, answered.stderr
        assert follow.wait(60) == 0
    finally:
        if follow.poll() is None:
            follow.kill()
    rest: list[str] = []
    while not lines.empty():
        rest.append(lines.get().rstrip("\n"))
    assert (seen + rest)[-1] == "completed: chose pick one"


def test_hitl_list_shows_each_open_pause(cli_mesh: Mesh, tmp_path: Path) -> None:
    session_id = start_asker(cli_mesh, tmp_path, "list my pause")
    listed = narrow("hitl", "list", "--url", cli_mesh.url)
    assert listed.returncode == 0, listed.stderr
    assert any(line.count(session_id) == 1 for line in listed.stdout.splitlines())
    pauses = json.loads(narrow("hitl", "list", "-o", "json", "--url", cli_mesh.url).stdout)
    mine = [p for p in pauses if p["session_id"] == session_id]
    assert [p["question"] for p in mine] == ["Which [red]colour[/] for the [model]?"]
    answered = narrow(
        "hitl", "answer", session_id, mine[0]["pause_id"], "red", "--url", cli_mesh.url
    )
    assert answered.returncode == 0, answered.stderr


def test_sessions_cancel_refuses_without_a_terminal_and_cancels_with_yes(
    cli_mesh: Mesh, tmp_path: Path
) -> None:
    session_id = start_asker(cli_mesh, tmp_path, "cancel me")
    refused = narrow("sessions", "cancel", session_id, "--url", cli_mesh.url)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "refusing to cancel a session without a terminal" in refused.stderr
    assert "--yes" in refused.stderr
    with SyncClient(cli_mesh.url) as client:
        assert client.get_session(session_id).status == "paused"
        cancelled = narrow("sessions", "cancel", session_id, "--yes", "--url", cli_mesh.url)
        assert cancelled.returncode == 0, cancelled.stderr
        assert client.wait(session_id, timeout=30).status == "cancelled"


def test_a_table_on_a_narrow_terminal_keeps_every_id_whole(cli_mesh: Mesh) -> None:
    """On a terminal 40 columns wide the table grows past the width rather than cut an id."""
    import fcntl
    import pty
    import struct
    import termios

    with SyncClient(cli_mesh.url) as client:
        session_id = client.start_session("seen on a terminal")
        client.wait(session_id, timeout=60)
    main, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "APOMESH_URL")}
    shown = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apomesh",
            "sessions",
            "list",
            "--query",
            "terminal",
            "--url",
            cli_mesh.url,
        ],
        stdout=terminal,
        stderr=terminal,
        stdin=subprocess.DEVNULL,
        env={**env, "TERM": "xterm"},
    )
    os.close(terminal)
    output = b""
    with contextlib.suppress(OSError):  # the terminal closes when the command exits
        while chunk := os.read(main, 65536):
            output += chunk
    os.close(main)
    assert shown.wait(60) == 0, output
    assert session_id in output.decode(errors="replace")


def test_the_demo_kills_a_worker_and_every_line_is_written_exactly_once() -> None:
    """The README's first command, as a new user runs it: embedded nats-server, the daemon, two
    worker processes, one SIGKILLed mid-run; every chapter line is in its file exactly once."""
    done = subprocess.run(
        [sys.executable, "-m", "apomesh", "demo"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "demo ok"
    assert any("SIGKILL" in line for line in lines) or "no worker was killed" in done.stdout
    assert sum("lines, exactly once" in line for line in lines) == 3
