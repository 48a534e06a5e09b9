"""Pinning plugins by distribution name and version.

A session records, in ``SessionStarted``, the plugins that shaped it: the owners of its
coordination kind, its tools and its model providers (``pins_for``). Before a session is resumed
the pins are checked against what is installed (``check_pins``): a pinned plugin that is missing or
at another version is a ``PluginPinMismatch``, never a silent fall-through to what is installed
now. ``diff_pins`` describes what a pin migration would change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from apomesh.core.errors import DefinitionError, NotFound, PluginPinMismatch
from apomesh.core.events import PluginPin
from apomesh.plugins.manager import PluginHost, RegistryKind


def pin_label(pin: PluginPin) -> str:
    """A pin as operators read it: ``name==version``."""
    return f"{pin.name}=={pin.version}"


def pins_for(
    host: PluginHost,
    coordination: str,
    tools: Iterable[str],
    providers: Iterable[str],
) -> list[PluginPin]:
    """The plugins a session with this coordination kind, tools and model providers depends on:
    deduplicated and sorted by (name, version).

    Raises ``DefinitionError`` naming what is unknown (and what is installed) when a kind, tool
    or provider was registered by no plugin. A tool of a tool server the config names (an MCP
    server, ``PluginHost.served_remotely``) is no plugin's and pins nothing.
    """
    wanted: list[tuple[RegistryKind, str]] = [("coordination", coordination)]
    wanted += [("tool", name) for name in tools if not host.served_remotely(name)]
    wanted += [("model_provider", name) for name in providers]
    pins: set[tuple[str, str]] = set()
    for kind, name in wanted:
        try:
            pin = host.owner_of(kind, name)
        except NotFound:
            raise DefinitionError(
                f"unknown {kind.replace('_', ' ')} {name!r}; installed: "
                + (", ".join(sorted(_known(host, kind))) or "none")
            ) from None
        pins.add((pin.name, pin.version))
    return [PluginPin(name=n, version=v) for n, v in sorted(pins)]


def _known(host: PluginHost, kind: RegistryKind) -> list[str]:
    if kind == "coordination":
        return list(host.coordination_kinds())
    if kind == "tool":
        return list(host.tools())
    return list(host.model_providers())


def check_pins(host: PluginHost, pins: Iterable[PluginPin]) -> None:
    """Raise ``PluginPinMismatch`` for the first pin the installed plugins cannot satisfy: a
    pinned distribution that is not loaded, or that is loaded at another version."""
    installed = host.installed_versions()
    for pin in pins:
        version = installed.get(pin.name)
        if version is None:
            raise PluginPinMismatch("the plugin is not installed", pin=pin_label(pin))
        if version != pin.version:
            raise PluginPinMismatch(
                f"the plugin is installed at version {version}", pin=pin_label(pin)
            )


def pin_problem(host: PluginHost, pins: Iterable[PluginPin]) -> str | None:
    """``check_pins`` as a value: the mismatch message, or None when every pin is satisfied
    (the shape recovery classifiers receive)."""
    try:
        check_pins(host, pins)
    except PluginPinMismatch as exc:
        return exc.message
    return None


def worker_pin_problem(versions: dict[str, str], pins: Iterable[PluginPin]) -> str | None:
    """Why a worker whose plugins are at ``versions`` (distribution -> version, as it registered)
    must not run a session with these pins: the first pinned plugin it has at another version.
    A pinned plugin the worker lacks is no problem here (placement needs the agent's tools and
    model provider on the worker anyway, and a plugin that runs on the daemon alone, a
    coordination kind's, is not needed there)."""
    for pin in pins:
        version = versions.get(pin.name)
        if version is not None and version != pin.version:
            return f"{pin_label(pin)}: the worker has version {version}"
    return None


class PinChange(msgspec.Struct, frozen=True):
    """One difference between two pin lists."""

    name: str
    change: Literal["added", "removed", "changed"]
    old_version: str | None
    new_version: str | None

    def __str__(self) -> str:
        if self.change == "added":
            return f"+ {self.name}=={self.new_version}"
        if self.change == "removed":
            return f"- {self.name}=={self.old_version}"
        return f"~ {self.name} {self.old_version} -> {self.new_version}"


def diff_pins(old: Iterable[PluginPin], new: Iterable[PluginPin]) -> list[PinChange]:
    """What changes from ``old`` to ``new`` pins, by distribution name, sorted by name."""
    before = {p.name: p.version for p in old}
    after = {p.name: p.version for p in new}
    changes: list[PinChange] = []
    for name in sorted(before.keys() | after.keys()):
        was, now = before.get(name), after.get(name)
        if was == now:
            continue
        if was is None:
            changes.append(PinChange(name, "added", None, now))
        elif now is None:
            changes.append(PinChange(name, "removed", was, None))
        else:
            changes.append(PinChange(name, "changed", was, now))
    return changes
