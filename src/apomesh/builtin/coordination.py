"""The built-in coordination kinds: ``solo``, ``fanout`` and ``refine``.

Each is a small loop over the ``CoordinatorContext``: ask the root agent, run sub-agents, save a
checkpoint holding only the loop position (the phase, the iteration and the plan being worked).
Sub-task outputs are never checkpointed: a resumed loop calls ``run_children`` for the batch again
and gets them back from the children's terminal lifecycle events, so it re-runs only what had not
finished (and a fan-in of any size never passes through a checkpoint).
"""

from __future__ import annotations

from typing import Any

import msgspec

from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import ChildResult, CoordinationKind, CoordinatorContext


class CoordinationFailed(Exception):
    """The coordinator cannot produce an output (the root failed, or every child did)."""


class _Loop(msgspec.Struct):
    phase: str = "start"
    iteration: int = 0
    plan: list[str] = []


_loop_decoder = msgspec.json.Decoder(_Loop)


def _load(ctx: CoordinatorContext) -> _Loop:
    saved = ctx.checkpoint
    return _loop_decoder.decode(saved.state) if saved is not None else _Loop()


async def _save(ctx: CoordinatorContext, loop: _Loop) -> None:
    await ctx.save_checkpoint(f"{loop.phase}@{loop.iteration}", msgspec.json.encode(loop))


async def _planned(ctx: CoordinatorContext, limit: int | None = None) -> _Loop | str:
    """The loop as checkpointed, or freshly planned by the root (checkpointed at once); the root's
    final answer instead when it answers without a plan."""
    loop = _load(ctx)
    if loop.phase != "start":
        return loop
    answer = await ctx.ask_root("plan", f"Plan sub-tasks for: {ctx.goal}")
    if answer.plan is None:
        return answer.final or ""
    loop = _Loop(phase="planned", iteration=1, plan=answer.plan[:limit])
    await _save(ctx, loop)
    return loop


def _int_param(params: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = params.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise DefinitionError(
            f"`{name}` must be an integer from {low} to {high}",
            where=f"$.coordination_params.{name}",
        )
    return value


def _only(params: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise DefinitionError(
            f"unknown parameter(s) {', '.join(unknown)}", where="$.coordination_params"
        )


def _report(results: list[ChildResult]) -> str:
    lines = []
    for r in results:
        status = "ok" if r.ok else f"failed: {r.reason}"
        lines.append(f"[{r.index}] {r.task} -> {r.output if r.ok else status}")
    return "\n".join(lines)


class Solo:
    """The root agent alone."""

    name = "solo"
    roles: tuple[str, ...] = ()

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        _only(params, set())
        return {}

    async def run(self, ctx: CoordinatorContext) -> str:
        answer = await ctx.ask_root("act", ctx.goal)
        if answer.final is None:
            raise CoordinationFailed(
                "the root agent answered with a plan; solo needs a final answer"
            )
        return answer.final


class Fanout:
    """Plan sub-tasks, run sub-agents concurrently up to a cap, join, synthesize."""

    name = "fanout"
    roles: tuple[str, ...] = ("worker",)

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        _only(params, {"max_parallel", "max_tasks"})
        return {
            "max_parallel": _int_param(params, "max_parallel", 4, 1, 256),
            "max_tasks": _int_param(params, "max_tasks", 32, 1, 1024),
        }

    async def run(self, ctx: CoordinatorContext) -> str:
        loop = await _planned(ctx, limit=ctx.params["max_tasks"])
        if isinstance(loop, str):
            return loop
        # Joined or not, the results come from the batch (from the log for children that ended).
        results = await ctx.run_children(
            "fanout", loop.plan, max_parallel=ctx.params["max_parallel"]
        )
        if results and not any(r.ok for r in results):
            raise CoordinationFailed("every sub-agent failed:\n" + _report(results))
        if loop.phase == "planned":
            loop = _Loop(phase="joined", plan=loop.plan)
            await _save(ctx, loop)
        answer = await ctx.ask_root(
            "synthesize",
            f"Sub-task results:\n{_report(results)}\nSynthesize the answer to: {ctx.goal}",
        )
        if answer.final is None:
            raise CoordinationFailed("the root agent did not synthesize a final answer")
        return answer.final


class Refine:
    """Plan, execute, critique, and iterate within ceilings (``max_iterations``)."""

    name = "refine"
    roles: tuple[str, ...] = ("worker",)

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        _only(params, {"max_parallel", "max_iterations"})
        return {
            "max_parallel": _int_param(params, "max_parallel", 4, 1, 256),
            "max_iterations": _int_param(params, "max_iterations", 3, 1, 100),
        }

    async def run(self, ctx: CoordinatorContext) -> str:
        loop = await _planned(ctx)
        if isinstance(loop, str):
            return loop
        while True:
            results = await ctx.run_children(
                f"iter-{loop.iteration}", loop.plan, max_parallel=ctx.params["max_parallel"]
            )
            if loop.phase == "planned":
                loop = _Loop(phase="executed", iteration=loop.iteration, plan=loop.plan)
                await _save(ctx, loop)
            last = loop.iteration >= ctx.params["max_iterations"]
            purpose = "synthesize" if last else "critique"
            answer = await ctx.ask_root(
                purpose,
                f"Iteration {loop.iteration} results:\n{_report(results)}\n"
                + (
                    "Give the final answer."
                    if last
                    else "Give the final answer, or a new plan to iterate."
                ),
            )
            if answer.final is not None:
                return answer.final
            if last or answer.plan is None:
                raise CoordinationFailed(
                    f"no final answer within {ctx.params['max_iterations']} iterations"
                )
            loop = _Loop(phase="planned", iteration=loop.iteration + 1, plan=answer.plan)
            await _save(ctx, loop)


COORDINATION_KINDS: list[CoordinationKind] = [Solo(), Fanout(), Refine()]
