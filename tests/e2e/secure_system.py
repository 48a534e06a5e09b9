"""A production-shaped deployment for the security and limits tests, built from real processes.

``SecureSystem.build(base)`` makes a CA and certificates, then starts:

- a 3-node JetStream cluster with mutual TLS on client connections and routes, one account
  (``APOMESH``) whose users are the daemon, the workers and an operator, each with the subject
  permissions of its role (``apomesh.runtime.nats_permissions``), and a leaf-node listener on
  every peer that admits only the ``leaf`` login, over TLS. Client and leaf-node listeners map
  certificates to users (``verify_and_map``): each login presents its own certificate (a DNS SAN
  naming the user, ``Pki.client(name)``) and its password, and neither works without the other;
- a leaf node (no JetStream) linked to all three peers with that login, serving edge workers
  with their own credentials (an NKey user) and the same role permissions;
- ``apomesh serve`` (no local workers, replicas 3) authenticating as ``daemon`` with a client
  certificate, and answering workers on a second connection as ``control`` (its own certificate,
  the password in a 0600 file), its API on HTTPS with bearer-token auth on, and tokens made with
  ``apomesh tokens create`` before it starts;
- worker processes: ``worker-a`` on the cluster (user and password) and ``edge-1`` behind the
  leaf node (NKey seed file).

Every secret is random and kept in ``secrets`` so a test can look for it in the log files; no
secret is ever passed on a command line (they go through ``APOMESH_NATS_*`` variables).
"""

from __future__ import annotations

import os
import secrets
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from msgspec.structs import replace
from tests.e2e.certs import Pki, make_nkey_user, make_pki

from apomesh.adapters.nats_connect import tls_context
from apomesh.adapters.natsserver import (
    Account,
    LeafRemote,
    NatsCluster,
    NatsServer,
    NatsUser,
    ServerSpec,
    TlsConfig,
    cluster,
    free_ports,
    start_cluster,
    wait_jetstream_ready,
)
from apomesh.runtime.nats_permissions import (
    ACCOUNT,
    apomesh_account,
    worker_permissions,
)
from apomesh.testing import DaemonProcess, WorkerProcess, _run_in_own_loop

HEARTBEAT = "0.3"


@dataclass
class Login:
    """One NATS identity: a user with a password, or an NKey seed file and its public key."""

    name: str
    password: str = ""
    seed_file: Path | None = None
    public_key: str = ""

    def user(self) -> NatsUser:
        if self.seed_file is not None:
            return NatsUser(nkey=self.public_key)
        return NatsUser(user=self.name, password=self.password)

    @property
    def identity(self) -> str:
        """The id a worker logged in this way takes."""
        return self.public_key or self.name

    def env(self, pki: Pki, client_cert: str) -> dict[str, str]:
        """``APOMESH_NATS_*`` variables for a process logging in this way, over mutual TLS."""
        cert = pki.client(client_cert)
        env = {
            "APOMESH_NATS_TLS_CA": str(pki.ca),
            "APOMESH_NATS_TLS_CERT": str(cert.cert),
            "APOMESH_NATS_TLS_KEY": str(cert.key),
        }
        if self.seed_file is not None:
            env["APOMESH_NATS_NKEY_SEED_FILE"] = str(self.seed_file)
        else:
            env["APOMESH_NATS_USER"] = self.name
            env["APOMESH_NATS_PASSWORD"] = self.password
        return env

    def connect_options(self, pki: Pki, client_cert: str = "") -> dict[str, Any]:
        """Options for ``apomesh.adapters.nats_connect.connect``, with this login's own client
        certificate unless ``client_cert`` names another."""
        cert = pki.client(client_cert or self.name)
        options: dict[str, Any] = {
            "tls": tls_context(
                ca_file=str(pki.ca), cert_file=str(cert.cert), key_file=str(cert.key)
            )
        }
        if self.seed_file is not None:
            options["nkey_seed_file"] = str(self.seed_file)
        else:
            options["user"], options["password"] = self.name, self.password
        return options


class HttpsDaemonProcess(DaemonProcess):
    """``apomesh serve`` with its API on HTTPS (the certificate of the test CA)."""

    def __init__(self, *args: Any, ca: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca = ca

    def start(self, timeout: float = 60.0) -> None:
        args = [
            sys.executable, "-m", "apomesh", "serve", "--nats", ",".join(self.nats_urls),
            "--data", str(self.data_dir), "--workspace", str(self.workspace),
            "--http", f"127.0.0.1:{self.port}", "--workers", str(self.workers), *self.extra_args,
        ]  # fmt: skip
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        context = ssl.create_default_context(cafile=str(self.ca))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"apomesh serve exited {self.proc.returncode}:\n{self.output_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", verify=context, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"apomesh serve did not answer within {timeout} s:\n{self.output_tail()}"
        )


@dataclass
class SecureSystem:
    """The running deployment; ``close()`` stops every process."""

    base: Path
    pki: Pki
    logins: dict[str, Login]
    cluster: NatsCluster
    leaf: NatsServer
    daemon: HttpsDaemonProcess
    tokens: dict[str, str]
    workers: list[WorkerProcess] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)

    # -- building -------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        base: Path,
        *,
        daemon_env: dict[str, str] | None = None,
        extra_workers: tuple[str, ...] = ("worker-c",),
    ) -> SecureSystem:
        pki = make_pki(base / "pki")
        logins = {
            name: Login(name, password=secrets.token_urlsafe(18))
            for name in ("daemon", "control", "operator", "leaf", "worker-a", *extra_workers)
        }
        seed_file, public_key = make_nkey_user(base / "nkeys", "edge-1")
        logins["edge-1"] = Login("edge-1", seed_file=seed_file, public_key=public_key)
        cluster_workers = ["worker-a", *extra_workers]
        account = apomesh_account(
            daemon=logins["daemon"].user(),
            control=logins["control"].user(),
            workers={logins[w].identity: logins[w].user() for w in cluster_workers},
            operators=[logins["operator"].user()],
            leaves=[(logins["leaf"].user(), [logins["edge-1"].identity])],
        )
        route_tls = TlsConfig(
            cert=pki.server.cert, key=pki.server.key, ca=pki.ca, verify=True, timeout=5.0
        )
        server_tls = replace(route_tls, verify_and_map=True)
        specs = cluster(base / "nats", 3)
        leaf_ports = free_ports(len(specs))
        specs = [
            replace(
                spec,
                accounts=(account,),
                tls=server_tls,
                cluster_tls=route_tls,
                leafnode_port=leaf_port,
                leafnode_tls=server_tls,
            )
            for spec, leaf_port in zip(specs, leaf_ports, strict=True)
        ]
        servers = start_cluster(specs)
        try:
            _run_in_own_loop(
                lambda: wait_jetstream_ready(
                    servers.urls, replicas=3, **_raw_options(logins["daemon"], pki)
                )
            )
            leaf = cls._start_leaf(base, pki, logins, specs)
            tokens = {
                role: create_token(base / "daemon", role, f"{role}-token")
                for role in ("operator", "read")
            }
            daemon = cls._start_daemon(base, pki, logins, servers, daemon_env or {})
        except BaseException:
            servers.stop()
            raise
        system = cls(base, pki, logins, servers, leaf, daemon, tokens)
        system.secrets = [login.password for login in logins.values() if login.password]
        system.secrets += [
            login.seed_file.read_text().strip() for login in logins.values() if login.seed_file
        ]
        system.secrets += list(system.tokens.values())
        return system

    @staticmethod
    def _start_leaf(
        base: Path, pki: Pki, logins: dict[str, Login], hubs: list[ServerSpec]
    ) -> NatsServer:
        port, http_port = free_ports(2)
        edge = logins["edge-1"]
        leaf_cert = pki.client("leaf")
        spec = ServerSpec(
            name="leaf",
            port=port,
            http_port=http_port,
            store_dir=base / "nats" / "leaf",
            jetstream=False,
            accounts=(
                Account(
                    ACCOUNT,
                    users=(replace(edge.user(), permissions=worker_permissions(edge.identity)),),
                    jetstream=False,
                ),
            ),
            tls=TlsConfig(cert=pki.server.cert, key=pki.server.key, ca=pki.ca, verify_and_map=True),
            remotes=(
                LeafRemote(
                    urls=tuple(f"nats-leaf://127.0.0.1:{hub.leafnode_port}" for hub in hubs),
                    account=ACCOUNT,
                    user="leaf",
                    password=logins["leaf"].password,
                    tls=TlsConfig(cert=leaf_cert.cert, key=leaf_cert.key, ca=pki.ca),
                ),
            ),
        )
        leaf = NatsServer(spec)
        leaf.start()
        leaf.wait_leafnode_connected()
        return leaf

    @staticmethod
    def _start_daemon(
        base: Path,
        pki: Pki,
        logins: dict[str, Login],
        servers: NatsCluster,
        daemon_env: dict[str, str],
    ) -> HttpsDaemonProcess:
        control = logins["control"]
        control_cert = pki.client(control.name)
        password_file = base / "control.password"
        password_file.write_text(control.password + "\n")
        password_file.chmod(0o600)
        env = {
            **logins["daemon"].env(pki, "daemon"),
            "APOMESH_NATS_CONTROL_USER": control.name,
            "APOMESH_NATS_CONTROL_PASSWORD_FILE": str(password_file),
            "APOMESH_NATS_CONTROL_TLS_CERT": str(control_cert.cert),
            "APOMESH_NATS_CONTROL_TLS_KEY": str(control_cert.key),
            "APOMESH_NATS_REPLICAS": "3",
            "APOMESH_HTTP_TLS_CERT": str(pki.server.cert),
            "APOMESH_HTTP_TLS_KEY": str(pki.server.key),
            "APOMESH_HTTP_AUTH": "on",
            **daemon_env,
        }
        daemon = HttpsDaemonProcess(
            servers.urls,
            base / "daemon",
            workers=0,
            heartbeat_interval=float(HEARTBEAT),
            env=env,
            ca=pki.ca,
        )
        daemon.start()
        return daemon

    # -- parts ----------------------------------------------------------------------------------

    def worker(self, login: str, *, on_leaf: bool = False) -> WorkerProcess:
        """Start an ``apomesh worker`` logging in as ``login``, on the cluster or the leaf."""
        urls = [self.leaf.url] if on_leaf else self.cluster.urls
        process = WorkerProcess(
            urls,
            self.base / f"workspace-{login}",
            login,
            env={
                **self.logins[login].env(self.pki, login),
                "APOMESH_LIVENESS_HEARTBEAT_INTERVAL": HEARTBEAT,
            },
        )
        process.start()
        self.workers.append(process)
        return process

    def http(self, token: str | None = "operator") -> httpx.Client:
        """An HTTPS client of the daemon's API with the named token (or none)."""
        headers = {"Authorization": f"Bearer {self.tokens[token]}"} if token else {}
        return httpx.Client(
            base_url=self.daemon.url,
            verify=ssl.create_default_context(cafile=str(self.pki.ca)),
            headers=headers,
            timeout=30.0,
        )

    def wait_workers(self, ids: set[str], timeout: float = 60.0) -> list[dict[str, Any]]:
        """Until every worker id in ``ids`` is listed alive by the daemon."""
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        with self.http() as client:
            while time.monotonic() < deadline:
                body = client.get("/v1/workers").json()
                rows = body["workers"] if isinstance(body, dict) else body
                if ids <= {row["id"] for row in rows if row.get("alive", True)}:
                    return rows
                time.sleep(0.1)
        tails = "\n".join(
            f"--- {path.name}:\n{path.read_text(errors='replace')[-1500:]}"
            for path in self.log_files()
            if "nats" not in path.name
        )
        raise AssertionError(f"workers {ids} did not register: {rows}\n{tails}")

    def log_files(self) -> list[Path]:
        """Every log file the deployment wrote: daemon, workers, nats-servers."""
        return sorted(path for path in self.base.rglob("*.log") if path.is_file())

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.daemon.stop()
        self.leaf.stop()
        self.cluster.stop()


def _raw_options(login: Login, pki: Pki) -> dict[str, Any]:
    """``nats.connect`` options (not apomesh's ``connect``) for ``login``."""
    cert = pki.client(login.name)
    return {
        "user": login.name,
        "password": login.password,
        "tls": tls_context(ca_file=str(pki.ca), cert_file=str(cert.cert), key_file=str(cert.key)),
    }


def create_token(data_dir: Path, role: str, name: str, *extra: str) -> str:
    """A token made with ``apomesh tokens create`` (the secret it prints on its last line)."""
    result = subprocess.run(
        [sys.executable, "-m", "apomesh", "tokens", "create", "--role", role, "--name", name,
         "--data", str(data_dir), *extra],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return result.stdout.strip().splitlines()[-1]
