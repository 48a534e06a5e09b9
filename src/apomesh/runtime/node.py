"""``apomesh serve`` assembled: the embedded nats-server (unless ``--nats`` URLs are given), the NATS
connection, the event log, heartbeat stream and KV buckets, the state store (LMDB, written through
to the replicated ``APOMESH_STATE`` bucket per ``[store] replicated``: ``open_state_store``), the
plugin host, the daemon, its local in-process workers and the HTTP API.

``Node`` is an async context manager (``apomesh serve``'s, and ``apomesh.local()``'s in a script,
which hands it its Python tool sets as ``extra_plugins``); ``start`` brings the parts up in
dependency order and ``aclose`` takes them down in reverse, so a SIGTERM leaves nothing
acknowledged behind: every event is on the log before it is acknowledged and snapshots are written
at each node boundary.

The data dir is private (``private_dir``: created 0700; one owned by another user or writable by
others is refused with ``UnsafeDataDir``) and one daemon's: before anything else (the embedded
server, LMDB, any file) ``start`` locks it (``lock_dir`` on ``<data_dir>/daemon.lock``, which
names the holder's pid), and a second ``Node`` on it, in this process or another, stops with
``DataDirInUse`` having touched nothing; an embedded store dir outside the data dir is locked
the same way. The kernel drops the lock of a killed daemon, so its data dir serves again at once.

The embedded nats-server admits only the users of ``EmbeddedCredentials``: the daemon (its
role's permissions), each in-process worker under its own worker id and the control-plane user,
all made afresh at every start, and ``[nats] embedded_worker_credentials`` identities for worker
processes, each written as a config file ``<data_dir>/credentials/worker-<n>.toml`` (0600) that
``apomesh worker --config FILE`` joins with; those keep their password from start to start (a
deleted file gets a new one). The server keeps its client port too: the port of its first start
(``[nats] embedded_port``, else a free one) is kept in ``<data_dir>/nats.port`` and used at every
later start, so worker processes reconnect by themselves after a restart; a port another process
took meanwhile is refused with ``PortTaken`` naming it, never swapped for another. An
unauthenticated client is refused.

The daemon answers workers and dispatches to them on a second connection, logged in as the
control-plane identity (``control_nats_options``: ``[nats] control_*``, or the embedded server's
control user), whose permissions exclude JetStream, the KV buckets and the log. Without such an
identity on an external NATS, the daemon's own connection does that work, and a warning says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
import socket
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.kv import KvBuckets
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.nats_connect import JetStreamWait, connect, redact_url, tls_context
from apomesh.adapters.natsserver import NatsUser, PortTaken, embedded_server
from apomesh.adapters.private_files import (
    DirLock,
    lock_dir,
    private_dir,
    read_private_file,
    write_private_file,
)
from apomesh.adapters.replicated_store import STATE_BUCKET, ReplicatedStore
from apomesh.builtin.anthropic_model import PROVIDER_NAME as ANTHROPIC_PROVIDER
from apomesh.builtin.openai_model import PROVIDER_NAME as OPENAI_PROVIDER
from apomesh.builtin.openai_model import Credential, OpenAIProvider
from apomesh.builtin.skills import DirectorySkillResolver
from apomesh.core.errors import DefinitionError, StoreError
from apomesh.core.ports import StateStore
from apomesh.plugins.api import SkillResolver
from apomesh.plugins.manager import PluginHost
from apomesh.plugins.python_tools import load_tool_sets
from apomesh.runtime.catalog import Catalog
from apomesh.runtime.config import Config
from apomesh.runtime.daemon import Daemon
from apomesh.runtime.nats_permissions import CONTROL_INBOX_PREFIX, apomesh_account
from apomesh.runtime.protocol import new_worker_id, worker_inbox_prefix
from apomesh.runtime.service import Service
from apomesh.runtime.worker import Worker

log = logging.getLogger("apomesh.node")

SLOW_SHUTDOWN_MARGIN = 20.0
"""Seconds past ``[daemon] shutdown_timeout`` after which a shutdown still going logs what it is
waiting on."""


def _where(task: asyncio.Task[Any]) -> str:
    """The innermost coroutine frame a pending task is suspended in, ``file:line in function``
    (followed down its ``await`` chain: a task's own stack shows only its outermost frame)."""
    awaited: Any = task.get_coro()
    where = "not started"
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            break
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return where


HttpStarter = Callable[[Service, Config], Awaitable[Any]]
"""Starts the HTTP API for a node (``apomesh.api.server.serve_api``); answers a handle with
``url`` and ``async stop()``."""

HttpLoader = Callable[[], HttpStarter]
"""Imports the HTTP layer and answers its ``HttpStarter``. The command line passes it in, so this
layer never imports the API; ``Node`` calls it right after it spawns the embedded nats-server, so
the import (tens of ms) and the server's start overlap instead of following one another."""


def nats_options(config: Config) -> dict[str, Any]:
    """Connection options from the ``[nats]`` section (credentials never come from argv)."""
    n = config.nats
    options: dict[str, Any] = {
        "connect_timeout": n.connect_timeout,
        "reconnect_wait": n.reconnect_wait,
        "ping_interval": n.ping_interval,
        "max_pings_outstanding": n.max_pings_outstanding,
    }
    if n.creds_file:
        options["credentials"] = n.creds_file
    if n.nkey_seed_file:
        options["nkey_seed_file"] = n.nkey_seed_file
    if n.user:
        options["user"], options["password"] = n.user, n.password
    if n.token:
        options["token"] = n.token
    if n.tls_ca or n.tls_cert:
        options["tls"] = tls_context(
            ca_file=n.tls_ca or None, cert_file=n.tls_cert or None, key_file=n.tls_key or None
        )
    return options


def control_nats_options(config: Config) -> dict[str, Any] | None:
    """Options for the daemon's control-plane connection from ``[nats] control_*`` (the TLS CA,
    timeouts and, unless ``control_tls_cert`` is set, the client certificate shared with the
    daemon's own connection); ``None`` when no control identity is configured. An unreadable
    ``control_password_file`` is a ``DefinitionError`` naming it."""
    n = config.nats
    if not n.has_control_identity:
        return None
    options: dict[str, Any] = {
        "connect_timeout": n.connect_timeout,
        "reconnect_wait": n.reconnect_wait,
        "ping_interval": n.ping_interval,
        "max_pings_outstanding": n.max_pings_outstanding,
        "inbox_prefix": CONTROL_INBOX_PREFIX,
    }
    if n.control_nkey_seed_file:
        options["nkey_seed_file"] = n.control_nkey_seed_file
    if n.control_user:
        password = ""
        if n.control_password_file:
            try:
                password = read_private_file(Path(n.control_password_file)).decode().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise DefinitionError(
                    f"cannot read the control password file {n.control_password_file}: {exc}",
                    where="$.nats.control_password_file",
                ) from None
        options["user"], options["password"] = n.control_user, password
    cert, key = (
        (n.control_tls_cert, n.control_tls_key) if n.control_tls_cert else (n.tls_cert, n.tls_key)
    )
    if n.tls_ca or cert:
        options["tls"] = tls_context(
            ca_file=n.tls_ca or None, cert_file=cert or None, key_file=key or None
        )
    return options


EMBEDDED_DAEMON_USER = "apomesh-daemon"
EMBEDDED_CONTROL_USER = "apomesh-control"
CREDENTIALS_DIR = "credentials"
LOCK_FILE = "daemon.lock"
"""In the data dir (and in an embedded store dir outside it): the lock ``apomesh serve`` holds."""
PORT_FILE = "nats.port"
"""In the data dir: the embedded nats-server's client port, kept from its first start."""


def _secret() -> str:
    return secrets.token_urlsafe(32)


class EmbeddedCredentials(msgspec.Struct, frozen=True):
    """The users of one start of the embedded server, passwords fresh from ``secrets``: the
    daemon, its control-plane connection, the in-process workers and the worker processes (both
    keyed by worker id), each with its role's permissions (``apomesh.runtime.nats_permissions``)."""

    daemon: NatsUser
    control: NatsUser
    local_workers: dict[str, NatsUser]
    remote_workers: dict[str, NatsUser]

    @classmethod
    def generate(
        cls, local_ids: list[str], remote_count: int, kept: Mapping[str, str] | None = None
    ) -> EmbeddedCredentials:
        """Fresh passwords, but a worker process's from ``kept`` (worker id -> password, what
        ``kept_worker_passwords`` read) when it has one there."""
        kept = kept or {}

        def user(name: str, password: str = "") -> NatsUser:
            return NatsUser(user=name, password=password or _secret())

        remote_ids = [f"worker-{n}" for n in range(1, remote_count + 1)]
        return cls(
            daemon=user(EMBEDDED_DAEMON_USER),
            control=user(EMBEDDED_CONTROL_USER),
            local_workers={worker_id: user(worker_id) for worker_id in local_ids},
            remote_workers={w: user(w, kept.get(w, "")) for w in remote_ids},
        )

    def users(self) -> tuple[NatsUser, ...]:
        """Every user, with its permissions, as the embedded server's config lists them."""
        account = apomesh_account(
            daemon=self.daemon,
            control=self.control,
            workers={**self.local_workers, **self.remote_workers},
        )
        return account.users

    def write_worker_files(self, data_dir: Path, url: str) -> list[Path]:
        """One ``apomesh worker --config`` file per worker-process identity, in a 0700 dir under
        ``data_dir``, each 0600; answers their paths."""
        directory = private_dir(data_dir / CREDENTIALS_DIR)
        written = []
        for worker_id, user in self.remote_workers.items():
            path = directory / f"{worker_id}.toml"
            text = (
                f"# NATS credentials of worker {worker_id} for the embedded server (kept across"
                " restarts; delete this file to have a new password made at the next start).\n"
                "# Run: apomesh worker --config THIS_FILE\n"
                f"[nats]\nurls = [{json.dumps(url)}]\nuser = {json.dumps(user.user)}\n"
                f"password = {json.dumps(user.password)}\n"
            )
            write_private_file(path, text.encode())
            written.append(path)
        return written


def kept_worker_passwords(data_dir: Path) -> dict[str, str]:
    """The passwords of the worker-process identities an earlier start wrote to
    ``<data_dir>/credentials`` (worker id -> password); a file that is missing, unreadable or
    names another user is skipped, and its identity gets a new password."""
    kept: dict[str, str] = {}
    for path in sorted((data_dir / CREDENTIALS_DIR).glob("worker-*.toml")):
        try:
            section = tomllib.loads(read_private_file(path).decode("utf-8")).get("nats", {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
        user, password = section.get("user"), section.get("password")
        if user == path.stem and isinstance(password, str) and password:
            kept[user] = password
    return kept


def embedded_client_port(config: Config, data_dir: Path) -> int | None:
    """The embedded server's client port: ``[nats] embedded_port`` when set, else the one kept in
    ``<data_dir>/nats.port`` since the first start, else ``None`` (a free one is chosen). A port
    file that holds no port is a ``StoreError`` naming it."""
    if config.nats.embedded_port:
        return config.nats.embedded_port
    path = data_dir / PORT_FILE
    try:
        text = read_private_file(path).decode("ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(
            f"cannot read the embedded nats-server's port from {path}: {exc}"
        ) from None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise StoreError(
            f"{path} should hold the embedded nats-server's port, not {text[:40]!r}; delete it to"
            " have a free port chosen (worker processes then need the new URL)"
        )
    return int(text)


def configured_skill_resolvers(config: Config) -> list[SkillResolver]:
    """The skill resolvers the configuration names, asked after the catalog and before the
    resolver plugins: the ``[skills] directory``, when one is set."""
    directory = config.skills.directory_path()
    return [DirectorySkillResolver(directory)] if directory is not None else []


def make_plugin_host(config: Config, extra_plugins: Iterable[object] = ()) -> PluginHost:
    """The plugins ``[plugins]`` allows, the Python tool sets ``[plugins] tools`` names and
    ``extra_plugins`` (in-process plugin objects, such as ``ToolSet``s), with the built-in
    ``openai`` provider given the ``[providers.openai]`` and ``anthropic`` provider the
    ``[providers.anthropic]`` credentials (the only endpoints and keys their models may use)."""
    extra = [s for spec in config.plugins.tools for s in load_tool_sets(spec)]
    host = PluginHost(
        allow=config.plugins.allow or None,
        block=config.plugins.block or None,
        extra_plugins=[*extra, *extra_plugins],
    )
    host.tool_servers = frozenset(config.mcp.servers)
    providers = host.model_providers()
    for name, credentials in (
        (OPENAI_PROVIDER, config.providers.openai.credentials),
        (ANTHROPIC_PROVIDER, config.providers.anthropic.credentials),
    ):
        provider = providers.get(name)
        if isinstance(provider, OpenAIProvider):
            provider.use_credentials(
                {
                    key: Credential(base_url=c.base_url, api_key_env=c.api_key_env)
                    for key, c in credentials.items()
                }
            )
    return host


YOUNG_COLLECTIONS_AFTER = 10_000
"""Allocations (less deallocations) of container objects between two collections of the young
generation in a daemon or worker process; CPython's default is 700."""


def tune_collector() -> None:
    """Collect the young generation every ``YOUNG_COLLECTIONS_AFTER`` allocations instead of
    CPython's 700. A step of the standard workload adds tens of container objects to the
    collector's count, so at the default it ran every dozen steps or so, the middle generation
    every hundred or so and a walk of every long-lived object (30 to 45 ms once a thousand
    sessions had run) every thousand or two; at this threshold the young generation is
    collected a few times a thousand steps, for about 5 % less CPU a step (docs/performance.md,
    fifteenth round). Garbage in reference cycles is still collected, a little later. Never
    lowers a threshold the process set itself."""
    young, *older = gc.get_threshold()
    if young < YOUNG_COLLECTIONS_AFTER:
        gc.set_threshold(YOUNG_COLLECTIONS_AFTER, *older)


async def start_local_worker(
    urls: list[str],
    config: Config,
    plugins: PluginHost,
    *,
    name: str,
    workspace: Path,
    user: NatsUser | None = None,
) -> tuple[Any, Worker]:
    """An in-process worker on its own connection, with its own id and inbox like any worker (the
    daemon answers a worker only on its own inbox); with ``user`` (the embedded server) it logs in
    as that user and takes the user name as its worker id, so its permissions apply to it."""
    options = nats_options(config)
    worker_id = new_worker_id(name)
    if user is not None:
        worker_id = user.user
        options.update(user=user.user, password=user.password)
    options["inbox_prefix"] = worker_inbox_prefix(worker_id)
    nc = await connect(urls, name=f"apomesh-worker-{name}", **options)
    worker = Worker(
        nc,
        worker_id=worker_id,
        tools=plugins.tools(),
        providers=plugins.model_providers(),
        supervisors=list(plugins.supervisor_policies().values()),
        plugin_versions=plugins.installed_versions(),
        workspace=workspace,
        name=name,
        heartbeat_interval=config.liveness.heartbeat_interval,
        max_agents=config.workers.max_agents,
        daemon_gone_after=config.workers.daemon_gone_after,
        mcp_servers=config.mcp.servers,
    )
    await worker.start()
    return nc, worker


async def open_state_store(
    config: Config, data: Path, urls: list[str], connect_options: dict[str, Any]
) -> StateStore:
    """The daemon's state store: LMDB under the data dir, written through to the replicated
    ``APOMESH_STATE`` bucket when ``[store] replicated`` says so (see ``StoreConfig``)."""
    local = LmdbStore(data / "lmdb", map_size=config.store.map_size, sync=config.store.sync)
    if not config.store.replicated_with(config.nats.urls):
        return local
    try:
        store = await ReplicatedStore.open(
            local,
            urls,
            replicas=config.nats.replicas,
            timeout=config.store.replica_timeout,
            connect_options=connect_options,
        )
    except BaseException:
        local.close()
        raise
    log.info("state store: LMDB and the replicated bucket %s", STATE_BUCKET)
    return store


def _raise_first(results: Iterable[object]) -> None:
    """Raise the first exception among ``asyncio.gather(..., return_exceptions=True)`` results."""
    for result in results:
        if isinstance(result, BaseException):
            raise result


class Node:
    """One ``apomesh serve`` process."""

    def __init__(
        self,
        config: Config,
        *,
        http: HttpLoader | bool | None = None,
        extra_plugins: Iterable[object] = (),
    ) -> None:
        self.config = config
        self.http = http
        self.extra_plugins = list(extra_plugins)
        self.server: Any = None
        self.nc: Any = None
        self.control_nc: Any = None
        self.store: AsyncStore | None = None
        self.daemon: Daemon | None = None
        self.service: Service | None = None
        self.workers: list[tuple[Any, Worker]] = []
        self.urls: list[str] = []
        self.credentials: EmbeddedCredentials | None = None
        self.worker_credential_files: list[Path] = []
        self._http_endpoint: Any = None
        self.http_url = ""
        self._locks: list[DirLock] = []

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bring every part up; when one fails, what is already up is taken down again (the
        data dir's lock last) before the error goes on."""
        try:
            await self._start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.aclose()
            raise

    def _lock(self, directory: Path, what: str) -> None:
        self._locks.append(lock_dir(directory, LOCK_FILE, what=what, holder="apomesh serve"))

    async def _start(self) -> None:
        config = self.config
        tune_collector()
        data = private_dir(config.daemon.data_path())
        # First of all: a second daemon on this data dir must stop before it touches anything
        # (the embedded server's leftover cleanup would stop the first daemon's server).
        self._lock(data, "data dir")
        local_ids = [f"local-{os.getpid()}-{i}" for i in range(config.daemon.workers)]
        daemon_options = nats_options(config)
        control_options = control_nats_options(config)
        if config.nats.urls:
            self.urls = list(config.nats.urls)
        else:
            store_dir = config.nats_store_path()
            if not store_dir.is_relative_to(data):
                self._lock(private_dir(store_dir), "embedded nats-server store dir")
            port = embedded_client_port(config, data)
            self.credentials = EmbeddedCredentials.generate(
                local_ids, config.nats.embedded_worker_credentials, kept_worker_passwords(data)
            )
            self.server = embedded_server(config, users=self.credentials.users(), port=port)
            try:
                self.server.spawn()
            except PortTaken as exc:
                source = (
                    "set in [nats] embedded_port"
                    if config.nats.embedded_port
                    else f"its port since its first start, kept in {data / PORT_FILE}"
                )
                raise PortTaken(
                    f"the embedded nats-server's port {exc.port} ({source}, so worker processes"
                    " reconnect to it) is taken by another process; stop that process, or set"
                    " another [nats] embedded_port to move the server (worker processes then"
                    " need the new URL)",
                    port=exc.port,
                ) from None
        # Plugins next, while the embedded server starts: a tool set that cannot be loaded stops
        # the node before it connects to anything (its server, if spawned, is stopped again).
        plugins = make_plugin_host(config, self.extra_plugins)
        # Then the HTTP layer (~35 ms of imports), while the server boots on another core.
        http = self.http() if callable(self.http) else None
        if self.server is not None:
            assert self.credentials is not None
            await asyncio.to_thread(self.server.wait_ready)
            self.urls = [self.server.url]
            write_private_file(data / PORT_FILE, f"{self.server.spec.port}\n".encode())
            self.worker_credential_files = self.credentials.write_worker_files(
                data, self.server.url
            )
            daemon_user = self.credentials.daemon
            daemon_options.update(user=daemon_user.user, password=daemon_user.password)
            control_user = self.credentials.control
            control_options = {
                **nats_options(config),
                "user": control_user.user,
                "password": control_user.password,
                "inbox_prefix": CONTROL_INBOX_PREFIX,
            }
            log.info(
                "embedded nats-server at %s (store %s); worker credentials in %s",
                redact_url(self.server.url),
                config.nats_store_path(),
                data / CREDENTIALS_DIR,
            )
        host = socket.gethostname()
        if control_options is None:
            log.warning(
                "no control-plane identity in [nats] (control_user or control_nkey_seed_file):"
                " worker requests are answered, and dispatches sent, on the daemon's own"
                " connection, with its JetStream rights"
            )
            self.nc = await connect(self.urls, name=f"apomesh-daemon-{host}", **daemon_options)
        else:
            # Both connections at once: each handshake mostly waits on the server.
            connections = await asyncio.gather(
                connect(self.urls, name=f"apomesh-daemon-{host}", **daemon_options),
                connect(self.urls, name=f"apomesh-control-{host}", **control_options),
                return_exceptions=True,
            )
            # What connected is kept for ``aclose`` to close when the other failed.
            self.nc, self.control_nc = (
                None if isinstance(c, BaseException) else c for c in connections
            )
            _raise_first(connections)
        replicas = config.nats.replicas
        log_adapter = JetStreamLog(
            self.nc,
            replicas=replicas,
            sync_always=config.nats.sync_interval == "always",
            max_event_bytes=config.limits.max_event_bytes,
        )
        heartbeats = HeartbeatStream(self.nc, replicas=replicas)
        nc = self.nc
        # One wait for all the start keeps on JetStream (the daemon's streams too).
        jetstream = JetStreamWait(config.nats.jetstream_ready_timeout)
        kv = await jetstream.answered(
            lambda: KvBuckets.open(nc, replicas, lease_ttl=config.daemon.lease_ttl)
        )
        self.store = AsyncStore(
            await jetstream.answered(
                lambda: open_state_store(config, data, self.urls, daemon_options)
            )
        )
        workspace = config.daemon.workspace_path()
        workspace.mkdir(parents=True, exist_ok=True)
        self.daemon = Daemon(
            config,
            nc=self.nc,
            control_nc=self.control_nc,
            log_adapter=log_adapter,
            heartbeats=heartbeats,
            kv=kv,
            store=self.store,
            plugins=plugins,
            workspace=workspace,
            jetstream=jetstream,
        )
        daemon = self.daemon
        self.service = Service(
            registry=daemon.registry,
            workers=daemon.workers,
            plugins=plugins,
            log_adapter=log_adapter,
            store=self.store,
            catalog=Catalog(kv, plugins, resolvers=configured_skill_resolvers(config)),
            limits=config.limits,
            metrics=daemon.metrics,
            nc=self.nc,
            incarnation=daemon.incarnation,
            boot_report=lambda: daemon.boot_report,
            presence=daemon.presence,
            request_drain=daemon.request_drain,
            retention=daemon.retention,
            deltas=daemon.deltas,
        )
        started = await asyncio.gather(
            *(
                start_local_worker(
                    self.urls,
                    config,
                    plugins,
                    name=worker_id,
                    workspace=workspace,
                    user=self.credentials.local_workers[worker_id] if self.credentials else None,
                )
                for worker_id in local_ids
            ),
            return_exceptions=True,
        )
        self.workers.extend(w for w in started if not isinstance(w, BaseException))
        _raise_first(started)
        for _, worker in self.workers:
            # Dispatches to the in-process workers skip the NATS round trip (from the boot
            # scan's resumes on), and so do their reports to this daemon (once it has its id).
            self.daemon.workers.local_workers[worker.worker_id] = worker.take_dispatch
        await self.daemon.start()
        for _, worker in self.workers:
            link = self.daemon.control.local_link(worker.worker_id)
            worker.local_links[self.daemon.daemon_id] = link
        if http is not None:
            assert self.service is not None
            self._http_endpoint = await http(self.service, config)
            self.http_url = self._http_endpoint.url
            self.daemon.presence.url = self.http_url
            self.daemon.presence.nudge()

    async def aclose(self) -> None:
        stage = ["the HTTP API"]
        watchdog = asyncio.create_task(self._report_a_slow_shutdown(stage))
        try:
            if self._http_endpoint is not None:
                await self._http_endpoint.stop()
            stage[0] = "the daemon"
            if self.daemon is not None:
                await self.daemon.aclose()
            stage[0] = "the in-process workers"
            for nc, worker in self.workers:
                await worker.aclose()
                with contextlib.suppress(Exception):
                    await nc.close()
            stage[0] = "the NATS connections"
            for nc in (self.control_nc, self.nc):
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.drain()
            stage[0] = "the state store"
            if self.store is not None:
                await self.store.aclose()
            stage[0] = "the embedded nats-server"
            if self.server is not None:
                await asyncio.to_thread(self.server.stop)
        finally:
            watchdog.cancel()
            for lock in reversed(self._locks):
                lock.release()
            self._locks.clear()

    async def _report_a_slow_shutdown(self, stage: list[str]) -> None:
        """Once the shutdown has outlasted its grace period and then some, say what it waits on:
        the stage, and where each of the event loop's other tasks is."""
        await asyncio.sleep(self.config.daemon.shutdown_timeout + SLOW_SHUTDOWN_MARGIN)
        current = asyncio.current_task()
        waiting = [
            f"{task.get_name()}: {_where(task)}"
            for task in asyncio.all_tasks()
            if task is not current and not task.done()
        ]
        log.warning(
            "shutdown still waiting on %s after %g s; tasks: %s",
            stage[0],
            self.config.daemon.shutdown_timeout + SLOW_SHUTDOWN_MARGIN,
            "; ".join(waiting) or "none",
        )
