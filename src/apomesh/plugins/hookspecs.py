"""The hook specifications: one ``register_*(register)`` hook per extension point.

A plugin implements any of these hooks (decorated with ``hookimpl`` from this module) and, inside
each, calls ``register(obj)`` once per declaration. Registering does no I/O and returns nothing;
the host (``apomesh.plugins.manager.PluginHost``) calls every hook once while it is being built,
builds its registries from what was handed over, and refuses name collisions. None of the hooks is ``firstresult``: every
implementation is called, built-in plugin first, then third-party plugins in load order.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from apomesh.plugins.api import (
    CheckpointSource,
    CoordinationKind,
    ModelProvider,
    RecoveryClassifier,
    SkillResolver,
    SupervisorPolicy,
    Tool,
)

PROJECT_NAME = "apomesh"
"""The pluggy project name; also the entry-point group third-party plugins are found under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_coordination_kinds(register: Callable[[CoordinationKind], None]) -> None:
    """Declare coordination kinds (``solo``, ``fanout`` ... or a plugin's own).

    :param register: call it once per ``CoordinationKind``; the kind's ``name`` is what an agent
        definition's ``coordination`` key names, and must be unique across all plugins.

    Not firstresult: every implementation is called. Called once, when the plugin host is built
    (daemon or worker start, ``apomesh plugins list``).
    """


@hookspec
def register_checkpoint_sources(register: Callable[[CheckpointSource], None]) -> None:
    """Declare extra reasons an agent snapshot may be taken.

    :param register: call it once per ``CheckpointSource``; names are unique across plugins. A
        source may never stand for a HITL pause (a pause is recovered by re-running the loop).

    Not firstresult: every implementation is called. Called once, when the plugin host is built;
    the result is the closed set of checkpoint sources a session may record.
    """


@hookspec
def register_skill_resolvers(register: Callable[[SkillResolver], None]) -> None:
    """Declare skill-bundle resolvers.

    :param register: call it once per ``SkillResolver``; its ``name`` is recorded in each pinned
        skill, so a resume knows where a body came from. Names are unique across plugins.

    Not firstresult: every implementation is called. Called once, when the plugin host is built;
    resolvers are consulted in load order (built-in first).
    """


@hookspec
def register_recovery_classifiers(register: Callable[[RecoveryClassifier], None]) -> None:
    """Declare recovery classifiers that decide what a restarted daemon does with a session.

    :param register: call it once per ``RecoveryClassifier``. A classifier returning ``None``
        defers to the next one; third-party classifiers are asked before the built-in one, so a
        plugin can be stricter or looser than the default rules.

    Not firstresult: every implementation is called. Called once, when the plugin host is built;
    the classifiers are used at the daemon's boot scan.
    """


@hookspec
def register_tools(register: Callable[[Tool], None]) -> None:
    """Declare tools agents may call.

    :param register: call it once per ``Tool``; the tool's ``name`` (e.g. ``fs.read``) is what an
        agent definition's ``tools`` list names, and must be unique across plugins.

    Not firstresult: every implementation is called. Called once, when the plugin host is built
    (in the daemon and in each worker process).
    """


@hookspec
def register_model_providers(register: Callable[[ModelProvider], None]) -> None:
    """Declare model providers.

    :param register: call it once per ``ModelProvider``; its ``name`` is what ``[model] provider``
        names in an agent definition, and must be unique across plugins.

    Not firstresult: every implementation is called. Called once, when the plugin host is built
    (in the daemon and in each worker process).
    """


@hookspec
def register_supervisor_policies(register: Callable[[SupervisorPolicy], None]) -> None:
    """Declare supervisor policies that watch an agent's loop and may reset it.

    :param register: call it once per ``SupervisorPolicy``; names are unique across plugins.

    Not firstresult: every implementation is called. Called once, when the plugin host is built
    (in the daemon and in each worker process).
    """
