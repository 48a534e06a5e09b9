"""Who may do what on NATS: the subject permissions of apomesh's identities, and the worker
id a worker's credentials bind it to.

``daemon_permissions`` is what ``apomesh serve`` needs and nothing more: the JetStream API, KV
writes, the log, and the control, heartbeat and dispatch subjects (its in-process workers share
its connection). ``control_permissions`` is the daemon's second, control-plane connection, the
one that answers workers' registrations and reports and sends them dispatches: only the
dispatch subjects, the workers' inboxes, the bound control and heartbeat subjects, its own
inbox (``_INBOX.control``) and the echo it sends itself (``apomesh.echo.<incarnation>``), and
never JetStream, the KV buckets or the log, so a bug in a responder cannot reach them whatever
reply subject a worker asks for. Several daemons may share the daemon and control logins: the control login hears every daemon's control subjects
(``apomesh.ctl.<daemon_id>.<verb>.<worker_id>``), and each daemon subscribes to its own.
``worker_permissions(worker_id)`` lets a worker publish only its own heartbeat and its own bound
control subjects (``apomesh.ctl.*.*.<worker_id>``: any daemon's, as itself; its reports and the
pieces of model turns it streams, ``apomesh.ctl.<daemon_id>.delta.<worker_id>``), answer the
dispatches it receives, and subscribe only to its own dispatch subject and its own inboxes; the JetStream API,
the log and the KV buckets are denied outright. ``leaf_permissions(worker_ids)`` is the hub's login for a leaf node: only its edge workers'
own subjects cross the link. ``operator_permissions`` is for people inspecting
a deployment and taking stream backups: read-only JetStream requests, never a write to the log.
``apomesh_account`` puts users of these roles into one account, the shape the sample configs
in ``conf/nats/`` and the tests use. ``credential_identity`` reads, from the ``[nats]`` settings,
the name a worker's credentials carry (user name, NKey public key or the creds file's JWT name),
which a worker takes as its id so that the permissions above apply to it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from apomesh.adapters.jetstream_log import LOG_STREAM, LOG_SUBJECT_PREFIX
from apomesh.adapters.natsserver import Account, NatsUser, Permissions
from apomesh.runtime.config import NatsConfig
from apomesh.runtime.protocol import (
    CTL_BOUND_WILDCARD,
    CTL_PREFIX,
    DISPATCH_PREFIX,
    ECHO_PREFIX,
    HB_PREFIX,
    WORKER_INBOX_PREFIX,
    beat_subject,
    check_worker_id,
    dispatch_subject,
    worker_control_subjects,
    worker_inbox_prefix,
)

__all__ = [
    "ACCOUNT",
    "CONTROL_INBOX_PREFIX",
    "OPERATOR_INBOX_PREFIX",
    "apomesh_account",
    "control_permissions",
    "credential_identity",
    "daemon_permissions",
    "leaf_permissions",
    "operator_permissions",
    "worker_permissions",
]

ACCOUNT = "APOMESH"
"""The account name the samples and tests use."""

JS_API = "$JS.API.>"
KV_ALL = "$KV.>"
LOG_ALL = f"{LOG_SUBJECT_PREFIX}.>"
FORBIDDEN_TO_WORKERS = ("$JS.>", KV_ALL, LOG_ALL)
OPERATOR_INBOX_PREFIX = "_INBOX.operator"
"""The inbox prefix an operator's connection uses: the only replies it may hear."""
CONTROL_INBOX_PREFIX = "_INBOX.control"
"""The inbox prefix of the daemon's control-plane connection (the answers to its dispatches)."""


def daemon_permissions() -> Permissions:
    """The daemon: JetStream (log, heartbeat stream, KV), the control plane, its own inboxes."""
    return Permissions(
        publish=(
            JS_API,
            "$JS.ACK.>",
            "$JS.FC.>",
            KV_ALL,
            "apomesh.>",
            "_INBOX.>",
        ),
        subscribe=("apomesh.>", "_INBOX.>"),
        allow_responses=True,
    )


def control_permissions() -> Permissions:
    """The daemon's control-plane connection (one login may serve several daemons): it hears
    workers' bound control subjects (every daemon's) and heartbeats and its own inbox, answers
    into the workers' inboxes, sends dispatches and sends itself its echo; the JetStream API, the
    KV buckets and the log are denied, and it has no ``allow_responses``, so it can answer a
    request only on a subject it may publish to anyway."""
    return Permissions(
        publish=(f"{DISPATCH_PREFIX}*", f"{WORKER_INBOX_PREFIX}>", f"{ECHO_PREFIX}*"),
        subscribe=(
            CTL_BOUND_WILDCARD,
            f"{HB_PREFIX}*",
            f"{CONTROL_INBOX_PREFIX}.>",
            f"{ECHO_PREFIX}*",
        ),
        publish_deny=FORBIDDEN_TO_WORKERS,
        subscribe_deny=FORBIDDEN_TO_WORKERS,
    )


def worker_permissions(worker_id: str) -> Permissions:
    """One worker: its own heartbeat, dispatch, control subjects and inboxes, and nothing of
    JetStream, the log or the KV buckets."""
    check_worker_id(worker_id)
    return Permissions(
        publish=(beat_subject(worker_id), worker_control_subjects(worker_id)),
        subscribe=(dispatch_subject(worker_id), f"{worker_inbox_prefix(worker_id)}.>"),
        publish_deny=FORBIDDEN_TO_WORKERS,
        subscribe_deny=FORBIDDEN_TO_WORKERS,
        allow_responses=True,
    )


def leaf_permissions(worker_ids: Iterable[str]) -> Permissions:
    """The hub's login for a leaf node serving the edge workers ``worker_ids``. Leaf-node
    permissions are the hub's filter on the link: what the leaf may publish is what the hub
    takes from it, what it may subscribe to is what the hub sends it. Into the cluster only
    those workers' heartbeats, bound control subjects and answers to requests sent to them; out
    to the leaf only their dispatches and their own inboxes. So a host running the leaf, whatever
    it does to its own server, can speak and hear only as its own workers: never the log, KV or
    JetStream, never another worker's dispatch, reports or replies, never the control plane at
    large."""
    ids = [check_worker_id(worker_id) for worker_id in worker_ids]
    return Permissions(
        publish=(
            *(beat_subject(worker_id) for worker_id in ids),
            *(worker_control_subjects(worker_id) for worker_id in ids),
        ),
        subscribe=(
            *(dispatch_subject(worker_id) for worker_id in ids),
            *(f"{worker_inbox_prefix(worker_id)}.>" for worker_id in ids),
        ),
        publish_deny=FORBIDDEN_TO_WORKERS,
        subscribe_deny=FORBIDDEN_TO_WORKERS,
        allow_responses=True,
    )


def operator_permissions() -> Permissions:
    """A person's read-only view: stream and consumer info, direct gets of the log, stream
    snapshots (backups), live heartbeats. No writes to the log, KV or the control plane, and
    only its own replies (``_INBOX.operator.>``: connect with that inbox prefix, e.g. ``nats
    --inbox-prefix _INBOX.operator``), never the daemon's or the workers'."""
    return Permissions(
        publish=(
            "$JS.API.INFO",
            "$JS.API.STREAM.NAMES",
            "$JS.API.STREAM.LIST",
            "$JS.API.STREAM.INFO.*",
            "$JS.API.CONSUMER.NAMES.*",
            "$JS.API.CONSUMER.LIST.*",
            "$JS.API.CONSUMER.INFO.*.*",
            f"$JS.API.DIRECT.GET.{LOG_STREAM}",
            f"$JS.API.DIRECT.GET.{LOG_STREAM}.>",
            "$JS.API.STREAM.MSG.GET.*",
            "$JS.API.STREAM.SNAPSHOT.*",
            "$JS.SNAPSHOT.ACK.>",
        ),
        subscribe=(f"{OPERATOR_INBOX_PREFIX}.>", f"{HB_PREFIX}>"),
        publish_deny=(LOG_ALL, KV_ALL, f"{CTL_PREFIX}>", f"{DISPATCH_PREFIX}>"),
    )


def apomesh_account(
    *,
    daemon: NatsUser,
    workers: Mapping[str, NatsUser],
    operators: Iterable[NatsUser] = (),
    leaves: Iterable[tuple[NatsUser, Iterable[str]]] = (),
    control: NatsUser | None = None,
    name: str = ACCOUNT,
) -> Account:
    """One JetStream-enabled account holding the daemon (and its control-plane identity, when
    given), each worker (keyed by worker id), the operators and the logins leaf nodes link with
    (each with the ids of the edge workers behind it), each user given its role's permissions
    (any permissions on the users passed in are replaced). A leaf login is an account user, not
    a ``leafnodes`` authorization user: only an account user's permissions apply to the link."""
    users = [_with(daemon, daemon_permissions())]
    if control is not None:
        users.append(_with(control, control_permissions()))
    users += [_with(user, worker_permissions(worker_id)) for worker_id, user in workers.items()]
    users += [_with(user, operator_permissions()) for user in operators]
    users += [_with(user, leaf_permissions(edge)) for user, edge in leaves]
    return Account(name=name, users=tuple(users))


def _with(user: NatsUser, permissions: Permissions) -> NatsUser:
    return NatsUser(user=user.user, password=user.password, nkey=user.nkey, permissions=permissions)


# --------------------------------------------------------------------------------------------
# The identity a worker's credentials carry


def credential_identity(settings: NatsConfig) -> str | None:
    """The name the configured credentials give this connection: the user name, the public key
    of an NKey seed (needs the ``nkeys`` package), or the ``name`` of a creds file's JWT; ``None``
    without credentials that name anyone."""
    if settings.user:
        return settings.user
    if settings.nkey_seed_file:
        return _nkey_public_key(Path(settings.nkey_seed_file))
    if settings.creds_file:
        return _creds_name(Path(settings.creds_file))
    return None


def _nkey_public_key(seed_file: Path) -> str | None:
    try:
        import nkeys
    except ImportError:
        return None
    seed = bytearray(seed_file.read_bytes().strip())
    key_pair = nkeys.from_seed(seed)
    try:
        public: bytes = key_pair.public_key
        return public.decode()
    finally:
        key_pair.wipe()


def _creds_name(creds_file: Path) -> str | None:
    lines = creds_file.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if "BEGIN NATS USER JWT" in line and index + 1 < len(lines):
            token = lines[index + 1].strip()
            parts = token.split(".")
            if len(parts) != 3:
                return None
            payload = parts[1] + "=" * (-len(parts[1]) % 4)
            try:
                claims = json.loads(base64.urlsafe_b64decode(payload))
            except ValueError:
                return None
            name = claims.get("name") if isinstance(claims, dict) else None
            return name if isinstance(name, str) and name else None
    return None
