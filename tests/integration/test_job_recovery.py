"""A job an earlier writer started and never saw finish, taken up by a new writer (on the
in-memory log, with in-process tools that count their runs): a read-only job runs again; a
side-effecting one is never run again silently: ``fail`` ends it as an unknown outcome the agent
sees, ``hold`` holds the session (nothing written) until an operator's resume, which then fails
it, and only an idempotent ``rerun`` tool runs again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.strategies import born, session_started
from tests.writers import writer_deps

from apomesh.adapters.memory_log import MemoryLog
from apomesh.core.events import AsyncJobFinished, AsyncJobStarted
from apomesh.core.state import new_state
from apomesh.plugins.api import Tool, ToolContext
from apomesh.plugins.hookspecs import hookimpl
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.sessions import Held, SessionRuntime

pytestmark = pytest.mark.anyio
SID = "s-jobs"
RUNS: list[str] = []


async def effect(ctx: ToolContext, args: dict[str, Any]) -> str:
    RUNS.append(ctx.agent)
    return "done"


class JobTools:
    @hookimpl
    def register_tools(self, register: Callable[[Tool], None]) -> None:
        def job(name: str, **kw: Any) -> Tool:
            return Tool(name=name, description=name, run=effect, async_job=True, **kw)

        register(job("t.read"))
        register(job("t.fail", side_effect=True))
        register(job("t.hold", side_effect=True, on_unknown="hold"))
        register(job("t.rerun", side_effect=True, idempotent=True, on_unknown="rerun"))


async def taken_up(
    tmp_path: Path, tool: str, recovered: Any, *, side_effect: bool = True
) -> tuple[SessionRuntime, MemoryLog]:
    RUNS.clear()
    log = MemoryLog()

    deps = writer_deps(tmp_path, log=log, plugins=PluginHost.for_tests(JobTools()))
    runtime = SessionRuntime(deps, new_state(SID))
    job = AsyncJobStarted("root", "j1", tool, {}, side_effect=side_effect, idempotent=True)
    await runtime.append(session_started(), born("root"), job)
    await runtime._take_up_job(job, recovered)
    for _ in range(50):  # a job started again finishes on its own task
        if not runtime.state.jobs_in_flight:
            break
        await asyncio.sleep(0.01)
    return runtime, log


def finishes(runtime: SessionRuntime) -> list[AsyncJobFinished]:
    return list(runtime.state.jobs_done.values())


async def test_a_read_only_job_runs_again(tmp_path: Path) -> None:
    runtime, _ = await taken_up(tmp_path, "t.read", "auto", side_effect=False)
    assert RUNS == ["root"]
    assert [f.ok for f in finishes(runtime)] == [True]


async def test_a_failing_side_effect_job_is_never_run_again(tmp_path: Path) -> None:
    runtime, _ = await taken_up(tmp_path, "t.fail", "auto")
    assert RUNS == []
    (finished,) = finishes(runtime)
    assert finished.unknown and not finished.ok
    assert "not run again" in finished.result
    assert [e.tool for e in runtime.state.unknown_outcomes] == ["t.fail"]


async def test_a_held_job_holds_the_session_until_an_operator_resumes(tmp_path: Path) -> None:
    with pytest.raises(Held, match=r"outcome of job t\.hold"):
        await taken_up(tmp_path, "t.hold", "auto")
    assert RUNS == []
    runtime, _ = await taken_up(tmp_path, "t.hold", "operator")
    assert RUNS == []
    (finished,) = finishes(runtime)
    assert finished.unknown and "operator resumed past" in finished.result


async def test_an_idempotent_rerun_job_runs_again(tmp_path: Path) -> None:
    runtime, _ = await taken_up(tmp_path, "t.rerun", "auto")
    assert RUNS == ["root"]
    (finished,) = finishes(runtime)
    assert finished.ok and not finished.unknown
