"""The plugin host: loads plugins in an explicit order and serves typed registries built from them.

Load order: the built-in default plugin (``apomesh.builtin.plugin``), then the entry points of
group ``apomesh`` (filtered by an allow-list and a block-list, from constructor arguments or the
``APOMESH_PLUGINS_ALLOW`` / ``APOMESH_PLUGINS_BLOCK`` environment variables), then
``check_pending`` so a misspelt hook implementation fails loudly. Every registry is then built
once, by calling each plugin's ``register_*`` hook in load order; a name registered by two plugins
is a ``PluginError`` naming both, raised while the host is being built. The rest of apomesh uses ``PluginHost`` only and never
touches the untyped ``pm.hook``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any, Literal

import msgspec
import pluggy

from apomesh._version import __version__ as APOMESH_VERSION
from apomesh.core.errors import NotFound, PluginError
from apomesh.core.events import PluginPin
from apomesh.plugins import hookspecs
from apomesh.plugins.api import (
    CheckpointSource,
    CoordinationKind,
    ModelProvider,
    RecoveryClassifier,
    SkillResolver,
    SupervisorPolicy,
    Tool,
)

BUILTIN_PLUGIN_MODULE = "apomesh.builtin.plugin"
BUILTIN_DISTRIBUTION = "apomesh"
ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
ENV_ALLOW = "APOMESH_PLUGINS_ALLOW"
ENV_BLOCK = "APOMESH_PLUGINS_BLOCK"

RegistryKind = Literal[
    "coordination",
    "checkpoint_source",
    "skill_resolver",
    "recovery_classifier",
    "tool",
    "model_provider",
    "supervisor_policy",
]

_HOOK_OF_KIND: dict[RegistryKind, str] = {
    "coordination": "register_coordination_kinds",
    "checkpoint_source": "register_checkpoint_sources",
    "skill_resolver": "register_skill_resolvers",
    "recovery_classifier": "register_recovery_classifiers",
    "tool": "register_tools",
    "model_provider": "register_model_providers",
    "supervisor_policy": "register_supervisor_policies",
}

_LABEL_OF_KIND: dict[RegistryKind, str] = {
    "coordination": "coordination",
    "checkpoint_source": "checkpoint sources",
    "skill_resolver": "skill resolvers",
    "recovery_classifier": "recovery classifiers",
    "tool": "tools",
    "model_provider": "model providers",
    "supervisor_policy": "supervisor policies",
}

_REQUIRED_METHODS: dict[RegistryKind, tuple[str, ...]] = {
    "coordination": ("fold_params", "run"),
    "checkpoint_source": (),
    "skill_resolver": ("resolve",),
    "recovery_classifier": ("classify",),
    "tool": ("run",),
    "model_provider": ("create",),
    "supervisor_policy": ("review",),
}


class PluginInfo(msgspec.Struct, frozen=True):
    """One loaded plugin: its distribution name and version, the hooks it implements and what it
    registered (one line per kind, e.g. ``coordination: solo, fanout``)."""

    name: str
    version: str
    entry_point: str
    hooks: tuple[str, ...]
    registered: tuple[str, ...]

    @property
    def pin(self) -> PluginPin:
        return PluginPin(name=self.name, version=self.version)


class _Loaded(msgspec.Struct):
    key: str  # unique pluggy registration name
    plugin: object
    distribution: str
    version: str
    entry_point: str
    builtin: bool
    registered: dict[RegistryKind, list[str]] = msgspec.field(default_factory=dict)


class _Entry(msgspec.Struct, frozen=True):
    owner: _Loaded
    value: Any


def _split_env(value: str | None) -> frozenset[str] | None:
    if value is None or not value.strip():
        return None
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _name_of(kind: RegistryKind, obj: object) -> str:
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"a registered {kind.replace('_', ' ')} needs a non-empty string `name`")
    return name


class PluginHost:
    """Loads plugins and serves typed registries of what they declared.

    ``allow`` (when not None) lists the only third-party plugins to load and ``block`` lists ones
    never to load; both match an entry point's name or its distribution's name. When an argument
    is None the matching environment variable is read (comma-separated). The built-in plugin is
    always loaded. ``extra_plugins`` are in-process plugin objects registered after the entry
    points (see ``for_tests``).
    """

    def __init__(
        self,
        *,
        allow: Iterable[str] | None = None,
        block: Iterable[str] | None = None,
        load_entry_points: bool = True,
        extra_plugins: Iterable[object] = (),
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self._allow = frozenset(allow) if allow is not None else _split_env(env.get(ENV_ALLOW))
        self._block = frozenset(block) if block is not None else _split_env(env.get(ENV_BLOCK))
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._loaded: list[_Loaded] = []
        self._registries: dict[RegistryKind, dict[str, _Entry]] = {}
        self._skipped: list[str] = []
        self.tool_servers: frozenset[str] = frozenset()
        """The names of the tool servers outside the plugins (the MCP servers the config names):
        their tools are ``<server>.<tool>``, offered by the workers that reach the server."""

        self._load_builtin()
        if load_entry_points:
            self._load_entry_points()
        for plugin in extra_plugins:
            self._register_in_process(plugin)
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {self._display(exc.plugin)}: {exc}") from exc
        # Build every registry now, so a collision or a broken hook fails at start-up.
        for kind in _HOOK_OF_KIND:
            self._registry(kind)

    @classmethod
    def for_tests(cls, *plugins: object, load_entry_points: bool = False) -> PluginHost:
        """A host with the built-in plugin plus ``plugins`` (in-process objects or modules).

        Installed entry points are not loaded unless asked for, so a test sees only what it
        names. A plugin object may set ``apomesh_plugin_name`` and ``apomesh_plugin_version`` to
        stand in for a distribution; otherwise its module or class name and ``0`` are used.
        """
        return cls(
            allow=None,
            block=(),
            load_entry_points=load_entry_points,
            extra_plugins=plugins,
            environ={},
        )

    # --- loading ---------------------------------------------------------------------------

    def _load_builtin(self) -> None:
        module = importlib.import_module(BUILTIN_PLUGIN_MODULE)
        self._register(
            _Loaded(
                key=BUILTIN_DISTRIBUTION,
                plugin=module,
                distribution=BUILTIN_DISTRIBUTION,
                version=APOMESH_VERSION,
                entry_point="",
                builtin=True,
            )
        )

    def _load_entry_points(self) -> None:
        for ep in sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)
        ):
            dist = ep.dist
            dist_name = dist.name if dist is not None else ep.name
            version = dist.version if dist is not None else "0"
            if not self._wanted(ep.name, dist_name):
                self._skipped.append(f"{dist_name}:{ep.name}")
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {dist_name} {version} (entry point {ep.name!r} = {ep.value}) "
                    f"failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            if self._pm.is_registered(plugin):
                continue
            self._register(
                _Loaded(
                    key=f"{dist_name}:{ep.name}",
                    plugin=plugin,
                    distribution=dist_name,
                    version=version,
                    entry_point=ep.name,
                    builtin=False,
                )
            )

    def _register_in_process(self, plugin: object) -> None:
        name = getattr(plugin, "apomesh_plugin_name", None)
        if not isinstance(name, str) or not name:
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
        version = getattr(plugin, "apomesh_plugin_version", None)
        if not isinstance(version, str) or not version:
            version = "0"
        key = name
        n = 1
        while self._pm.has_plugin(key):
            n += 1
            key = f"{name}#{n}"
        self._register(
            _Loaded(
                key=key,
                plugin=plugin,
                distribution=name,
                version=version,
                entry_point="",
                builtin=False,
            )
        )

    def _register(self, loaded: _Loaded) -> None:
        try:
            self._pm.register(loaded.plugin, name=loaded.key)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(
                f"plugin {loaded.distribution} {loaded.version} cannot be registered: {exc}"
            ) from exc
        self._loaded.append(loaded)

    def _wanted(self, entry_point: str, distribution: str) -> bool:
        names = {entry_point, distribution}
        if self._block is not None and names & self._block:
            return False
        return self._allow is None or bool(names & self._allow)

    def _display(self, plugin: object) -> str:
        for loaded in self._loaded:
            if loaded.plugin is plugin:
                return f"{loaded.distribution} {loaded.version}"
        return repr(plugin)

    # --- registries ------------------------------------------------------------------------

    def _registry(self, kind: RegistryKind) -> dict[str, _Entry]:
        cached = self._registries.get(kind)
        if cached is not None:
            return cached
        hook_name = _HOOK_OF_KIND[kind]
        impls = {
            impl.plugin_name: impl for impl in getattr(self._pm.hook, hook_name).get_hookimpls()
        }
        entries: dict[str, _Entry] = {}
        for loaded in self._loaded:
            impl = impls.get(loaded.key)
            if impl is None:
                continue
            names = self._call_register_hook(kind, loaded, impl.function, impl.argnames, entries)
            loaded.registered[kind] = names
        self._registries[kind] = entries
        return entries

    def _call_register_hook(
        self,
        kind: RegistryKind,
        loaded: _Loaded,
        function: Callable[..., object],
        argnames: tuple[str, ...],
        entries: dict[str, _Entry],
    ) -> list[str]:
        who = f"{loaded.distribution} {loaded.version}"
        hook_name = _HOOK_OF_KIND[kind]
        names: list[str] = []
        open_for_registration = True

        def register(obj: object) -> None:
            if not open_for_registration:
                raise PluginError(f"plugin {who} called register() after {hook_name} returned")
            if kind == "tool" and not isinstance(obj, Tool):
                raise PluginError(f"plugin {who} registered a {type(obj).__name__}, not a Tool")
            if kind == "checkpoint_source" and not isinstance(obj, CheckpointSource):
                raise PluginError(
                    f"plugin {who} registered a {type(obj).__name__}, not a CheckpointSource"
                )
            try:
                name = _name_of(kind, obj)
            except PluginError as exc:
                raise PluginError(f"plugin {who}: {exc.message}") from None
            missing = [m for m in _REQUIRED_METHODS[kind] if not callable(getattr(obj, m, None))]
            if missing:
                raise PluginError(
                    f"plugin {who}: {kind.replace('_', ' ')} {name!r} lacks {', '.join(missing)}"
                )
            existing = entries.get(name)
            if existing is not None:
                other = existing.owner
                raise PluginError(
                    f"{kind.replace('_', ' ')} {name!r} is registered by both plugin "
                    f"{other.distribution} {other.version} and plugin {who}"
                )
            entries[name] = _Entry(owner=loaded, value=obj)
            names.append(name)

        try:
            result = function(**{arg: register for arg in argnames if arg == "register"})
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"plugin {who}: {hook_name} raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            open_for_registration = False
        if result is not None:
            close = getattr(result, "close", None)
            if callable(close):  # an un-awaited coroutine would otherwise warn
                close()
            raise PluginError(
                f"plugin {who}: {hook_name} must call register(obj) and return nothing "
                f"(it returned {type(result).__name__}; hooks must not be async)"
            )
        return names

    def _values(self, kind: RegistryKind) -> dict[str, Any]:
        return {name: entry.value for name, entry in self._registry(kind).items()}

    def coordination_kinds(self) -> dict[str, CoordinationKind]:
        """Every coordination kind by name."""
        return dict(self._values("coordination"))

    def tools(self) -> dict[str, Tool]:
        """Every tool by name."""
        return dict(self._values("tool"))

    def model_providers(self) -> dict[str, ModelProvider]:
        """Every model provider by name."""
        return dict(self._values("model_provider"))

    def supervisor_policies(self) -> dict[str, SupervisorPolicy]:
        """Every supervisor policy by name."""
        return dict(self._values("supervisor_policy"))

    def checkpoint_sources(self) -> dict[str, CheckpointSource]:
        """Every checkpoint source by name: the closed set a session may record."""
        return dict(self._values("checkpoint_source"))

    def skill_resolvers(self) -> list[SkillResolver]:
        """Skill resolvers in load order (built-in first)."""
        return list(self._values("skill_resolver").values())

    def recovery_classifiers(self) -> list[RecoveryClassifier]:
        """Recovery classifiers in the order they are asked: third-party plugins first (in load
        order), the built-in plugin's last, so a plugin can override the default rules."""
        entries = list(self._registry("recovery_classifier").values())
        third_party = [e.value for e in entries if not e.owner.builtin]
        builtin = [e.value for e in entries if e.owner.builtin]
        return [*third_party, *builtin]

    # --- introspection and pinning -----------------------------------------------------------

    def plugins(self) -> list[PluginInfo]:
        """Every loaded plugin in load order, with what it registered."""
        infos: list[PluginInfo] = []
        for loaded in self._loaded:
            hooks = tuple(
                sorted(caller.name for caller in self._pm.get_hookcallers(loaded.plugin) or [])
            )
            registered = tuple(
                f"{_LABEL_OF_KIND[kind]}: {', '.join(names)}"
                for kind, names in loaded.registered.items()
                if names
            )
            infos.append(
                PluginInfo(
                    name=loaded.distribution,
                    version=loaded.version,
                    entry_point=loaded.entry_point,
                    hooks=hooks,
                    registered=registered,
                )
            )
        return infos

    def skipped(self) -> list[str]:
        """Entry points (``distribution:entry_point``) left out by the allow- or block-list."""
        return list(self._skipped)

    def owner_of(self, kind: RegistryKind, name: str) -> PluginPin:
        """The plugin (distribution name and version) that registered ``name`` as a ``kind``.

        Raises ``NotFound`` when nothing registered that name.
        """
        if kind not in _HOOK_OF_KIND:
            raise ValueError(f"unknown registry kind {kind!r}")
        entry = self._registry(kind).get(name)
        if entry is None:
            raise NotFound(f"{kind.replace('_', ' ')} {name!r}")
        return PluginPin(name=entry.owner.distribution, version=entry.owner.version)

    def served_remotely(self, tool: str) -> bool:
        """Whether ``tool`` is no plugin's but a tool server's (``tool_servers``): a definition may
        name it, nothing pins it, and only a worker that reaches its server offers it."""
        server, dot, rest = tool.partition(".")
        return bool(dot and rest) and server in self.tool_servers and tool not in self.tools()

    def installed_versions(self) -> dict[str, str]:
        """Each loaded plugin distribution's version, by distribution name."""
        return {loaded.distribution: loaded.version for loaded in self._loaded}
