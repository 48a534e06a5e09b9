"""The default plugin: hook implementations that register everything apomesh ships with.

The plugin host always loads this module first. It registers the built-in coordination kinds,
the closed set of built-in checkpoint sources, the ``entrypoint`` skill resolver (the
``directory`` resolver and the catalog resolver need configuration and are built by the runtime),
the ``builtin`` recovery classifier, the built-in tools, the ``scripted``, ``openai`` and ``anthropic``
model providers, and the ``loop-guard`` supervisor policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from apomesh.builtin.anthropic_model import AnthropicProvider
from apomesh.builtin.classifier import BuiltinRecoveryClassifier
from apomesh.builtin.models import ScriptedProvider
from apomesh.builtin.openai_model import OpenAIProvider
from apomesh.builtin.skills import EntryPointSkillResolver
from apomesh.builtin.tools import BUILTIN_TOOLS
from apomesh.core.journal import canonical_bytes
from apomesh.plugins.api import (
    BUILTIN_CHECKPOINT_SOURCES,
    CheckpointSource,
    CoordinationKind,
    Message,
    ModelProvider,
    RecoveryClassifier,
    SkillResolver,
    SupervisorPolicy,
    Tool,
)
from apomesh.plugins.hookspecs import hookimpl

CHECKPOINT_SOURCE_DESCRIPTIONS = {
    "node": "an agent finished a node of its loop",
    "reset_point": "taken just before a supervisor reset",
    "explicit": "the agent called checkpoint.now",
    "affinity_release": "the agent released its worker affinity",
    "turn": "a model turn recorded before it was acted on (side effects, or the agent's answer)",
}


class LoopGuard:
    """Resets an agent whose last ``repeats`` assistant messages all made the same tool call(s)
    with the same arguments: a model stuck in a loop gets a fresh start instead of burning its
    budget."""

    name: str = "loop-guard"

    def __init__(self, repeats: int = 4) -> None:
        self.repeats = repeats

    def review(self, agent: str, step: int, recent: list[Message]) -> Literal["continue", "reset"]:
        assistant = [m for m in recent if m.role == "assistant"][-self.repeats :]
        if len(assistant) < self.repeats or not all(m.tool_calls for m in assistant):
            return "continue"

        def signature(m: Message) -> tuple[bytes, ...]:
            return tuple(canonical_bytes(call.tool, call.args) for call in m.tool_calls)

        # Newest first, stopping at the first difference (nearly always the second message). The
        # calls are compared by value first (arguments are JSON values: what differs by value
        # differs in canonical form), so canonical bytes are made only for calls that look alike.
        newest = assistant[-1].tool_calls
        if any(m.tool_calls != newest for m in reversed(assistant[:-1])):
            return "continue"
        last = signature(assistant[-1])
        repeated = all(signature(m) == last for m in reversed(assistant[:-1]))
        return "reset" if repeated else "continue"


@hookimpl
def register_coordination_kinds(register: Callable[[CoordinationKind], None]) -> None:
    # Imported here so the coordination kinds (which use the runtime contexts) load only when the
    # registry is built, not whenever this module is imported.
    from apomesh.builtin.coordination import COORDINATION_KINDS

    for kind in COORDINATION_KINDS:
        register(kind)


@hookimpl
def register_checkpoint_sources(register: Callable[[CheckpointSource], None]) -> None:
    for source in BUILTIN_CHECKPOINT_SOURCES:
        register(
            CheckpointSource(
                name=source, description=CHECKPOINT_SOURCE_DESCRIPTIONS.get(source, "")
            )
        )


@hookimpl
def register_skill_resolvers(register: Callable[[SkillResolver], None]) -> None:
    register(EntryPointSkillResolver())


@hookimpl
def register_recovery_classifiers(register: Callable[[RecoveryClassifier], None]) -> None:
    register(BuiltinRecoveryClassifier())


@hookimpl
def register_tools(register: Callable[[Tool], None]) -> None:
    for tool in BUILTIN_TOOLS:
        register(tool)


@hookimpl
def register_model_providers(register: Callable[[ModelProvider], None]) -> None:
    register(ScriptedProvider())
    register(OpenAIProvider())
    register(AnthropicProvider())


@hookimpl
def register_supervisor_policies(register: Callable[[SupervisorPolicy], None]) -> None:
    register(LoopGuard())
