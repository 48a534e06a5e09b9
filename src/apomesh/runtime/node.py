"""``apomesh serve`` assembled: the embedded nats-server (unless ``--nats`` URLs are given), the NATS
connection, the event log, heartbeat stream and KV buckets, the LMDB store, the plugin host, the
daemon, its local in-process workers and the HTTP API.

``Node`` is an async context manager; ``start`` brings the parts up in dependency order and
``aclose`` takes them down in reverse, so a SIGTERM leaves nothing acknowledged behind: every event
is on the log before it is acknowledged and snapshots are written at each node boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.kv import KvBuckets
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.nats_connect import connect, tls_context
from apomesh.adapters.natsserver import embedded_server
from apomesh.builtin.skills import DirectorySkillResolver
from apomesh.plugins.api import SkillResolver
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.catalog import Catalog
from apomesh.runtime.config import Config
from apomesh.runtime.daemon import Daemon
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


def configured_skill_resolvers(config: Config) -> list[SkillResolver]:
    """The skill resolvers the configuration names, asked after the catalog and before the
    resolver plugins: the ``[skills] directory``, when one is set."""
    directory = config.skills.directory_path()
    return [DirectorySkillResolver(directory)] if directory is not None else []


def make_plugin_host(config: Config) -> PluginHost:
    return PluginHost(allow=config.plugins.allow or None, block=config.plugins.block or None)


async def start_local_worker(
    urls: list[str], config: Config, plugins: PluginHost, *, name: str, workspace: Path
) -> tuple[Any, Worker]:
    nc = await connect(urls, name=f"apomesh-worker-{name}", **nats_options(config))
    worker = Worker(
        nc,
        tools=plugins.tools(),
        providers=plugins.model_providers(),
        supervisors=list(plugins.supervisor_policies().values()),
        workspace=workspace,
        name=name,
        heartbeat_interval=config.liveness.heartbeat_interval,
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
        self.store: AsyncStore | None = None
        self.daemon: Daemon | None = None
        self.service: Service | None = None
        self.workers: list[tuple[Any, Worker]] = []
        self.urls: list[str] = []
        self._http_endpoint: Any = None
        self.http_url = ""

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        config = self.config
        data = config.daemon.data_path()
        data.mkdir(parents=True, exist_ok=True)
        if config.nats.urls:
            self.urls = list(config.nats.urls)
        else:
            self.server = embedded_server(config)
            await asyncio.to_thread(self.server.start)
            self.urls = [self.server.url]
            log.info(
                "embedded nats-server at %s (store %s)", self.server.url, config.nats_store_path()
            )
        self.nc = await connect(
            self.urls, name=f"apomesh-daemon-{socket.gethostname()}", **nats_options(config)
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
        for i in range(config.daemon.workers):
            self.workers.append(
                await start_local_worker(
                    self.urls, config, plugins, name=f"local-{os.getpid()}-{i}", workspace=workspace
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
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.drain()
        if self.store is not None:
            await self.store.aclose()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
