"""The daemon's configuration: typed sections with a default for every key, and how it is loaded.

``Config`` is a tree of frozen ``msgspec`` structs, one per section of the TOML file
(``[nats]``, ``[daemon]``, ``[http]``, ``[liveness]``, ``[snapshots]``, ``[limits]``, ``[plugins]``,
``[workers]``, ``[providers]``, ``[store]``, ``[skills]``, ``[log]``, ``[tracing]``, ``[retention]``, ``[mcp]``); ``Config()`` is the whole default configuration, and the sample file
``apomesh config sample`` prints (``sample_config()``) shows every key at exactly that default.
``load_config`` layers, later winning: the TOML file, then environment variables
``APOMESH_<SECTION>_<KEY>`` (lists comma-separated, numbers and booleans parsed by the key's type),
then explicit overrides such as CLI flags. An unknown key, a wrong type or an impossible value is a
``DefinitionError`` whose ``where`` names the source and the key (``apomesh.toml $.nats.replicas``).
Relative paths in the config are relative to the directory the daemon starts in.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from apomesh.builtin.mcp_tools import McpServer, server_problems
from apomesh.core.errors import DefinitionError
from apomesh.runtime.protocol import DEFAULT_DAEMON_GONE_AFTER, DEFAULT_MAX_AGENTS

KIB: Final = 1024
MIB: Final = 1024 * KIB
GIB: Final = 1024 * MIB

ENV_PREFIX: Final = "APOMESH_"

Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]


class NatsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the event log lives: an embedded nats-server (no ``urls``) or an existing cluster."""

    urls: list[str] = []
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    embedded_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    embedded_store_dir: str = ""
    embedded_worker_credentials: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2
    server_binary: str = ""
    sync_interval: Literal["default", "always"] = "default"
    jetstream_domain: str = ""
    creds_file: str = ""
    nkey_seed_file: str = ""
    user: str = ""
    password: str = ""
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    control_user: str = ""
    control_password_file: str = ""
    control_nkey_seed_file: str = ""
    control_tls_cert: str = ""
    control_tls_key: str = ""
    connect_timeout: PositiveSeconds = 5.0
    jetstream_ready_timeout: PositiveSeconds = 60.0
    """Seconds ``serve`` waits at start for a connected server's JetStream to answer (a cluster
    elects its leaders after a restart or a pause of its nodes) before it stops with
    ``log_unavailable``."""
    reconnect_wait: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    ping_interval: PositiveSeconds = 5.0
    """Seconds between two pings of a connection's server."""
    max_pings_outstanding: Annotated[int, msgspec.Meta(ge=1, le=100)] = 2
    """Pings left unanswered before the connection is taken for stale and another server of
    ``urls`` is tried: a server that stops answering (frozen by a disk stall or a paused VM,
    its connection still open) is left within about (this + 1) x ``ping_interval`` seconds."""
    max_reconnect_attempts: Annotated[int, msgspec.Meta(ge=-1)] = -1

    @property
    def embedded(self) -> bool:
        """True when the daemon starts its own nats-server."""
        return not self.urls

    @property
    def has_control_identity(self) -> bool:
        """True when a control-plane identity is configured (``control_user`` or
        ``control_nkey_seed_file``) for the daemon's second connection."""
        return bool(self.control_user or self.control_nkey_seed_file)


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the daemon keeps its state and how many local workers it runs."""

    data_dir: str = ".apomesh"
    workspace: str = ""
    workers: Annotated[int, msgspec.Meta(ge=0)] = 2
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_timeout: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    lease_ttl: Annotated[float, msgspec.Meta(ge=1)] = 30.0
    """Seconds a daemon's presence record (which keeps its session leases) lives without
    renewal: how long a peer waits before it takes over the sessions of a daemon that died."""

    def data_path(self) -> Path:
        """``data_dir`` with ``~`` expanded, made absolute against the current directory."""
        return Path(self.data_dir).expanduser().absolute()

    def workspace_path(self) -> Path:
        """The local workers' workspace: ``workspace``, or ``<data_dir>/workspace`` when empty."""
        if self.workspace:
            return Path(self.workspace).expanduser().absolute()
        return self.data_path() / "workspace"


class HttpConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The REST API, SSE streams and operator console."""

    listen: str = "127.0.0.1:8750"
    tls_cert: str = ""
    tls_key: str = ""
    auth: Literal["on", "off"] = "on"
    token: str = ""
    allowed_hosts: list[str] = []
    trusted_proxies: list[str] = []
    keepalive_seconds: PositiveSeconds = 15.0
    max_body_bytes: Positive = 1 * MIB

    def host_port(self) -> tuple[str, int]:
        """``listen`` split into (host, port); an IPv6 host is written in brackets: ``[::1]:8750``."""
        return _split_listen(self.listen)

    def auth_required(self) -> bool:
        """Whether requests need a bearer token: yes unless ``auth = "off"``, on loopback too."""
        return self.auth == "on"

    def host_names(self) -> list[str]:
        """The ``Host`` header values the API answers: the listen host, the loopback names and
        ``allowed_hosts`` (``"*"`` allows any)."""
        names = [self.host_port()[0].strip("[]"), "127.0.0.1", "localhost", "::1"]
        return list(dict.fromkeys([*names, *self.allowed_hosts]))


FIRST_TOKEN_FILE = "http.token"
"""Where, in the data dir, a daemon's first start writes its operator token (mode 0600)."""


class LivenessConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How workers prove they are alive, and how much silence means one is lost."""

    heartbeat_interval: PositiveSeconds = 1.0
    missed_beats: Positive = 3

    @property
    def lost_after(self) -> float:
        """Seconds of silence after which a worker is declared lost."""
        return self.heartbeat_interval * self.missed_beats


class SnapshotsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How agent snapshots are stored."""

    compact_every: Positive = 32
    fold_checkpoint_every: Positive = 10_000
    """Events a session's writer appends between two checkpoints of its folded state."""
    fold_checkpoint_interval: PositiveSeconds = 1.0
    """Seconds at most between a session's append and the checkpoint of its folded state that
    covers it (all sessions changed meanwhile in one store write; again at shutdown): a restart
    reads a session whose checkpoint is current, not its events."""
    node_commit_delay: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.05
    """Seconds a node waits for the agent's next model turn: the worker holds its report that
    long for the turn's report to carry it (``Run.node_delay``, ``agent_loop.TurnRecorder``), and
    a node reported alone waits that long for its store write (``runtime.sessions.DeferredNode``);
    past that it is sent or stored alone. 0: every node is sent and stored at once."""


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Size ceilings on untrusted input; anything larger is refused with ``PayloadTooLarge``."""

    max_goal_bytes: Positive = 64 * KIB
    max_definition_bytes: Positive = 256 * KIB
    max_skill_bytes: Positive = 256 * KIB
    max_tool_args_bytes: Positive = 64 * KIB
    max_snapshot_bytes: Positive = 8 * MIB
    max_event_bytes: Positive = 1 * MIB


_DURATION_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h`` or ``30d`` in seconds (``ValueError`` otherwise)."""
    value = text.strip().lower()
    unit = _DURATION_UNITS.get(value[-1:], 0)
    number = value[:-1] if unit else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 12h or 30d") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


class RetentionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How long an ended session (completed, failed, cancelled) is kept before the daemon purges
    its log subject and its records: a duration (``30d``, ``12h``), or empty to keep them all."""

    ended_after: str = "30d"

    def __post_init__(self) -> None:
        if self.ended_after:
            parse_duration(self.ended_after)  # a ValueError here is the config's error

    @property
    def ended_after_seconds(self) -> float | None:
        return parse_duration(self.ended_after) if self.ended_after else None


class PluginsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which installed plugins (entry-point names) load: ``allow`` empty means all. ``tools``
    names Python tools to serve as well, each as ``module:object`` (``@apomesh.tool`` tools, a
    list of them or a ``ToolSet``; see docs/python.md)."""

    allow: list[str] = []
    block: list[str] = []
    tools: list[str] = []

    def permits(self, name: str) -> bool:
        return (not self.allow or name in self.allow) and name not in self.block


class WorkersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What workers registering with this daemon may run (empty lists mean everything installed),
    and how a worker runs: at most ``max_agents`` agents at once, and for how long it waits on a
    daemon that stopped answering a dispatch's reports."""

    allowed_tools: list[str] = []
    allowed_providers: list[str] = []
    max_agents: Positive = DEFAULT_MAX_AGENTS
    daemon_gone_after: PositiveSeconds = DEFAULT_DAEMON_GONE_AFTER


class ProviderCredential(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One endpoint a worker's model provider may call, and the variable holding its key."""

    base_url: str
    api_key_env: str = ""


def _default_openai_credentials() -> dict[str, ProviderCredential]:
    return {
        "default": ProviderCredential(
            base_url="https://api.openai.com/v1", api_key_env="OPENAI_API_KEY"
        )
    }


class OpenAIProviderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``openai`` provider's named credentials; a definition can only name one of these."""

    credentials: dict[str, ProviderCredential] = msgspec.field(
        default_factory=_default_openai_credentials
    )


def _default_anthropic_credentials() -> dict[str, ProviderCredential]:
    return {
        "default": ProviderCredential(
            base_url="https://api.anthropic.com/v1", api_key_env="ANTHROPIC_API_KEY"
        )
    }


class AnthropicProviderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``anthropic`` provider's named credentials; a definition can only name one of these."""

    credentials: dict[str, ProviderCredential] = msgspec.field(
        default_factory=_default_anthropic_credentials
    )


class ProvidersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where this process's model providers may send requests and with which keys. Set in the
    config file only (a table of tables has no environment-variable form)."""

    openai: OpenAIProviderConfig = OpenAIProviderConfig()
    anthropic: AnthropicProviderConfig = AnthropicProviderConfig()


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The LMDB store under the data dir (snapshots, tool-call journal, completed index) and, in a
    cluster deployment, the replicated JetStream bucket behind it (``replicated``)."""

    map_size: Annotated[int, msgspec.Meta(ge=1 * MIB)] = 1 * GIB
    sync: bool = True
    replicated: Literal["auto", "on", "off"] = "auto"
    replica_timeout: Annotated[float, msgspec.Meta(gt=0)] = 5.0

    def replicated_with(self, nats_urls: Sequence[str]) -> bool:
        """Whether the store writes through to the replicated bucket: ``auto`` is on when the
        daemon is given external NATS URLs (a cluster deployment), off on the embedded server."""
        if self.replicated == "auto":
            return bool(nats_urls)
        return self.replicated == "on"


class SkillsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where skills come from besides the catalog: resolved in the order catalog, ``directory``,
    then the skill-resolver plugins."""

    directory: str = ""

    def directory_path(self) -> Path | None:
        """``directory`` made absolute, or None when no directory is configured."""
        return Path(self.directory).expanduser().absolute() if self.directory else None


class LogConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How ``serve`` and ``worker`` write their log lines (the level is ``[daemon] log_level``)."""

    format: Literal["text", "json"] = "text"


class TracingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenTelemetry traces of sessions (``runtime.tracing``): where spans go, if anywhere."""

    exporter: Literal["off", "otlp", "console", "global"] = "off"
    endpoint: str = ""
    service_name: str = ""
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class McpConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The MCP servers whose tools workers offer (``[mcp.servers.<name>]``, see docs/tools.md):
    a worker connects to each and offers its tools as ``<name>.<tool>``; the daemon accepts those
    names in a definition. Set in the config file only."""

    servers: dict[str, McpServer] = {}


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole daemon configuration; ``Config()`` is every default."""

    nats: NatsConfig = NatsConfig()
    daemon: DaemonConfig = DaemonConfig()
    http: HttpConfig = HttpConfig()
    liveness: LivenessConfig = LivenessConfig()
    snapshots: SnapshotsConfig = SnapshotsConfig()
    limits: LimitsConfig = LimitsConfig()
    plugins: PluginsConfig = PluginsConfig()
    workers: WorkersConfig = WorkersConfig()
    providers: ProvidersConfig = ProvidersConfig()
    store: StoreConfig = StoreConfig()
    skills: SkillsConfig = SkillsConfig()
    log: LogConfig = LogConfig()
    tracing: TracingConfig = TracingConfig()
    retention: RetentionConfig = RetentionConfig()
    mcp: McpConfig = McpConfig()

    def nats_store_path(self) -> Path:
        """Where the embedded nats-server keeps JetStream: ``embedded_store_dir`` or
        ``<data_dir>/nats``."""
        if self.nats.embedded_store_dir:
            return Path(self.nats.embedded_store_dir).expanduser().absolute()
        return self.daemon.data_path() / "nats"


SECTIONS: Final[dict[str, type[msgspec.Struct]]] = {
    "nats": NatsConfig,
    "daemon": DaemonConfig,
    "http": HttpConfig,
    "liveness": LivenessConfig,
    "snapshots": SnapshotsConfig,
    "limits": LimitsConfig,
    "plugins": PluginsConfig,
    "workers": WorkersConfig,
    "providers": ProvidersConfig,
    "store": StoreConfig,
    "skills": SkillsConfig,
    "log": LogConfig,
    "tracing": TracingConfig,
    "retention": RetentionConfig,
    "mcp": McpConfig,
}


def sample_config() -> str:
    """The text of the fully commented sample configuration (every key at its default)."""
    return (resources.files("apomesh") / "conf" / "apomesh.toml").read_text(encoding="utf-8")


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """The configuration from ``path`` (TOML; ``None`` for none), then ``env``, then ``overrides``.

    ``overrides`` is nested like the file (``{"nats": {"urls": [...]}}``); a ``None`` value means
    "not given" and is skipped, so CLI flags can be passed straight through. Environment variables
    whose section is not a config section (``APOMESH_URL``) are not config and are ignored; an
    unknown key in a known section is an error like any other.
    """
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[tuple[str, ...], str] = {}
    file_label = str(path) if path is not None else "config"

    if path is not None:
        _merge_file(path, merged, sources)
    _merge_env(env, merged, sources)
    if overrides:
        _merge_overrides(overrides, merged, sources)

    try:
        config = msgspec.convert(merged, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise _located_error(str(exc), sources, file_label) from None
    _check_consistency(config, sources, file_label)
    return config


# -- layering -----------------------------------------------------------------------------------


def _merge_file(
    path: Path, merged: dict[str, dict[str, Any]], sources: dict[tuple[str, ...], str]
) -> None:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise DefinitionError(
            f"cannot read the config file: {exc.strerror}", where=str(path)
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionError(f"not valid TOML: {exc}", where=str(path)) from None
    for section, table in data.items():
        sources[(section,)] = str(path)
        if not isinstance(table, dict):
            # Left for msgspec to reject with the section's expected type in the message.
            merged[section] = table
            continue
        merged.setdefault(section, {}).update(table)
        for key in table:
            sources[(section, key)] = str(path)


def _merge_env(
    env: Mapping[str, str], merged: dict[str, dict[str, Any]], sources: dict[tuple[str, ...], str]
) -> None:
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        if section not in SECTIONS:
            continue
        fields = {field.name: field for field in _section_fields(section)}
        if section == "providers":
            raise DefinitionError("[providers] is set in the config file only", where=f"env {name}")
        if key not in fields:
            raise DefinitionError(
                f"unknown setting; [{section}] has {', '.join(sorted(fields))}",
                where=f"env {name}",
            )
        value = _parse_env_value(env[name], fields[key].type, where=f"env {name} $.{section}.{key}")
        table = merged.setdefault(section, {})
        if not isinstance(table, dict):
            continue  # the file's broken section is reported by msgspec
        table[key] = value
        sources[(section, key)] = f"env {name}"


def _merge_overrides(
    overrides: Mapping[str, Mapping[str, Any]],
    merged: dict[str, dict[str, Any]],
    sources: dict[tuple[str, ...], str],
) -> None:
    for section, table in overrides.items():
        if not isinstance(table, Mapping):
            raise DefinitionError("expected a table of keys", where=f"overrides $.{section}")
        given = {key: value for key, value in table.items() if value is not None}
        if not given:
            continue
        target = merged.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        target.update(given)
        for key in given:
            sources[(section, key)] = "overrides"


def _section_fields(section: str) -> tuple[msgspec.inspect.Field, ...]:
    info = msgspec.inspect.type_info(SECTIONS[section])
    assert isinstance(info, msgspec.inspect.StructType)
    return info.fields


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_env_value(raw: str, kind: msgspec.inspect.Type, *, where: str) -> Any:
    """An environment string as the value the field's type wants (msgspec then validates it)."""
    text = raw.strip()
    try:
        if isinstance(kind, msgspec.inspect.ListType):
            return [item.strip() for item in text.split(",") if item.strip()]
        if isinstance(kind, msgspec.inspect.BoolType):
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("expected true/false, yes/no, on/off or 1/0")
        if isinstance(kind, msgspec.inspect.IntType):
            return int(text)
        if isinstance(kind, msgspec.inspect.FloatType):
            return float(text)
    except ValueError as exc:
        raise DefinitionError(f"cannot read {raw!r}: {exc}", where=where) from None
    return raw


# -- errors -------------------------------------------------------------------------------------

_MSGSPEC_ERROR = re.compile(r"^(?P<message>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN_FIELD = re.compile(r"unknown field `(?P<field>[^`]+)`")


def _located_error(text: str, sources: dict[tuple[str, ...], str], default: str) -> DefinitionError:
    """A msgspec validation message turned into a ``DefinitionError`` naming source and key."""
    match = _MSGSPEC_ERROR.match(text)
    message, path = (match["message"], match["path"] or "$") if match else (text, "$")
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown:
        path = f"{path}.{unknown['field']}"
        message = "unknown key"
    parts = tuple(re.sub(r"\[\d+\]", "", part) for part in path.split(".")[1:3])
    source = sources.get(parts) or sources.get(parts[:1]) or default
    return DefinitionError(message, where=f"{source} {path}")


def _fail(
    message: str, section: str, key: str, sources: dict[tuple[str, ...], str], default: str
) -> DefinitionError:
    source = sources.get((section, key), default)
    return DefinitionError(message, where=f"{source} $.{section}.{key}")


_LISTEN = re.compile(r"^(?:\[(?P<ipv6>[^\]]+)\]|(?P<host>[^:\[\]]+)):(?P<port>\d{1,5})$")


def _split_listen(listen: str) -> tuple[str, int]:
    match = _LISTEN.match(listen)
    if not match or int(match["port"]) > 65535:
        raise ValueError(f"{listen!r} is not HOST:PORT (an IPv6 host in brackets: [::1]:8750)")
    return match["ipv6"] or match["host"], int(match["port"])


def _check_consistency(config: Config, sources: dict[tuple[str, ...], str], default: str) -> None:
    """Rules that span a value's meaning, beyond what each field's type can say."""
    try:
        _split_listen(config.http.listen)
    except ValueError as exc:
        raise _fail(str(exc), "http", "listen", sources, default) from None
    for section, prefix, cert, key in (
        ("http", "", config.http.tls_cert, config.http.tls_key),
        ("nats", "", config.nats.tls_cert, config.nats.tls_key),
        ("nats", "control_", config.nats.control_tls_cert, config.nats.control_tls_key),
    ):
        if bool(cert) != bool(key):
            missing = prefix + ("tls_key" if cert else "tls_cert")
            raise _fail(
                f"{prefix}tls_cert and {prefix}tls_key go together",
                section,
                missing,
                sources,
                default,
            )
    for name, problem in server_problems(config.mcp.servers):
        where = f"{sources.get(('mcp', 'servers'), default)} $.mcp.servers.{name}"
        raise DefinitionError(problem, where=where)
    endpoint = config.tracing.endpoint
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise _fail(
            f"endpoint {endpoint!r} is not an http(s) URL", "tracing", "endpoint", sources, default
        )
    provider_credentials = [
        ("openai", config.providers.openai.credentials),
        ("anthropic", config.providers.anthropic.credentials),
    ]
    for provider, name, credential in (
        (provider, name, credential)
        for provider, credentials in provider_credentials
        for name, credential in credentials.items()
    ):
        where = (
            f"{sources.get(('providers', provider), default)}"
            f" $.providers.{provider}.credentials.{name}"
        )
        if not credential.base_url.startswith(("http://", "https://")):
            raise DefinitionError(
                f"base_url {credential.base_url!r} is not an http(s) URL", where=where + ".base_url"
            )
        if credential.api_key_env.upper().startswith(ENV_PREFIX):
            raise DefinitionError(
                f"api_key_env {credential.api_key_env!r} is one of apomesh's own variables"
                f" ({ENV_PREFIX}*), never a model key",
                where=where + ".api_key_env",
            )
