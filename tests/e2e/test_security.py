"""Security of a production-shaped deployment (``tests/e2e/secure_system.py``): a 3-node cluster
with accounts, per-role permissions and mutual TLS, an authenticated leaf node, the daemon on
HTTPS with bearer tokens, and workers holding their own credentials.

The session runs end to end over all of it; a worker's credentials cannot append to or read the
log, touch KV, impersonate another worker's heartbeat or reports, or take another worker's
dispatch — each refused by the server itself; the leaf login, even used by a leaf node of the
edge host's own, carries only its edge worker's subjects; an operator hears only its own replies;
the daemon answers a worker only on its own inbox (never on a reply subject pointing at the
JetStream API, a log or KV), refuses a worker whose tools are not allowed and fences a report
that names another worker; wrong or missing NATS credentials and certificates fail with an error
saying what is wrong, and a server that does not offer TLS gets nothing; API tokens expire, are
revoked and are rate-limited; and no secret, token or skill body reaches any log file or command
line, NATS URLs with passwords included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from tests.e2e.secure_system import SecureSystem, create_token

from apomesh.adapters.nats_connect import NatsAuthError, NatsTlsError, connect, tls_context
from apomesh.demo import DEMO_AGENT
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.nats_permissions import OPERATOR_INBOX_PREFIX
from apomesh.runtime.protocol import (
    ENCODER,
    REGISTER_REPLY_DECODER,
    REPLY_DECODER,
    VERB_NODE,
    VERB_REGISTER,
    BudgetState,
    Cancel,
    NodeReport,
    Register,
    control_subject,
    worker_inbox_prefix,
)

pytestmark = pytest.mark.anyio

TIMEOUT = 90.0
SKILL_MARKER = f"house-style-{secrets.token_hex(8)}"


def installed() -> tuple[list[str], list[str]]:
    """The tools and model providers of every plugin installed now. Asked when a test runs, not
    at collection: another module's fixture may install plugin packages in between."""
    host = PluginHost()
    return sorted(host.tools()), sorted(host.model_providers())


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureSystem]:
    tools, providers = installed()
    deployment = SecureSystem.build(
        tmp_path_factory.mktemp("secure"),
        daemon_env={
            "APOMESH_WORKERS_ALLOWED_TOOLS": ",".join(tools),
            "APOMESH_WORKERS_ALLOWED_PROVIDERS": ",".join(providers),
        },
    )
    try:
        deployment.worker("worker-a")
        deployment.worker("edge-1", on_leaf=True)
        deployment.wait_workers({"worker-a", deployment.logins["edge-1"].identity})
        yield deployment
    finally:
        deployment.close()


# --------------------------------------------------------------------------------------------
# helpers


def wait_status(system: SecureSystem, session_id: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    view: dict[str, Any] = {}
    with system.http() as client:
        while time.monotonic() < deadline:
            view = client.get(f"/v1/sessions/{session_id}").json()
            if view.get("status") in statuses:
                return view
            time.sleep(0.1)
    raise AssertionError(f"session {session_id} never reached {statuses}: {view}")


def find_event(
    system: SecureSystem, session_id: str, predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The first event of the session (live, from its SSE stream) that ``predicate`` accepts."""
    with (
        system.http() as client,
        client.stream("GET", f"/v1/sessions/{session_id}/events") as stream,
    ):
        for line in stream.iter_lines():
            if line.startswith("data:"):
                record: dict[str, Any] = json.loads(line[5:])
                if predicate(record):
                    return record
    raise AssertionError(f"no such event in session {session_id}")


def events(system: SecureSystem, session_id: str) -> list[dict[str, Any]]:
    """Every event of an ended session."""
    found: list[dict[str, Any]] = []
    with (
        system.http() as client,
        client.stream("GET", f"/v1/sessions/{session_id}/events") as stream,
    ):
        for line in stream.iter_lines():
            if line.startswith("data:"):
                found.append(json.loads(line[5:]))
    return found


class Probe:
    """A raw nats-py connection as one login, collecting what the server refuses."""

    def __init__(self, nc: nats.NATS, refusals: list[str]) -> None:
        self.nc = nc
        self.refusals = refusals

    @classmethod
    async def open(
        cls,
        system: SecureSystem,
        login: str,
        *,
        on_leaf: bool = False,
        worker: bool = True,
        inbox: str = "_INBOX",
    ) -> Probe:
        refusals: list[str] = []

        async def on_error(exc: Exception) -> None:
            refusals.append(str(exc))

        who = system.logins[login]
        options = who.connect_options(system.pki)
        auth: dict[str, Any] = {}
        if "nkey_seed_file" in options:
            auth["nkeys_seed"] = options["nkey_seed_file"]
        else:
            auth["user"], auth["password"] = options["user"], options["password"]
        nc = await nats.connect(
            [system.leaf.url] if on_leaf else system.cluster.urls,
            tls=options["tls"],
            error_cb=on_error,
            allow_reconnect=False,
            inbox_prefix=worker_inbox_prefix(who.identity) if worker else inbox,
            **auth,
        )
        return cls(nc, refusals)

    async def refused(self, subject: str, kind: str = "Publish") -> str:
        """Wait for the server's permissions violation naming ``subject``, and return it."""
        wanted = f'Permissions Violation for {kind} to "{subject}"'
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for refusal in self.refusals:
                if wanted.lower() in refusal.lower():
                    return refusal
            await self.nc.flush()
            await asyncio.sleep(0.02)
        raise AssertionError(f"the server did not refuse {kind} to {subject}: {self.refusals}")

    async def subscribe_refused(self, subject: str) -> str:
        await self.nc.subscribe(subject)
        return await self.refused(subject, "Subscription")

    async def publish_refused(self, subject: str, data: bytes = b"{}") -> str:
        await self.nc.publish(subject, data)
        return await self.refused(subject)

    async def aclose(self) -> None:
        await self.nc.close()


def start_session(system: SecureSystem, definition: dict[str, Any], goal: str = "write") -> str:
    with system.http() as client:
        response = client.post("/v1/sessions", json={"goal": goal, "definition": definition})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


# --------------------------------------------------------------------------------------------
# the session runs with everything on


def test_a_session_runs_end_to_end_with_auth_and_tls_on_cluster_and_leaf(
    system: SecureSystem,
) -> None:
    with system.http() as client:
        put = client.put("/v1/skills/house-style", json={"body": f"Write plainly. {SKILL_MARKER}"})
        assert put.status_code in (200, 201), put.text
    definition = {**DEMO_AGENT, "skills": ["house-style"]}
    session_id = start_session(system, definition, "write three chapters")
    view = wait_status(system, session_id, ("completed", "failed"))
    assert view["status"] == "completed", view
    dispatched_to = {
        record["event"]["worker"]
        for record in events(system, session_id)
        if record["kind"] == "AgentLifecycle" and record["event"]["phase"] == "dispatched"
    }
    # Sub-agents ran on the cluster's worker and on the edge worker behind the leaf node.
    assert dispatched_to == {"worker-a", system.logins["edge-1"].identity}
    rows = system.wait_workers(set(dispatched_to))
    assert {row["name"] for row in rows} >= {"worker-a", "edge-1"}


# --------------------------------------------------------------------------------------------
# what a worker's credentials cannot do, refused by the server


async def test_a_worker_cannot_append_to_a_session_log_or_use_jetstream(
    system: SecureSystem,
) -> None:
    session_id = start_session(
        system,
        {
            "name": "echo",
            "version": "1",
            "model": {"provider": "scripted", "turns": [{"final": "ok"}]},
        },
    )
    before = wait_status(system, session_id, ("completed",))["last_index"]
    probe = await Probe.open(system, "worker-c")
    try:
        await probe.publish_refused(f"apomesh.log.{session_id}", b"forged event")
        js = probe.nc.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.Error):
            await js.publish(f"apomesh.log.{session_id}", b"forged event")
        await probe.publish_refused("$JS.API.STREAM.INFO.APOMESH_LOG")
        await probe.publish_refused("$JS.API.STREAM.DELETE.APOMESH_LOG")
        await probe.publish_refused("$KV.APOMESH_SKILLS.house-style", b"forged skill")
        # Nor the replicated state store (the daemon's snapshots and recorded turns).
        await probe.publish_refused("$KV.APOMESH_STATE.snapshots._forged", b"forged snapshot")
        await probe.publish_refused("$JS.API.DIRECT.GET.KV_APOMESH_STATE")
    finally:
        await probe.aclose()
    with system.http() as client:
        assert client.get(f"/v1/sessions/{session_id}").json()["last_index"] == before


async def test_a_worker_cannot_read_another_session(system: SecureSystem) -> None:
    session_id = start_session(
        system,
        {
            "name": "echo",
            "version": "1",
            "model": {"provider": "scripted", "turns": [{"final": "secret output"}]},
        },
    )
    wait_status(system, session_id, ("completed",))
    probe = await Probe.open(system, "worker-c")
    try:
        await probe.subscribe_refused(f"apomesh.log.{session_id}")
        await probe.subscribe_refused("apomesh.log.>")
        await probe.publish_refused(f"$JS.API.DIRECT.GET.APOMESH_LOG.apomesh.log.{session_id}")
        await probe.subscribe_refused("$KV.>")
        # Nor the replies others get: the daemon's, or another worker's.
        await probe.subscribe_refused("_INBOX.>")
        await probe.subscribe_refused(f"{worker_inbox_prefix('worker-a')}.>")
    finally:
        await probe.aclose()


async def test_a_worker_cannot_impersonate_another_workers_heartbeat_or_reports(
    system: SecureSystem,
) -> None:
    probe = await Probe.open(system, "worker-c")
    try:
        await probe.publish_refused("apomesh.hb.worker-a")
        await probe.publish_refused(control_subject(system.daemon.daemon_id, VERB_NODE, "worker-a"))
        await probe.publish_refused(
            control_subject(system.daemon.daemon_id, VERB_REGISTER, "worker-a")
        )
    finally:
        await probe.aclose()
    edge = await Probe.open(system, "edge-1", on_leaf=True)
    try:  # behind the leaf node, the edge worker is held to the same rules
        await edge.publish_refused("apomesh.hb.worker-a")
        await edge.publish_refused("$JS.API.STREAM.INFO.APOMESH_LOG")
    finally:
        await edge.aclose()


async def test_a_worker_cannot_receive_another_workers_dispatch(system: SecureSystem) -> None:
    probe = await Probe.open(system, "worker-c")
    try:
        await probe.subscribe_refused("apomesh.dispatch.worker-a")
        await probe.subscribe_refused("apomesh.dispatch.>")
        await probe.subscribe_refused("apomesh.ctl.>")
    finally:
        await probe.aclose()


async def test_an_operator_reads_the_log_but_cannot_write_it(system: SecureSystem) -> None:
    session_id = start_session(
        system,
        {
            "name": "echo",
            "version": "1",
            "model": {"provider": "scripted", "turns": [{"final": "ok"}]},
        },
    )
    last = wait_status(system, session_id, ("completed",))["last_index"]
    probe = await Probe.open(system, "operator", worker=False, inbox=OPERATOR_INBOX_PREFIX)
    try:
        js = probe.nc.jetstream(timeout=10.0)
        info = await js.stream_info("APOMESH_LOG", subjects_filter=f"apomesh.log.{session_id}")
        # Its last + 1 events, an append's events to a message.
        stored = (info.state.subjects or {})[f"apomesh.log.{session_id}"]
        assert 0 < stored <= last + 1
        first = await js.get_msg(
            "APOMESH_LOG", subject=f"apomesh.log.{session_id}", next=True, seq=1
        )
        assert first.data
        await probe.publish_refused(f"apomesh.log.{session_id}", b"forged")
        await probe.publish_refused("$JS.API.STREAM.PURGE.APOMESH_LOG")
        await probe.publish_refused("apomesh.dispatch.worker-a")
        # Its own replies only: not the daemon's (log reads, KV values) nor the workers'.
        await probe.subscribe_refused("_INBOX.>")
        await probe.subscribe_refused(f"{worker_inbox_prefix('worker-a')}.>")
    finally:
        await probe.aclose()


async def arrives_in_order(
    receive: nats.NATS,
    send: nats.NATS,
    marker_subject: str,
    forbidden: list[str],
    *,
    send_forbidden: nats.NATS | None = None,
) -> list[str]:
    """Subscribe ``receive`` to ``forbidden`` and ``marker_subject``; once a marker from ``send``
    crosses, publish on every forbidden subject and one more marker: the subjects heard before
    that marker arrives (messages from one publisher on one path keep their order)."""
    heard: list[str] = []
    markers: asyncio.Queue[bytes] = asyncio.Queue()
    marker = ENCODER.encode(Cancel("probe", "probe", 0))

    async def on_message(msg: Any) -> None:
        # The deployment's own traffic runs on some of these subjects: only ours counts.
        if msg.subject == marker_subject and msg.data in (marker, b"last"):
            await markers.put(msg.data)
        elif msg.subject != marker_subject and msg.data == marker:
            heard.append(msg.subject)

    for subject in [*forbidden, marker_subject]:
        await receive.subscribe(subject, cb=on_message)
    await receive.flush()
    deadline = time.monotonic() + TIMEOUT
    while markers.empty():
        assert time.monotonic() < deadline, f"no marker on {marker_subject} crossed"
        await send.publish(marker_subject, marker)
        await send.flush()
        await asyncio.sleep(0.05)
    while not markers.empty():
        markers.get_nowait()
    sender = send_forbidden or send
    for subject in forbidden:
        await sender.publish(subject.replace(">", "x").replace("*", "x"), marker)
    await sender.flush()
    await send.publish(marker_subject, b"last")
    await send.flush()
    while await asyncio.wait_for(markers.get(), TIMEOUT) != b"last":
        pass
    return heard


def edge_leaf_node(
    system: SecureSystem, name: str, user: str, password: str, client_cert: Any
) -> Any:
    """A leaf node an edge host runs on its own (one local login, no permissions of its own),
    linked to the cluster with the hub's ``leaf`` login and the TLS client certificate given."""
    from msgspec.structs import replace as with_fields

    from apomesh.adapters.natsserver import (
        Account,
        LeafRemote,
        NatsServer,
        NatsUser,
        TlsConfig,
        single_node,
    )
    from apomesh.runtime.nats_permissions import ACCOUNT

    local = NatsUser(user=user, password=password)
    spec = with_fields(
        single_node(system.base / name, name=name, jetstream=False),
        accounts=(Account(ACCOUNT, users=(local,), jetstream=False),),
        remotes=(
            LeafRemote(
                urls=tuple(
                    f"nats-leaf://127.0.0.1:{server.spec.leafnode_port}"
                    for server in system.cluster
                ),
                account=ACCOUNT,
                user="leaf",
                password=system.logins["leaf"].password,
                tls=TlsConfig(cert=client_cert.cert, key=client_cert.key, ca=system.pki.ca),
            ),
        ),
    )
    return NatsServer(spec)


async def test_a_leaf_login_carries_only_its_edge_workers_subjects(system: SecureSystem) -> None:
    """An edge host that runs its own leaf node with the hub's ``leaf`` login (and no
    permissions of its own) still cannot write onto a log, dispatch to or answer as a cluster
    worker, or hear the control plane: the hub's permissions on the login filter the link."""
    password = secrets.token_urlsafe(12)
    rogue_leaf = edge_leaf_node(system, "rogue-leaf", "rogue", password, system.pki.client("leaf"))
    rogue_leaf.start()
    try:
        rogue_leaf.wait_leafnode_connected()
        rogue = await nats.connect(rogue_leaf.url, user="rogue", password=password)
        daemon = await Probe.open(system, "daemon", worker=False)
        edge = system.logins["edge-1"].identity
        session = f"rogue-{secrets.token_hex(4)}"
        try:
            # From the edge host into the cluster: only the edge worker's own subjects.
            heard = await arrives_in_order(
                daemon.nc,
                rogue,
                f"apomesh.hb.{edge}",
                [
                    f"apomesh.log.{session}",
                    "apomesh.dispatch.worker-a",
                    control_subject(system.daemon.daemon_id, VERB_NODE, "worker-a"),
                    "apomesh.hb.worker-a",
                ],
            )
            assert heard == []
            # From the cluster to the edge host: only the edge worker's dispatches and inbox.
            heard = await arrives_in_order(
                rogue,
                daemon.nc,
                f"apomesh.dispatch.{edge}",
                ["apomesh.ctl.>", "apomesh.dispatch.worker-a", "_INBOX.>", "apomesh.hb.>"],
            )
            assert heard == []
            _, on_session = await log_counts(daemon.nc, session)
            assert on_session == 0
        finally:
            await rogue.close()
            await daemon.aclose()
    finally:
        rogue_leaf.stop()


def test_a_leaf_link_needs_the_certificate_of_the_leaf_login(system: SecureSystem) -> None:
    """The hub maps a leaf link's certificate to its user: a leaf node presenting worker-a's
    certificate with the ``leaf`` login's right password is refused, and links to no hub."""
    from tests.e2e.api_support import wait_until

    worker_cert = system.pki.client("worker-a")
    password = secrets.token_urlsafe(12)
    wrong = edge_leaf_node(system, "wrong-cert-leaf", "local", password, worker_cert)
    wrong.start()
    try:
        wait_until(
            lambda: "authorization violation" in wrong.output_tail().lower(),
            timeout=TIMEOUT,
            what="the hub refusing the leaf link",
        )
        links = (wrong.monitor("leafz") or {}).get("leafnodes")
        assert not links, wrong.output_tail()
    finally:
        wrong.stop()


def test_the_sample_nats_configs_are_valid_and_carry_the_role_permissions(tmp_path: Path) -> None:
    from tests.e2e.certs import make_pki

    from apomesh.adapters.natsserver import find_nats_server
    from apomesh.runtime.nats_permissions import (
        control_permissions,
        daemon_permissions,
        leaf_permissions,
        operator_permissions,
        worker_permissions,
    )

    samples = Path(__file__).parents[2] / "conf" / "nats"
    pki = make_pki(tmp_path / "tls")
    for name in ("route", "edge-server", "leaf"):
        pki.client(name)
    (tmp_path / "tls" / "routes-ca.crt").write_bytes(pki.ca.read_bytes())
    configs = tmp_path / "conf"
    configs.mkdir()
    for sample in samples.glob("*.conf"):
        text = sample.read_text()
        text = text.replace("/etc/nats/tls/", f"{tmp_path / 'tls'}/")
        text = text.replace("/var/lib/nats/jetstream", str(tmp_path / "js"))
        (configs / sample.name).write_text(text)
    env = {
        "PATH": "/usr/bin:/bin",
        "NATS_SERVER_NAME": "nats-1",
        "APOMESH_DAEMON_PASSWORD": "d",
        "APOMESH_CONTROL_PASSWORD": "c",
        "APOMESH_OPERATOR_PASSWORD": "o",
        "APOMESH_WORKER_1_PASSWORD": "w",
        "APOMESH_LEAF_PASSWORD": "l",
        "APOMESH_EDGE_2_PASSWORD": "e",
    }
    for name in ("cluster-node.conf", "leaf.conf"):
        result = subprocess.run(
            [str(find_nats_server()), "-t", "-c", str(configs / name)],
            capture_output=True, text=True, env=env, timeout=30,
        )  # fmt: skip
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
    accounts = (samples / "accounts.conf").read_text() + (samples / "leaf.conf").read_text()
    roles = [daemon_permissions(), operator_permissions(), worker_permissions("worker-1")]
    roles.append(control_permissions())
    roles.append(worker_permissions("edge-2"))
    edge_nkey = "UCAXZNF7H2TXOBPUWC54FTW564DU6L4DCZZZG4D657A4QDOIIZMVTM4A"
    roles.append(leaf_permissions([edge_nkey, "edge-2"]))
    for permissions in roles:
        for subject in (
            *permissions.publish,
            *permissions.subscribe,
            *permissions.publish_deny,
            *permissions.subscribe_deny,
        ):
            assert f'"{subject}"' in accounts, subject
    # Certificates choose the user on every listener clients and leaf logins use.
    cluster_node = (samples / "cluster-node.conf").read_text()
    assert cluster_node.count("verify_and_map: true") == 2
    assert (samples / "leaf.conf").read_text().count("verify_and_map: true") == 1


# --------------------------------------------------------------------------------------------
# admitted, not trusted


async def test_the_daemon_refuses_a_worker_with_tools_it_does_not_allow(
    system: SecureSystem,
) -> None:
    probe = await Probe.open(system, "worker-c")
    try:
        registration = Register(
            "worker-c", "worker-c", [*installed()[0], "shell.exec"], installed()[1], instance="x"
        )
        reply = await probe.nc.request(
            control_subject(system.daemon.daemon_id, VERB_REGISTER, "worker-c"),
            ENCODER.encode(registration),
            timeout=10,
        )
        answer = REGISTER_REPLY_DECODER.decode(reply.data)
        assert not answer.ok
        assert "shell.exec" in answer.reason
        # Registering under another worker's id from its own subject is refused too.
        impostor = Register("worker-a", "worker-a", *installed())
        reply = await probe.nc.request(
            control_subject(system.daemon.daemon_id, VERB_REGISTER, "worker-c"),
            ENCODER.encode(impostor),
            timeout=10,
        )
        answer = REGISTER_REPLY_DECODER.decode(reply.data)
        assert not answer.ok and "cannot register as worker-a" in answer.reason
    finally:
        await probe.aclose()
    # Refused workers never become candidates for a dispatch.
    with system.http() as client:
        ids = {row["id"] for row in client.get("/v1/workers").json()["workers"]}
    assert "worker-c" not in ids


async def test_a_report_naming_another_worker_is_fenced(system: SecureSystem) -> None:
    slow = {
        "name": "slow",
        "version": "1",
        "tools": ["fs.list"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"delay": 30, "tool_calls": [{"tool": "fs.list", "args": {"path": "."}}]},
                {"final": "done"},
            ],
        },
    }
    session_id = start_session(system, slow)
    dispatch = find_event(
        system,
        session_id,
        lambda r: r["kind"] == "AgentLifecycle" and r["event"]["phase"] == "dispatched",
    )["event"]
    owner = dispatch["worker"]
    probe = await Probe.open(system, "worker-c")
    try:
        for claimed in (owner, "worker-c"):
            report = NodeReport(
                claimed, session_id, dispatch["agent"], dispatch["epoch"], step=1,
                new_messages=[], model={}, budget=BudgetState(),
            )  # fmt: skip
            reply = await probe.nc.request(
                control_subject(system.daemon.daemon_id, VERB_NODE, "worker-c"),
                ENCODER.encode(report),
                timeout=10,
            )
            answer = REPLY_DECODER.decode(reply.data)
            # Naming the real owner: not who sent it. Naming itself: not whose dispatch it is.
            assert answer.status == "fenced", answer
    finally:
        await probe.aclose()
    with system.http() as client:
        assert client.post(f"/v1/sessions/{session_id}/cancel", json={}).status_code == 202
        metrics = client.get("/metrics").text
    assert "apomesh_fenced_reports_total" in metrics


async def test_a_worker_registering_again_from_a_new_process_replaces_its_predecessor(
    system: SecureSystem,
) -> None:
    probe = await Probe.open(system, "worker-c")
    try:
        for instance in ("first-process", "second-process"):
            registration = Register("worker-c", "worker-c", *installed(), instance=instance)
            reply = await probe.nc.request(
                control_subject(system.daemon.daemon_id, VERB_REGISTER, "worker-c"),
                ENCODER.encode(registration),
                timeout=10,
            )
            assert REGISTER_REPLY_DECODER.decode(reply.data).ok
    finally:
        await probe.aclose()
    # What the first process ran died with it: the daemon declared it lost at once.
    deadline = time.monotonic() + TIMEOUT
    wanted = "worker worker-c lost: it registered again from a new process"
    while wanted not in system.daemon.output_tail(1_000_000):
        assert time.monotonic() < deadline, system.daemon.output_tail()
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------------------------
# the daemon answers a worker only on that worker's own inbox

DROPPED_METRIC = "apomesh_control_requests_dropped_total"


async def poison_replies(nc: nats.NATS, daemon_id: str, worker_id: str, session_id: str) -> None:
    """Requests on ``worker_id``'s own control subjects whose reply subjects point where it may
    not publish: the JetStream API (a purge of the log), a session's log, a KV key. Then one
    with its own inbox, answered once the daemon has read the others."""
    registration = ENCODER.encode(Register(worker_id, "prober", [], []))
    for subject, reply in (
        (control_subject(daemon_id, VERB_REGISTER, worker_id), "$JS.API.STREAM.PURGE.APOMESH_LOG"),
        (control_subject(daemon_id, VERB_REGISTER, worker_id), f"apomesh.log.{session_id}"),
        (control_subject(daemon_id, VERB_NODE, worker_id), f"apomesh.log.{session_id}"),
        (control_subject(daemon_id, VERB_REGISTER, worker_id), "$KV.APOMESH_SKILLS.house-style"),
        (
            control_subject(daemon_id, VERB_REGISTER, worker_id),
            f"{worker_inbox_prefix('worker-a')}.x.1",
        ),
    ):
        await nc.publish(subject, registration, reply=reply)
    answer = await nc.request(
        control_subject(daemon_id, VERB_REGISTER, worker_id), registration, timeout=10
    )
    REGISTER_REPLY_DECODER.decode(answer.data)


async def log_counts(nc: nats.NATS, session_id: str) -> tuple[int, int]:
    """(messages on the whole log, messages of ``session_id``)."""
    js = nc.jetstream(timeout=10.0)
    info = await js.stream_info("APOMESH_LOG", subjects_filter=f"apomesh.log.{session_id}")
    return info.state.messages, (info.state.subjects or {}).get(f"apomesh.log.{session_id}", 0)


def wait_dropped(get_metrics: Callable[[], str], count: int) -> None:
    """Until the daemon counts ``count`` dropped control requests (the report subscription
    drops its own while the registration one answers)."""
    deadline = time.monotonic() + TIMEOUT
    seen = 0.0
    while time.monotonic() < deadline:
        lines = [line for line in get_metrics().splitlines() if line.startswith(DROPPED_METRIC)]
        seen = float(lines[0].split()[-1]) if lines else 0.0
        if seen >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{DROPPED_METRIC} is {seen}, not {count}")


ECHO = {
    "name": "echo",
    "version": "1",
    "model": {"provider": "scripted", "turns": [{"final": "ok"}]},
}


async def test_a_worker_cannot_make_the_daemon_answer_onto_jetstream_the_log_or_kv(
    system: SecureSystem,
) -> None:
    with system.http() as client:
        put = client.put("/v1/skills/house-style", json={"body": "Write plainly."})
        assert put.status_code in (200, 201), put.text
    session_id = start_session(system, ECHO)
    wait_status(system, session_id, ("completed",))
    daemon = await Probe.open(system, "daemon", worker=False)
    probe = await Probe.open(system, "worker-c")
    try:
        before = await log_counts(daemon.nc, session_id)
        assert before[0] > 0 and before[1] > 0
        await poison_replies(probe.nc, system.daemon.daemon_id, "worker-c", session_id)
        assert await log_counts(daemon.nc, session_id) == before
    finally:
        await probe.aclose()
        await daemon.aclose()
    with system.http() as client:
        view = client.get(f"/v1/sessions/{session_id}")
        assert view.status_code == 200 and view.json()["status"] == "completed"
        skill = client.get("/v1/skills/house-style")
        assert skill.status_code == 200 and "Write plainly." in skill.text
        assert client.get("/v1/skills").status_code == 200
        wait_dropped(lambda: client.get("/metrics").text, 5)
    # The log and the control plane still work: a new session runs to the end.
    assert wait_status(system, start_session(system, ECHO), ("completed",))["status"] == "completed"


async def test_with_no_nats_permissions_the_daemon_still_answers_only_worker_inboxes(
    mesh: Any,
) -> None:
    import httpx

    session_id = httpx.post(
        f"{mesh.url}/v1/sessions", json={"goal": "x", "definition": ECHO}, timeout=30
    ).json()["session_id"]
    deadline = time.monotonic() + TIMEOUT
    while httpx.get(f"{mesh.url}/v1/sessions/{session_id}").json()["status"] != "completed":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    nc = await nats.connect(mesh.nats_url, inbox_prefix=worker_inbox_prefix("prober"))
    try:
        before = await log_counts(nc, session_id)
        await poison_replies(nc, mesh.daemon.daemon_id, "prober", session_id)
        assert await log_counts(nc, session_id) == before
        # The bare subjects of old are not served at all.
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(f"apomesh.ctl.{mesh.daemon.daemon_id}.register", b"", timeout=10)
    finally:
        await nc.close()
    wait_dropped(lambda: httpx.get(f"{mesh.url}/metrics").text, 5)
    assert httpx.get(f"{mesh.url}/v1/skills").status_code == 200


# --------------------------------------------------------------------------------------------
# wrong or missing credentials say what is wrong


def test_a_worker_with_a_wrong_password_fails_naming_the_user(system: SecureSystem) -> None:
    login = system.logins["worker-a"]
    env = {
        **login.env(system.pki, "worker-a"),
        "APOMESH_NATS_PASSWORD": "not-the-password",
        "APOMESH_NATS_CONNECT_TIMEOUT": "20",
    }
    result = subprocess.run(
        [sys.executable, "-m", "apomesh", "worker", "--nats", ",".join(system.cluster.urls),
         "--workspace", str(system.base / "wrong-password")],
        capture_output=True, text=True, timeout=60, env={**_environ(), **env},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "nats_auth_failed" in message
    assert "authorization violation" in message and "user 'worker-a'" in message
    assert "not-the-password" not in result.stderr + result.stdout


async def test_missing_credentials_and_certificates_fail_clearly(system: SecureSystem) -> None:
    pki = system.pki
    client_cert = pki.client("probe")
    with_cert = tls_context(
        ca_file=str(pki.ca), cert_file=str(client_cert.cert), key_file=str(client_cert.key)
    )
    with pytest.raises(NatsAuthError, match="no credentials"):
        await connect(system.cluster.urls, tls=with_cert, connect_timeout=20)
    nkey = system.logins["edge-1"].seed_file
    assert nkey is not None
    with pytest.raises(NatsAuthError, match="NKey seed file"):
        # A seed the cluster does not know (the edge worker is known to the leaf node only).
        await connect(
            system.cluster.urls, tls=with_cert, nkey_seed_file=str(nkey), connect_timeout=20
        )
    login = system.logins["worker-c"]
    without_cert = tls_context(ca_file=str(pki.ca))
    with pytest.raises(NatsTlsError, match=r"client certificate|certificate required"):
        await connect(
            system.cluster.urls, tls=without_cert, user=login.name, password=login.password,
            connect_timeout=20,
        )  # fmt: skip
    untrusting = tls_context()  # the system's CAs: the test CA is not among them
    with pytest.raises(NatsTlsError, match="certificate was not accepted"):
        await connect(
            system.cluster.urls, tls=untrusting, user=login.name, password=login.password,
            connect_timeout=20,
        )  # fmt: skip
    nc = await connect(system.cluster.urls, **login.connect_options(pki))
    await nc.close()


async def test_a_certificate_logs_in_only_as_the_user_it_names(system: SecureSystem) -> None:
    """verify_and_map: worker-a's certificate with another worker's, the daemon's or the control
    plane's own user and password is refused, and so is a certificate of the same CA that names
    no user, with worker-a's right password; worker-a's certificate with its own password logs
    in."""
    pki, logins = system.pki, system.logins
    for other in ("worker-c", "daemon", "control"):
        with pytest.raises(NatsAuthError):
            await connect(
                system.cluster.urls,
                connect_timeout=20,
                **logins[other].connect_options(pki, client_cert="worker-a"),
            )
    with pytest.raises(NatsAuthError):
        await connect(
            system.cluster.urls,
            connect_timeout=20,
            **logins["worker-a"].connect_options(pki, client_cert="nobody"),
        )
    nc = await connect(system.cluster.urls, **logins["worker-a"].connect_options(pki))
    await nc.close()


async def test_the_control_plane_login_cannot_reach_jetstream_or_the_log(
    system: SecureSystem,
) -> None:
    """The daemon answers workers on a connection logged in as ``control`` (the servers list
    it), and the server refuses that login a purge of the log, a write onto a session's log and
    a subscription to the log; sessions run meanwhile (the end-to-end test above)."""
    users = set()
    for server in system.cluster:
        connz = httpx.get(
            f"http://127.0.0.1:{server.spec.http_port}/connz?auth=true", timeout=10
        ).json()
        users |= {
            (c.get("name", "").split("-")[1], c.get("authorized_user"))
            for c in connz.get("connections", [])
            if c.get("name", "").startswith("apomesh-")
        }
    assert ("control", "control") in users, users
    probe = await Probe.open(system, "control", worker=False, inbox="_INBOX.control")
    try:
        await probe.publish_refused("$JS.API.STREAM.PURGE.APOMESH_LOG")
        await probe.publish_refused(f"apomesh.log.{secrets.token_hex(4)}")
        await probe.subscribe_refused("apomesh.log.>")
    finally:
        await probe.aclose()


@pytest.mark.parametrize("scheme", ["tls", "nats"])
async def test_tls_cannot_be_downgraded_by_a_server_that_does_not_offer_it(
    system: SecureSystem, scheme: str
) -> None:
    """A fake server on 127.0.0.1 that answers in plain NATS, without ``tls_required``: with TLS
    configured (a ``tls://`` URL, or a TLS context with a ``nats://`` one) the client sends it
    nothing, and says why."""
    received = bytearray()

    async def plain_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {
            "server_id": "fake",
            "version": "2.10.0",
            "auth_required": True,
            "max_payload": 1 << 20,
        }
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                received.extend(chunk)
        writer.close()

    server = await asyncio.start_server(plain_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    login = system.logins["worker-c"]
    try:
        with pytest.raises(NatsTlsError, match="does not offer TLS") as refused:
            await connect(
                f"{scheme}://127.0.0.1:{port}",
                connect_timeout=10,
                **login.connect_options(system.pki),
            )
    finally:
        server.close()
        await server.wait_closed()
    assert login.password not in str(refused.value)
    assert login.password.encode() not in received
    assert b"CONNECT" not in received


def test_nats_urls_with_credentials_are_logged_without_them(system: SecureSystem) -> None:
    """A URL carrying a password (``tls://user:password@host``, from the environment) is never
    written out whole: not when the worker says where it connected, not when it cannot connect."""
    login = system.logins["worker-c"]
    env = {k: v for k, v in login.env(system.pki, "worker-c").items() if "PASSWORD" not in k}
    env.pop("APOMESH_NATS_USER")

    def with_password(url: str) -> str:
        return url.replace("://", f"://{login.name}:{login.password}@", 1)

    unreachable = {
        **env,
        "APOMESH_NATS_URLS": with_password(f"tls://127.0.0.1:{free_port_number()}"),
        "APOMESH_NATS_CONNECT_TIMEOUT": "2",
    }
    result = subprocess.run(
        [sys.executable, "-m", "apomesh", "worker", "--id", "worker-c",
         "--workspace", str(system.base / "redacted")],
        capture_output=True, text=True, timeout=60, env={**_environ(), **unreachable},
    )  # fmt: skip
    assert result.returncode != 0
    assert "cannot reach NATS" in result.stderr + result.stdout
    assert f"{login.name}:***@" in result.stderr + result.stdout
    assert login.password not in result.stderr + result.stdout
    reachable = {**env, "APOMESH_NATS_URLS": ",".join(map(with_password, system.cluster.urls))}
    worker = subprocess.Popen(
        [sys.executable, "-m", "apomesh", "worker", "--id", "worker-c",
         "--workspace", str(system.base / "redacted")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**_environ(), **reachable},
    )  # fmt: skip
    output = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            output.append(line)
            if line.startswith("worker worker-c on"):
                break
    finally:
        worker.terminate()
        rest, _ = worker.communicate(timeout=30)
    text = "".join(output) + rest
    assert "worker worker-c on tls://worker-c:***@127.0.0.1:" in text, text
    assert login.password not in text


def free_port_number() -> int:
    from apomesh.adapters.natsserver import free_port

    return free_port()


# --------------------------------------------------------------------------------------------
# API tokens


def test_api_tokens_roles_and_https(system: SecureSystem) -> None:
    assert system.daemon.url.startswith("https://")
    with system.http(None) as anonymous:
        refused = anonymous.get("/v1/sessions")
        assert refused.status_code == 401
        assert refused.json()["error"] == "unauthorized"
        assert anonymous.get("/healthz").status_code == 200
    with system.http("read") as reader:
        assert reader.get("/v1/sessions").status_code == 200
        assert reader.post("/v1/sessions", json={"goal": "x"}).status_code == 403


def test_a_revoked_or_expired_token_gets_401(system: SecureSystem) -> None:
    data = system.daemon.data_dir
    revocable = create_token(data, "read", "short-lived-reader")
    expiring = create_token(data, "read", "expiring-reader", "--expires-in", "2s")
    lasting = create_token(data, "read", "lasting-reader", "--expires-in", "1h")
    system.secrets += [revocable, expiring, lasting]
    tokens = json.loads((data / "tokens.json").read_text())["tokens"]
    expires_at = {t["name"]: t.get("expires_at") for t in tokens}
    assert expires_at["short-lived-reader"] is None
    assert expires_at["lasting-reader"] is not None
    for secret in (revocable, expiring, lasting):
        assert secret.split("_", 2)[2] not in json.dumps(tokens)  # stored hashed
    system.tokens.update(revocable=revocable, expiring=expiring, lasting=lasting)
    with system.http("revocable") as client:
        assert client.get("/v1/sessions").status_code == 200
    token_id = revocable.split("_")[1]
    subprocess.run(
        [sys.executable, "-m", "apomesh", "tokens", "revoke", token_id, "--data", str(data)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with system.http("revocable") as client:
        assert client.get("/v1/sessions").status_code == 401
    while time.time() <= expires_at["expiring-reader"]:
        time.sleep(0.1)
    with system.http("expiring") as client:
        assert client.get("/v1/sessions").status_code == 401
    with system.http("lasting") as client:
        assert client.get("/v1/sessions").status_code == 200
    log = system.daemon.log_file.read_text()
    assert "authentication failed from 127.0.0.1: expired token" in log
    assert "authentication failed from 127.0.0.1: unknown or revoked token" in log


def test_a_first_start_with_auth_on_writes_an_operator_token_and_a_configured_one_works(
    tmp_path: Path,
) -> None:
    from apomesh.api.server import FIRST_TOKEN_FILE, _auth_settings
    from apomesh.runtime.config import load_config

    beyond_loopback = {"http": {"listen": "0.0.0.0:8750"}, "daemon": {"data_dir": str(tmp_path)}}
    settings = _auth_settings(load_config(None, env={}, overrides=beyond_loopback))
    assert settings.enabled and settings.token_store is not None
    written = tmp_path / FIRST_TOKEN_FILE
    assert written.stat().st_mode & 0o777 == 0o600
    first = written.read_text().strip()
    assert settings.token_store.verify(first) == "operator"
    assert first.split("_", 2)[2] not in (tmp_path / "tokens.json").read_text()
    # A second start keeps the tokens it has and makes no other.
    _auth_settings(load_config(None, env={}, overrides=beyond_loopback))
    assert written.read_text().strip() == first
    configured = secrets.token_urlsafe(24)
    env = {"APOMESH_HTTP_TOKEN": configured}
    again = _auth_settings(load_config(None, env=env, overrides=beyond_loopback))
    assert again.token_store is not None
    assert again.token_store.verify(configured) == "operator"
    assert again.token_store.verify(configured + "x") is None
    assert configured not in (tmp_path / "tokens.json").read_text()


def test_failed_authentication_is_rate_limited(system: SecureSystem) -> None:
    # Last of the API tests: after this, 127.0.0.1 is locked out for the failure window.
    statuses = []
    with system.http(None) as client:
        for attempt in range(15):
            headers = {"Authorization": f"Bearer apm_guess{attempt}_{secrets.token_hex(8)}"}
            statuses.append(client.get("/v1/sessions", headers=headers).status_code)
        assert statuses[0] == 401
        assert statuses[-1] == 429
        # Failures are limited, not successes: a valid token still works from that address.
        valid = client.get(
            "/v1/sessions", headers={"Authorization": f"Bearer {system.tokens['operator']}"}
        )
        locked = client.get("/v1/sessions", headers={"Authorization": "Bearer apm_guess_again"})
    assert locked.status_code == 429 and "Retry-After" in locked.headers
    assert valid.status_code == 200


# --------------------------------------------------------------------------------------------
# nothing secret in any log or command line


def test_no_secret_token_or_skill_body_in_any_log_or_command_line(system: SecureSystem) -> None:
    files = system.log_files()
    names = {path.name for path in files}
    assert {"serve.log", "worker-worker-a.log", "worker-edge-1.log", "nats-server.log"} <= names
    secrets_to_find = [*system.secrets, SKILL_MARKER]
    for path in files:
        text = path.read_text(errors="replace")
        for secret in secrets_to_find:
            assert secret not in text, f"a secret is in {path}"
    for process in [system.daemon.proc, *(w.proc for w in system.workers)]:
        if process is None or process.poll() is not None:
            continue
        command = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode(errors="replace")
        for secret in system.secrets:
            assert secret not in command


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("APOMESH_")}
