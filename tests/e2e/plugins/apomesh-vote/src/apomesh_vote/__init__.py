"""A third-party ``vote`` coordination kind, written from docs/plugins.md alone.

The root proposes options (``plan``); a ballot of ``voters`` sub-agents (role ``voter``) each
answer one option, and the ballot ends as soon as one option has a majority (``done_when``: the
voters still running are cancelled). The root is then asked twice in a row, with no checkpoint in
between: to judge the tally (``critique``: a final choice, or new options for another ballot) and
to announce the choice (``synthesize``), whose answer is the session's output. The checkpoint
holds only the ballot number and its options.

``vote-salted`` is the same loop built wrongly on purpose: its ballot tasks carry a live lookup
(the ``APOMESH_VOTE_SALT`` environment variable), so a replay after a restart with another value
asks for other tasks than the log holds, which the daemon refuses with ``Nondeterminism``.

``vote.note`` is a read-only tool registered only where ``APOMESH_VOTE_NOTE`` is set, so a test
can give one worker a tool the others lack (and place an agent on it alone).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import ChildResult, CoordinationKind, CoordinatorContext, Tool, ToolContext
from apomesh.plugins.hookspecs import hookimpl


class VoteFailed(Exception):
    """The vote cannot produce an output."""


class Ballot(msgspec.Struct, frozen=True):
    """The checkpointed loop position: which ballot, on which options."""

    number: int
    options: list[str]


def majority_of(voters: int) -> Callable[[list[ChildResult]], bool]:
    def reached(results: list[ChildResult]) -> bool:
        votes = Counter(r.output.strip() for r in results if r.ok)
        return bool(votes) and votes.most_common(1)[0][1] * 2 > voters

    return reached


def tally(results: list[ChildResult]) -> str:
    votes = Counter(r.output.strip() for r in results if r.ok)
    return ", ".join(f"{option}: {count}" for option, count in votes.most_common()) or "no votes"


class Vote:
    name = "vote"
    roles: tuple[str, ...] = ("voter",)

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(params) - {"voters", "ballots"})
        if unknown:
            raise DefinitionError(
                f"unknown parameter(s) {', '.join(unknown)}", where="$.coordination_params"
            )
        folded = {"voters": params.get("voters", 5), "ballots": params.get("ballots", 3)}
        for key, value in folded.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 50:
                raise DefinitionError(
                    f"`{key}` must be an integer from 1 to 50",
                    where=f"$.coordination_params.{key}",
                )
        return folded

    def ballot_task(self, ballot: Ballot, voter: int) -> str:
        return f"Ballot {ballot.number}, voter {voter}: choose one of {', '.join(ballot.options)}"

    async def run(self, ctx: CoordinatorContext) -> str:
        voters: int = ctx.params["voters"]
        saved = ctx.checkpoint
        if saved is None:
            proposal = await ctx.ask_root("plan", f"Propose the options to vote on: {ctx.goal}")
            if not proposal.plan:
                raise VoteFailed("the root proposed no options")
            ballot = Ballot(1, proposal.plan)
            await ctx.save_checkpoint("ballot-1", msgspec.json.encode(ballot))
        else:
            ballot = msgspec.json.decode(saved.state, type=Ballot)
        while True:
            tasks = [self.ballot_task(ballot, i) for i in range(voters)]
            results = await ctx.run_children(
                f"ballot-{ballot.number}",
                tasks,
                role="voter",
                max_parallel=3,
                done_when=majority_of(voters),
            )
            verdict = await ctx.ask_root(
                "critique",
                f"Ballot {ballot.number} on {', '.join(ballot.options)}: {tally(results)}. "
                "Give the chosen option, or new options for another ballot.",
            )
            if verdict.final is not None:
                announced = await ctx.ask_root(
                    "synthesize", f"Announce the choice: {verdict.final}"
                )
                return announced.final or ""
            if not verdict.plan or ballot.number >= ctx.params["ballots"]:
                raise VoteFailed(f"no choice after {ballot.number} ballot(s)")
            ballot = Ballot(ballot.number + 1, verdict.plan)
            await ctx.save_checkpoint(f"ballot-{ballot.number}", msgspec.json.encode(ballot))


class SaltedVote(Vote):
    """``vote`` with a live lookup in its tasks: not deterministic given the log (on purpose)."""

    name = "vote-salted"

    def ballot_task(self, ballot: Ballot, voter: int) -> str:
        salt = os.environ.get("APOMESH_VOTE_SALT", "")
        return f"{super().ballot_task(ballot, voter)} [{salt}]"


async def note(ctx: ToolContext, args: dict[str, Any]) -> str:
    return f"noted: {args.get('text', '')}"


@hookimpl
def register_coordination_kinds(register: Callable[[CoordinationKind], None]) -> None:
    register(Vote())
    register(SaltedVote())


@hookimpl
def register_tools(register: Callable[[Tool], None]) -> None:
    if os.environ.get("APOMESH_VOTE_NOTE"):
        register(Tool(name="vote.note", description="Note something down.", run=note))
