"""pytest fixtures for testing apomesh and apomesh plugins against real parts.

Installed as the pytest plugin ``apomesh`` (entry point ``pytest11``), so a plugin package's tests
can ask for these fixtures by name. Every server is a real ``nats-server`` process on free
127.0.0.1 ports with its store in a temporary directory, stopped at teardown.

NATS servers:
    ``nats_server``        one JetStream node shared by a test module (a ``NatsServer``)
    ``nats_url``           its client URL, started again first if an earlier test killed it
    ``fresh_nats_server``  a node of the test's own, empty, that it may kill and restart
    ``nats_cluster``       three JetStream peers shared by a module, ready for R3 streams
                           (a ``NatsCluster``: a list of ``NatsServer`` with ``.urls``)
    ``nats_hub_leaf``      a JetStream hub and a leaf node linked to it, ``(hub, leaf)``

Importing this module stays cheap (pytest loads it in every run where apomesh is installed): the
server machinery is imported inside the fixtures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from apomesh.adapters.natsserver import NatsCluster, NatsServer

__all__ = [
    "fresh_nats_server",
    "nats_cluster",
    "nats_hub_leaf",
    "nats_server",
    "nats_url",
]

_T = TypeVar("_T")


def _run_in_own_loop(coroutine_function: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine from a synchronous fixture, on an event loop in a thread of its own (the
    test's thread may hold anyio's test runner, which forbids a second loop there)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, coroutine_function()).result()


# --------------------------------------------------------------------------------------------
# NATS servers


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A single JetStream node shared by the test module. A test that kills it should start it
    again (``nats_server.start()``) or use ``fresh_nats_server`` instead."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(single_node(tmp_path_factory.mktemp("nats")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """The module's ``nats_server`` URL, the server running (started again on the same store if
    an earlier test left it killed)."""
    if not nats_server.running:
        nats_server.start()
    return nats_server.url


@pytest.fixture
def fresh_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A single JetStream node of the test's own with an empty store; the test may kill it and
    start it again on the same ports and store."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(single_node(tmp_path_factory.mktemp("fresh-nats")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Three JetStream peers routed to each other, shared by the test module, ready for
    three-replica streams: a list of ``NatsServer`` with ``.urls``."""
    from apomesh.adapters.natsserver import cluster, start_cluster, wait_jetstream_ready

    servers = start_cluster(cluster(tmp_path_factory.mktemp("nats-cluster"), 3))
    try:
        _run_in_own_loop(lambda: wait_jetstream_ready(servers.urls, replicas=3))
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def nats_hub_leaf(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[NatsServer, NatsServer]]:
    """``(hub, leaf)``: a JetStream hub (JetStream domain ``hub``) and a leaf node without
    JetStream linked to it. Core NATS publishes, subscriptions and request/reply cross the link."""
    from apomesh.adapters.natsserver import NatsServer, hub_and_leaf

    hub_spec, leaf_spec = hub_and_leaf(tmp_path_factory.mktemp("nats-hub-leaf"))
    hub = NatsServer(hub_spec)
    leaf = NatsServer(leaf_spec)
    try:
        hub.start()
        leaf.start()
        leaf.wait_leafnode_connected()
        hub.wait_leafnode_connected()
        yield hub, leaf
    finally:
        leaf.stop()
        hub.stop()


# --------------------------------------------------------------------------------------------
# Daemon (to come: an `apomesh serve` node and workers on top of the servers above)
