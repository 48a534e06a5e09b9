"""The ``debate`` coordination kind: two sides argue a motion in turns for N rounds, a judge decides.

The session's goal is the motion. Each round the ``pro`` side argues for it, then the ``con`` side
against it; every turn is one sub-agent of that role (``[roles.pro]``, ``[roles.con]`` in the
agent definition) whose task is the motion plus the debate so far. When the rounds are done the
root agent, the judge, is asked once (purpose ``synthesize``) with the whole transcript, and its
final answer is the session's output.

Recovery: each turn is its own batch (``round-2-con``), so a resumed debate simply walks the
rounds again from the first. Turns whose sub-agent already completed on the log are not run again:
their arguments come back from the log, and the transcript is rebuilt from them. The checkpoint
holds only how many turns are done; re-saving one the log holds (as the replay walks past it)
writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import CoordinationKind, CoordinatorContext
from apomesh.plugins.hookspecs import hookimpl

SIDES = ("pro", "con")
MAX_ROUNDS = 20


class DebateFailed(Exception):
    """A side or the judge ended without an answer."""


class Turn(msgspec.Struct, frozen=True):
    """One argument of the debate."""

    round: int
    side: str
    argument: str


class Position(msgspec.Struct):
    """The checkpointed loop position: how many turns are done."""

    turns_done: int = 0


def render_transcript(turns: list[Turn]) -> str:
    """The debate so far, one argument per paragraph (what the sides and the judge are shown)."""
    if not turns:
        return "(no arguments yet)"
    return "\n\n".join(f"[round {t.round}] {t.side}: {t.argument}" for t in turns)


def turn_task(motion: str, side: str, round_number: int, rounds: int, turns: list[Turn]) -> str:
    """The task of one side's sub-agent for one turn."""
    stance = "for" if side == "pro" else "against"
    return (
        f"Motion: {motion}\n"
        f"You argue {stance} the motion. This is round {round_number} of {rounds}.\n\n"
        f"The debate so far:\n{render_transcript(turns)}\n\n"
        "Give your argument for this round."
    )


def judge_prompt(motion: str, turns: list[Turn]) -> str:
    """What the judge (the root agent) is asked once the rounds are done."""
    return (
        f"Motion: {motion}\n\nThe debate:\n{render_transcript(turns)}\n\n"
        "Decide which side argued better and say why."
    )


class Debate:
    """Two sides argue in turns for ``rounds`` rounds; the root agent judges."""

    name = "debate"
    roles: tuple[str, ...] = SIDES

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(params) - {"rounds"})
        if unknown:
            raise DefinitionError(
                f"unknown parameter(s) {', '.join(unknown)}", where="$.coordination_params"
            )
        rounds = params.get("rounds", 2)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
            raise DefinitionError(
                f"`rounds` must be an integer from 1 to {MAX_ROUNDS}",
                where="$.coordination_params.rounds",
            )
        return {"rounds": rounds}

    async def run(self, ctx: CoordinatorContext) -> str:
        rounds: int = ctx.params["rounds"]
        turns: list[Turn] = []
        for round_number in range(1, rounds + 1):
            for side in SIDES:
                task = turn_task(ctx.goal, side, round_number, rounds, turns)
                (result,) = await ctx.run_children(
                    f"round-{round_number}-{side}", [task], role=side, max_parallel=1
                )
                if not result.ok:
                    raise DebateFailed(
                        f"the {side} side failed in round {round_number}: {result.reason}"
                    )
                turns.append(Turn(round_number, side, result.output))
                # On a replay this is a checkpoint the log holds already: nothing is written.
                await ctx.save_checkpoint(
                    f"round-{round_number}-{side}",
                    msgspec.json.encode(Position(turns_done=len(turns))),
                )
        verdict = await ctx.ask_root("synthesize", judge_prompt(ctx.goal, turns))
        if verdict.final is None:
            raise DebateFailed("the judge answered with a plan instead of a verdict")
        return verdict.final


@hookimpl
def register_coordination_kinds(register: Callable[[CoordinationKind], None]) -> None:
    register(Debate())
