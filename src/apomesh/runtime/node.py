"""``apomesh serve`` assembled: the embedded nats-server (unless ``--nats`` URLs are given), the NATS
connection, the event log, heartbeat stream and KV buckets, the LMDB store, the plugin host, the
daemon, its local in-process workers and the HTTP API.

``Node`` is an async context manager; ``start`` brings the parts up in dependency order and
``aclose`` takes them down in reverse, so a SIGTERM leaves nothing acknowledged behind: every event
is on the log before it is acknowledged and snapshots are written at each node boundary.

The data dir is private (``private_dir``: created 0700; one owned by another user or writable by
others is refused with ``UnsafeDataDir``). The embedded nats-server admits only the users of
``EmbeddedCredentials``, made afresh at every start: the daemon (its role's permissions), each
in-process worker under its own worker id, and ``[nats] embedded_worker_credentials`` identities
for worker processes, each written as a config file ``<data_dir>/credentials/worker-<n>.toml``
(0600) that ``apomesh worker --config FILE`` joins with, and the control-plane user. An
unauthenticated client is refused.

The daemon answers workers and dispatches to them on a second connection, logged in as the
control-plane identity (``control_nats_options``: ``[nats] control_*``, or the embedded server's
control user), whose permissions exclude JetStream, the KV buckets and the log. Without such an
identity on an external NATS, the daemon's own connection does that work, and a warning says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.kv import KvBuckets
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.nats_connect import connect, redact_url, tls_context
from apomesh.adapters.natsserver import NatsUser, embedded_server
from apomesh.adapters.private_files import private_dir, read_private_file, write_private_file
from apomesh.builtin.openai_model import PROVIDER_NAME as OPENAI_PROVIDER
from apomesh.builtin.openai_model import Credential, OpenAIProvider
from apomesh.builtin.skills import DirectorySkillResolver
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import SkillResolver
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.catalog import Catalog
from apomesh.runtime.config import Config
from apomesh.runtime.daemon import Daemon
from apomesh.runtime.nats_permissions import CONTROL_INBOX_PREFIX, apomesh_account
from apomesh.runtime.protocol import new_worker_id, worker_inbox_prefix
from apomesh.runtime.service import Service
from apomesh.runtime.worker import Worker

log = logging.getLogger("apomesh.node")

HttpStarter = Callable[[Service, Config], Awaitable[Any]]
"""Starts the HTTP API for a node (``apomesh.api.server.serve_api``); answers a handle with
``url`` and ``async stop()``. The command line passes it in, so this layer never imports the API."""


def nats_options(config: Config) -> dict[str, Any]:
    """Connection options from the ``[nats]`` section (credentials never come from argv)."""
    n = config.nats
    options: dict[str, Any] = {
        "connect_timeout": n.connect_timeout,
        "reconnect_wait": n.reconnect_wait,
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


def _secret() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class EmbeddedCredentials:
    """The users of one start of the embedded server, passwords fresh from ``secrets``: the
    daemon, its control-plane connection, the in-process workers and the worker processes (both
    keyed by worker id), each with its role's permissions (``apomesh.runtime.nats_permissions``)."""

    daemon: NatsUser
    control: NatsUser
    local_workers: dict[str, NatsUser]
    remote_workers: dict[str, NatsUser]

    @classmethod
    def generate(cls, local_ids: list[str], remote_count: int) -> EmbeddedCredentials:
        def user(name: str) -> NatsUser:
            return NatsUser(user=name, password=_secret())

        return cls(
            daemon=user(EMBEDDED_DAEMON_USER),
            control=user(EMBEDDED_CONTROL_USER),
            local_workers={worker_id: user(worker_id) for worker_id in local_ids},
            remote_workers={f"worker-{n}": user(f"worker-{n}") for n in range(1, remote_count + 1)},
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
                f"# NATS credentials of worker {worker_id} for this start of the embedded server"
                " (they change at every start).\n"
                "# Run: apomesh worker --config THIS_FILE\n"
                f"[nats]\nurls = [{json.dumps(url)}]\nuser = {json.dumps(user.user)}\n"
                f"password = {json.dumps(user.password)}\n"
            )
            write_private_file(path, text.encode())
            written.append(path)
        return written


def configured_skill_resolvers(config: Config) -> list[SkillResolver]:
    """The skill resolvers the configuration names, asked after the catalog and before the
    resolver plugins: the ``[skills] directory``, when one is set."""
    directory = config.skills.directory_path()
    return [DirectorySkillResolver(directory)] if directory is not None else []


def make_plugin_host(config: Config) -> PluginHost:
    """The plugins ``[plugins]`` allows, with the built-in ``openai`` provider given the
    ``[providers.openai]`` credentials (the only endpoints and keys its models may use)."""
    host = PluginHost(allow=config.plugins.allow or None, block=config.plugins.block or None)
    openai = host.model_providers().get(OPENAI_PROVIDER)
    if isinstance(openai, OpenAIProvider):
        openai.use_credentials(
            {
                name: Credential(base_url=c.base_url, api_key_env=c.api_key_env)
                for name, c in config.providers.openai.credentials.items()
            }
        )
    return host


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
    )
    await worker.start()
    return nc, worker


class Node:
    """One ``apomesh serve`` process."""

    def __init__(self, config: Config, *, http: HttpStarter | bool | None = None) -> None:
        self.config = config
        self.http = http
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

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        config = self.config
        data = private_dir(config.daemon.data_path())
        local_ids = [f"local-{os.getpid()}-{i}" for i in range(config.daemon.workers)]
        daemon_options = nats_options(config)
        control_options = control_nats_options(config)
        if config.nats.urls:
            self.urls = list(config.nats.urls)
        else:
            self.credentials = EmbeddedCredentials.generate(
                local_ids, config.nats.embedded_worker_credentials
            )
            self.server = embedded_server(config, users=self.credentials.users())
            await asyncio.to_thread(self.server.start)
            self.urls = [self.server.url]
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
        self.nc = await connect(
            self.urls, name=f"apomesh-daemon-{socket.gethostname()}", **daemon_options
        )
        if control_options is None:
            log.warning(
                "no control-plane identity in [nats] (control_user or control_nkey_seed_file):"
                " worker requests are answered, and dispatches sent, on the daemon's own"
                " connection, with its JetStream rights"
            )
        else:
            self.control_nc = await connect(
                self.urls,
                name=f"apomesh-control-{socket.gethostname()}",
                **control_options,
            )
        js = self.nc.jetstream()
        replicas = config.nats.replicas
        log_adapter = JetStreamLog(
            self.nc,
            replicas=replicas,
            sync_always=config.nats.sync_interval == "always",
            max_event_bytes=config.limits.max_event_bytes,
        )
        heartbeats = HeartbeatStream(self.nc, replicas=replicas)
        kv = await KvBuckets.open(js, replicas)
        self.store = AsyncStore(
            LmdbStore(data / "lmdb", map_size=config.store.map_size, sync=config.store.sync)
        )
        plugins = make_plugin_host(config)
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
        )
        for worker_id in local_ids:
            user = self.credentials.local_workers[worker_id] if self.credentials else None
            self.workers.append(
                await start_local_worker(
                    self.urls, config, plugins, name=worker_id, workspace=workspace, user=user
                )
            )
        await self.daemon.start()
        if self.http:
            assert callable(self.http) and self.service is not None
            self._http_endpoint = await self.http(self.service, config)
            self.http_url = self._http_endpoint.url

    async def aclose(self) -> None:
        if self._http_endpoint is not None:
            await self._http_endpoint.stop()
        if self.daemon is not None:
            await self.daemon.aclose()
        for nc, worker in self.workers:
            await worker.aclose()
            with contextlib.suppress(Exception):
                await nc.close()
        for nc in (self.control_nc, self.nc):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.drain()
        if self.store is not None:
            await self.store.aclose()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
