"""The built-in tools: workspace confinement, write vs append semantics, and the other tools."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from apomesh.builtin.tools import BUILTIN_TOOLS, resolve_in_workspace
from apomesh.core.errors import ToolError
from apomesh.plugins.api import ProbeResult, Tool

pytestmark = pytest.mark.anyio

TOOLS: dict[str, Tool] = {tool.name: tool for tool in BUILTIN_TOOLS}


class FakeToolContext:
    def __init__(self, workspace: Path) -> None:
        self._workspace = workspace
        self.questions: list[str] = []
        self.checkpoints = 0

    @property
    def workspace(self) -> Path:
        return self._workspace

    @property
    def session_id(self) -> str:
        return "s-1"

    @property
    def agent(self) -> str:
        return "root"

    epoch = 1
    call_key = "k"

    async def ask_human(self, question: str) -> str:
        self.questions.append(question)
        return "yes, go ahead"

    async def checkpoint_now(self) -> None:
        self.checkpoints += 1


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def ctx(workspace: Path) -> FakeToolContext:
    return FakeToolContext(workspace)


async def call(ctx: FakeToolContext, name: str, **args: Any) -> str:
    ctx.call_key = uuid.uuid4().hex  # each call a new effect, as the loop's journal keys make it
    return await TOOLS[name].run(ctx, args)


def test_the_tool_flags_match_their_recovery_semantics() -> None:
    assert not TOOLS["fs.read"].side_effect and not TOOLS["fs.list"].side_effect
    write, append = TOOLS["fs.write"], TOOLS["fs.append"]
    assert (write.side_effect, write.idempotent, write.on_unknown) == (True, True, "rerun")
    assert (append.side_effect, append.idempotent, append.on_unknown) == (True, False, "fail")
    assert TOOLS["jobs.sleep"].async_job


def test_every_tool_has_an_object_schema_naming_its_required_arguments() -> None:
    for tool in BUILTIN_TOOLS:
        schema = tool.parameters
        assert schema["type"] == "object", tool.name
        assert set(schema["required"]) <= set(schema["properties"]), tool.name
        assert tool.description, tool.name


async def test_write_creates_directories_and_read_returns_the_content(
    ctx: FakeToolContext, workspace: Path
) -> None:
    result = await call(ctx, "fs.write", path="notes/today/plan.md", content="one\ntwo\n")
    assert "wrote 8 bytes" in result
    assert (workspace / "notes/today/plan.md").read_text() == "one\ntwo\n"
    assert await call(ctx, "fs.read", path="notes/today/plan.md") == "one\ntwo\n"


async def test_write_replaces_the_whole_file_so_a_rerun_leaves_the_same_file(
    ctx: FakeToolContext, workspace: Path
) -> None:
    await call(ctx, "fs.write", path="out.txt", content="a much longer first version")
    await call(ctx, "fs.write", path="out.txt", content="final")
    await call(ctx, "fs.write", path="out.txt", content="final")
    assert (workspace / "out.txt").read_text() == "final"
    # no temp files left; the ledger is the tools' own directory
    assert sorted(p.name for p in workspace.iterdir()) == [".apomesh", "out.txt"]


async def test_append_adds_one_line_per_call(ctx: FakeToolContext, workspace: Path) -> None:
    await call(ctx, "fs.append", path="logs/log.txt", line="step 1")
    await call(ctx, "fs.append", path="logs/log.txt", line="step 1")
    await call(ctx, "fs.append", path="logs/log.txt", line="step 2")
    assert (workspace / "logs/log.txt").read_text() == "step 1\nstep 1\nstep 2\n"


async def test_append_refuses_more_than_one_line(ctx: FakeToolContext, workspace: Path) -> None:
    with pytest.raises(ToolError, match="one line"):
        await call(ctx, "fs.append", path="log.txt", line="a\nb")
    assert not (workspace / "log.txt").exists()


async def test_list_sorts_names_and_marks_directories(
    ctx: FakeToolContext, workspace: Path
) -> None:
    (workspace / "b.txt").write_text("")
    (workspace / "a").mkdir()
    (workspace / "a" / "inner.txt").write_text("")
    assert await call(ctx, "fs.list") == "a/\nb.txt"
    assert await call(ctx, "fs.list", path="a") == "inner.txt"


async def test_reading_a_missing_file_or_a_directory_is_a_tool_error(
    ctx: FakeToolContext, workspace: Path
) -> None:
    (workspace / "dir").mkdir()
    with pytest.raises(ToolError, match="no such file"):
        await call(ctx, "fs.read", path="missing.txt")
    with pytest.raises(ToolError, match="directory"):
        await call(ctx, "fs.read", path="dir")


async def test_dot_dot_out_of_the_workspace_is_refused(
    ctx: FakeToolContext, workspace: Path
) -> None:
    (workspace.parent / "secret.txt").write_text("secret")
    with pytest.raises(ToolError, match="climbs out"):
        await call(ctx, "fs.read", path="../secret.txt")
    with pytest.raises(ToolError, match="climbs out"):
        await call(ctx, "fs.write", path="a/../../escaped.txt", content="x")
    assert not (workspace.parent / "escaped.txt").exists()


async def test_dot_dot_that_stays_inside_is_allowed(ctx: FakeToolContext, workspace: Path) -> None:
    await call(ctx, "fs.write", path="a/../b.txt", content="fine")
    assert (workspace / "b.txt").read_text() == "fine"


async def test_absolute_paths_outside_the_workspace_are_refused(
    ctx: FakeToolContext, workspace: Path
) -> None:
    outside = workspace.parent / "abs.txt"
    with pytest.raises(ToolError, match="absolute path"):
        await call(ctx, "fs.write", path=str(outside), content="x")
    assert not outside.exists()
    inside = workspace / "inside.txt"
    await call(ctx, "fs.write", path=str(inside), content="ok")
    assert inside.read_text() == "ok"


async def test_a_symlink_pointing_outside_is_refused(ctx: FakeToolContext, workspace: Path) -> None:
    outside = workspace.parent / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    os.symlink(outside, workspace / "link")
    os.symlink(outside / "secret.txt", workspace / "file-link")

    with pytest.raises(ToolError, match="symlink"):
        await call(ctx, "fs.read", path="link/secret.txt")
    with pytest.raises(ToolError, match="symlink"):
        await call(ctx, "fs.read", path="file-link")
    with pytest.raises(ToolError, match="symlink"):
        await call(ctx, "fs.append", path="link/new.txt", line="x")
    with pytest.raises(ToolError, match="symlink"):
        await call(ctx, "fs.list", path="link")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


async def test_a_symlink_inside_the_workspace_is_followed(
    ctx: FakeToolContext, workspace: Path
) -> None:
    (workspace / "real").mkdir()
    (workspace / "real" / "f.txt").write_text("here")
    os.symlink(workspace / "real", workspace / "alias")
    assert await call(ctx, "fs.read", path="alias/f.txt") == "here"


def test_resolve_refuses_empty_and_nul_paths(workspace: Path) -> None:
    with pytest.raises(ToolError):
        resolve_in_workspace(workspace, "")
    with pytest.raises(ToolError):
        resolve_in_workspace(workspace, "a\x00b")


async def test_wrong_argument_types_are_tool_errors(ctx: FakeToolContext) -> None:
    with pytest.raises(ToolError, match="`path` must be a string"):
        await call(ctx, "fs.read", path=3)
    with pytest.raises(ToolError, match="`content` must be a string"):
        await call(ctx, "fs.write", path="x")
    with pytest.raises(ToolError, match="seconds"):
        await call(ctx, "jobs.sleep", seconds="soon")


async def test_ask_human_returns_the_answer(ctx: FakeToolContext) -> None:
    assert await call(ctx, "ask_human", question="Ship it?") == "yes, go ahead"
    assert ctx.questions == ["Ship it?"]


async def test_checkpoint_now_asks_the_context_for_a_snapshot(ctx: FakeToolContext) -> None:
    assert await call(ctx, "checkpoint.now") == "checkpoint taken"
    assert ctx.checkpoints == 1


async def test_sleep_job_reports_what_it_did(ctx: FakeToolContext) -> None:
    assert await call(ctx, "jobs.sleep", seconds=0) == "slept 0 s"
    assert await call(ctx, "jobs.sleep", seconds=0.01) == "slept 0.01 s"


# -- races, hard links and special files (openat-style resolution) ------------------------------


async def test_a_symlink_swapped_in_during_writes_never_escapes(
    ctx: FakeToolContext, workspace: Path
) -> None:
    outside = workspace.parent / "swap-target"
    outside.mkdir()
    (workspace / "d").mkdir()
    # Another process turns workspace/d into a symlink to `outside` and back, over and over (an
    # atomic exchange, so d is never missing for a call to make again), staying a moment in each
    # state so that calls start in one and finish in the other. (A thread would share the
    # interpreter lock with the calls, and slow each of them down to its switch interval.)
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(workspace), str(outside)])
    refused = 0
    try:
        # At least 1,000 rounds, and on until the swap was seen (a call refused) at least once.
        for i in range(20_000):
            if i >= 1000 and refused:
                break
            for tool, args in (("fs.write", {"content": "x"}), ("fs.append", {"line": "x"})):
                try:
                    await call(ctx, tool, path=f"d/{tool[3]}{i % 7}.txt", **args)
                except ToolError:
                    refused += 1
    finally:
        (workspace.parent / "swap-stop").touch()
        swapper.wait(timeout=30)
    assert swapper.returncode == 0
    assert refused > 0
    assert list(outside.iterdir()) == []


SWAPPER = """
import ctypes, os, sys, time
workspace, outside = sys.argv[1], sys.argv[2]
d, link = os.path.join(workspace, "d"), os.path.join(workspace, "d-link")
stop = os.path.join(os.path.dirname(workspace), "swap-stop")
os.symlink(outside, link)
renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
AT_FDCWD, RENAME_EXCHANGE = -100, 2
while not os.path.exists(stop):
    # Exchange the directory and the symlink in one step: d is always one or the other.
    if renameat2(AT_FDCWD, d.encode(), AT_FDCWD, link.encode(), RENAME_EXCHANGE) != 0:
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
    time.sleep(0.0005)
"""


async def test_a_hard_link_to_a_file_outside_is_refused(
    ctx: FakeToolContext, workspace: Path
) -> None:
    secret = workspace.parent / "hard-secret.txt"
    secret.write_text("secret\n")
    os.link(secret, workspace / "linked.txt")
    with pytest.raises(ToolError, match="hard links"):
        await call(ctx, "fs.read", path="linked.txt")
    with pytest.raises(ToolError, match="hard links"):
        await call(ctx, "fs.append", path="linked.txt", line="appended")
    assert secret.read_text() == "secret\n"


async def test_a_fifo_is_refused_without_blocking(ctx: FakeToolContext, workspace: Path) -> None:
    import asyncio

    fifo = workspace / "pipe"
    os.mkfifo(fifo)

    def release() -> None:
        # On code that blocks, a writer (reader) coming along lets the blocked open return.
        for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, flags))

    for tool, args in (("fs.read", {"path": "pipe"}), ("fs.append", {"path": "pipe", "line": "x"})):
        task = asyncio.ensure_future(call(ctx, tool, **args))
        done, _ = await asyncio.wait({task}, timeout=10)
        if not done:
            while not task.done():
                release()
                await asyncio.sleep(0.05)
            pytest.fail(f"{tool} blocked on a FIFO")
        with pytest.raises(ToolError, match=r"regular file|cannot open"):
            task.result()


# --- probes and fencing ---------------------------------------------------------------------------


def dispatch(workspace: Path, key: str, epoch: int = 1) -> FakeToolContext:
    """The context of one call (journal key ``key``) made by dispatch ``epoch`` of ``root``."""
    ctx = FakeToolContext(workspace)
    ctx.call_key, ctx.epoch = key, epoch
    return ctx


async def probe(ctx: FakeToolContext, name: str, **args: Any) -> ProbeResult:
    found = TOOLS[name].probe
    assert found is not None
    return await found(ctx, args)


class Crash(BaseException):
    """A kill at a chosen point inside a tool (nothing after it runs)."""


def crash_at_fsync(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    calls = {"n": 0}
    real = os.fsync

    def fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == nth:
            raise Crash
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("name", ["fs.append", "fs.write"])
async def test_a_probe_tells_whether_the_effect_happened(workspace: Path, name: str) -> None:
    args = (
        {"path": "p.txt", "line": "one"}
        if name == "fs.append"
        else {"path": "p.txt", "content": "one"}
    )
    ctx = dispatch(workspace, "k1")
    assert (await probe(ctx, name, **args)).status == "not_happened"
    result = await TOOLS[name].run(ctx, args)
    assert await probe(dispatch(workspace, "k1", epoch=2), name, **args) == ProbeResult(
        "happened", result=result
    )
    assert (await probe(dispatch(workspace, "k2", epoch=2), name, **args)).status == "not_happened"


async def test_an_append_cut_short_by_a_crash_is_settled_from_the_file(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = {"path": "log.txt", "line": "the line"}
    await TOOLS["fs.append"].run(dispatch(workspace, "k0"), {"path": "log.txt", "line": "before"})
    # Killed after the line reached the file, before the ledger said it was done: it happened.
    crash_at_fsync(monkeypatch, 2)
    with pytest.raises(Crash):
        await TOOLS["fs.append"].run(dispatch(workspace, "k1"), args)
    monkeypatch.undo()
    found = await probe(dispatch(workspace, "k1", epoch=2), "fs.append", **args)
    assert found == ProbeResult("happened", result="appended 1 line to log.txt")
    assert (workspace / "log.txt").read_text() == "before\nthe line\n"
    # Killed halfway through writing the line: the half line is cut off, it did not happen, and
    # the call then runs once.
    crash_at_fsync(monkeypatch, 2)
    with pytest.raises(Crash):
        await TOOLS["fs.append"].run(dispatch(workspace, "k2", epoch=2), {**args, "line": "second"})
    monkeypatch.undo()
    with open(workspace / "log.txt", "r+b") as handle:
        handle.truncate(len(b"before\nthe line\nsec"))
    again = dispatch(workspace, "k2", epoch=3)
    assert (await probe(again, "fs.append", path="log.txt", line="second")).status == "not_happened"
    assert (workspace / "log.txt").read_text() == "before\nthe line\n"
    await TOOLS["fs.append"].run(again, {**args, "line": "second"})
    await TOOLS["fs.append"].run(again, {**args, "line": "second"})  # the same effect: no-op
    assert (workspace / "log.txt").read_text() == "before\nthe line\nsecond\n"


async def test_a_stale_dispatch_cannot_write_over_a_newer_one(workspace: Path) -> None:
    stale, newer = dispatch(workspace, "x", epoch=1), dispatch(workspace, "y", epoch=2)
    await TOOLS["fs.write"].run(newer, {"path": "config.txt", "content": "Y"})
    with pytest.raises(ToolError, match="stale"):
        await TOOLS["fs.write"].run(stale, {"path": "config.txt", "content": "X"})
    assert (workspace / "config.txt").read_text() == "Y"
    # A newer dispatch's probe alone fences the older one off, before it writes anything.
    await probe(dispatch(workspace, "z", epoch=3), "fs.append", path="other.txt", line="z")
    with pytest.raises(ToolError, match="stale"):
        await TOOLS["fs.append"].run(newer, {"path": "other.txt", "line": "late"})
    assert not (workspace / "other.txt").exists() or (workspace / "other.txt").read_text() == ""
    # Another agent is not fenced by this one's epochs.
    other = dispatch(workspace, "w", epoch=1)
    other_agent = type("Other", (FakeToolContext,), {"agent": "root/0"})(workspace)
    other_agent.call_key, other_agent.epoch = other.call_key, 1
    await TOOLS["fs.write"].run(other_agent, {"path": "config.txt", "content": "Z"})
    assert (workspace / "config.txt").read_text() == "Z"


async def test_the_ledger_is_not_for_tools_to_write(ctx: FakeToolContext) -> None:
    with pytest.raises(ToolError, match="own records"):
        await call(ctx, "fs.write", path=".apomesh/effects/x.json", content="{}")
    with pytest.raises(ToolError, match="own records"):
        await call(ctx, "fs.append", path="./.apomesh/x", line="x")
    assert ".apomesh" not in await call(ctx, "fs.list", path=".")
