"""``apomesh.testing.ScriptedCoordinator``: coordination kinds unit-tested in-process, with the
daemon's replay rules, a crash after every step included."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import msgspec
import pytest

from apomesh.builtin.coordination import Fanout, Refine
from apomesh.core.errors import Nondeterminism
from apomesh.plugins.api import BATCH_DONE_EARLY, ChildResult, CoordinationKind, RootAnswer
from apomesh.testing import Crash, ScriptedCoordinator

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def refine_context() -> ScriptedCoordinator:
    return ScriptedCoordinator(
        goal="g",
        params=Refine().fold_params({"max_iterations": 3}),
        root=[
            RootAnswer(plan=["P1-a", "P1-b"]),
            RootAnswer(plan=["P2-a"]),
            RootAnswer(plan=["P3-a"]),
            RootAnswer(final="FINAL"),
        ],
    )


async def uninterrupted(kind: CoordinationKind, ctx: ScriptedCoordinator) -> tuple[str, int]:
    clean = ctx.fresh()
    output = await kind.run(clean)
    return output, clean._steps


@pytest.mark.parametrize("kind", [Refine(), Fanout()], ids=["refine", "fanout"])
async def test_a_crash_after_any_step_recovers_to_the_uninterrupted_output(
    kind: CoordinationKind,
) -> None:
    base = refine_context()
    if isinstance(kind, Fanout):
        base = base.fresh(
            params=Fanout().fold_params({}),
            root=[RootAnswer(plan=["a", "b", "c"]), RootAnswer(final="joined")],
        )
    expected, steps = await uninterrupted(kind, base)
    for n in range(1, steps + 1):
        crashed = base.fresh(crash_after=n)
        with pytest.raises(Crash):
            await kind.run(crashed)
        recovered = crashed.replay()
        assert await kind.run(recovered) == expected, n
        # Nothing is asked or run twice over the crash and the replay.
        assert crashed.root_calls + recovered.root_calls == len(base.root), n  # type: ignore[arg-type]
        runs = crashed.child_runs + recovered.child_runs
        assert len(runs) == len(set(runs)), n


async def test_refine_after_a_crash_at_a_later_round_does_not_reuse_an_old_answer() -> None:
    crashed = refine_context().fresh(crash_after=9)  # right after `executed@2` is saved
    with pytest.raises(Crash):
        await Refine().run(crashed)
    assert crashed.checkpoints[-1].position == "executed@2"
    recovered = crashed.replay()
    assert await Refine().run(recovered) == "FINAL"
    assert [t for _, t in recovered.child_runs] == ["P3-a"]


async def test_a_replayed_batch_with_other_tasks_raises_nondeterminism() -> None:
    ctx = ScriptedCoordinator(goal="g")
    with contextlib.suppress(Crash):
        await ctx.fresh(crash_after=1).run_children("b", ["one", "two"])
    crashed = ctx.fresh(crash_after=1)
    with pytest.raises(Crash):
        await crashed.run_children("b", ["one", "two"])
    with pytest.raises(Nondeterminism, match="batch 'b' task 0"):
        await crashed.replay().run_children("b", ["ONE", "two"])


async def test_a_replayed_ask_with_another_purpose_raises_nondeterminism() -> None:
    crashed = ScriptedCoordinator(root=[RootAnswer(plan=["x"])], crash_after=1)
    with pytest.raises(Crash):
        await crashed.ask_root("plan", "p")
    assert (await crashed.replay().ask_root("plan", "p")).plan == ["x"]
    with pytest.raises(Nondeterminism):
        await crashed.replay().ask_root("critique", "p")


async def test_done_when_ends_a_batch_and_a_replay_keeps_it_ended() -> None:
    def majority(results: list[ChildResult]) -> bool:
        return sum(r.output == "yes" for r in results) >= 2

    ctx = ScriptedCoordinator(child=lambda role, task: "yes")
    results = await ctx.run_children("vote", ["v0", "v1", "v2", "v3"], done_when=majority)
    assert [r.ok for r in results] == [True, True, False, False]
    assert results[2].reason == BATCH_DONE_EARLY
    again = ctx.replay()
    assert await again.run_children("vote", ["v0", "v1", "v2", "v3"], done_when=majority) == results
    assert again.child_runs == []


async def test_a_re_saved_checkpoint_on_replay_writes_nothing_and_keeps_ask_positions() -> None:
    class FromTheStart:
        name = "from-the-start"
        roles = ("worker",)

        def fold_params(self, params: dict[str, object]) -> dict[str, object]:
            return {}

        async def run(self, ctx: ScriptedCoordinator) -> str:  # type: ignore[override]
            answers = []
            for step in range(3):
                await ctx.save_checkpoint(f"step-{step}", msgspec.json.encode(step))
                answers.append((await ctx.ask_root("act", f"step {step}")).final or "")
            return ",".join(answers)

    base = ScriptedCoordinator(root=[RootAnswer(final=str(i)) for i in range(3)])
    for n in range(1, 7):
        crashed = base.fresh(crash_after=n)
        with pytest.raises(Crash):
            await FromTheStart().run(crashed)
        recovered = crashed.replay()
        assert await FromTheStart().run(recovered) == "0,1,2", n
        assert len(recovered.checkpoints) == 3


async def test_the_third_party_vote_kind_recovers_after_a_crash_at_every_step() -> None:
    # The example of docs/plugins.md, "Unit-testing a kind", on the test plugin's `vote` kind.
    vote_src = Path(__file__).resolve().parents[1] / "e2e" / "plugins" / "apomesh-vote" / "src"
    sys.path.insert(0, str(vote_src))
    try:
        from apomesh_vote import Vote
    finally:
        sys.path.remove(str(vote_src))
    kind = Vote()
    script = ScriptedCoordinator(
        goal="pick a colour",
        params=kind.fold_params({}),
        roles=("voter",),
        root=[RootAnswer(plan=["red", "blue"]), RootAnswer(final="red"), RootAnswer(final="red!")],
        child=lambda role, task: "red",
    )
    clean = script.fresh()
    expected = await kind.run(clean)
    assert expected == "red!"
    assert len(clean.child_runs) == 3  # the majority of 5 ended the ballot
    for n in range(1, 12):
        crashed = script.fresh(crash_after=n)
        with contextlib.suppress(Crash):
            await kind.run(crashed)
        recovered = crashed.replay()
        assert await kind.run(recovered) == expected, n
        assert crashed.root_calls + recovered.root_calls == clean.root_calls, n


def test_the_debate_snippet_in_the_docs_is_the_plugins_code() -> None:
    repo = Path(__file__).resolve().parents[2]
    docs = (repo / "docs" / "plugins.md").read_text(encoding="utf-8")
    plugin = (
        repo / "plugins" / "apomesh-debate" / "src" / "apomesh_debate" / "plugin.py"
    ).read_text(encoding="utf-8")
    start = docs.index("    async def run(self, ctx: CoordinatorContext) -> str:\n        rounds")
    end = docs.index("        return verdict.final\n", start) + len(
        "        return verdict.final\n"
    )
    assert docs[start:end] in plugin
