"""The identity a worker's credentials carry, and the permissions each role gets (the e2e tests
in ``tests/e2e/test_security.py`` prove the server enforces them)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from tests.e2e.certs import make_nkey_user

from apomesh.runtime.config import NatsConfig
from apomesh.runtime.nats_permissions import (
    control_permissions,
    credential_identity,
    daemon_permissions,
    worker_permissions,
)
from apomesh.runtime.protocol import check_worker_id


def _jwt(claims: dict[str, object]) -> str:
    def part(data: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    return f"{part({'typ': 'JWT', 'alg': 'ed25519-nkey'})}.{part(claims)}.c2lnbmF0dXJl"


def test_a_worker_takes_its_id_from_its_credentials(tmp_path: Path) -> None:
    assert credential_identity(NatsConfig(user="edge-2", password="x")) == "edge-2"
    seed_file, public_key = make_nkey_user(tmp_path, "edge-1")
    assert credential_identity(NatsConfig(nkey_seed_file=str(seed_file))) == public_key
    creds = tmp_path / "worker.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{_jwt({'name': 'edge-3', 'sub': 'U...'})}\n"
        "------END NATS USER JWT------\n"
    )
    assert credential_identity(NatsConfig(creds_file=str(creds))) == "edge-3"
    assert credential_identity(NatsConfig()) is None
    assert credential_identity(NatsConfig(token="t")) is None


def test_a_worker_id_must_be_one_subject_token() -> None:
    assert check_worker_id("edge-2") == "edge-2"
    for bad in ("", "edge.2", "edge*", "edge>", "edge 2"):
        with pytest.raises(ValueError, match="subject token"):
            check_worker_id(bad)
        with pytest.raises(ValueError):
            worker_permissions(bad)


def test_a_worker_may_use_only_subjects_that_name_it() -> None:
    rules = worker_permissions("edge-2")
    assert rules.publish == ("apomesh.hb.edge-2", "apomesh.ctl.*.*.edge-2")
    assert rules.subscribe == ("apomesh.dispatch.edge-2", "_INBOX.worker.edge-2.>")
    for forbidden in ("$JS.>", "$KV.>", "apomesh.log.>"):
        assert forbidden in rules.publish_deny and forbidden in rules.subscribe_deny
    assert rules.allow_responses
    daemon = daemon_permissions()
    assert "$JS.API.>" in daemon.publish and "apomesh.>" in daemon.subscribe


@pytest.mark.parametrize(
    ("subject", "reply", "answered"),
    [
        ("apomesh.ctl.d1.node.w1", "_INBOX.worker.w1.abc.1", True),
        ("apomesh.ctl.d1.register.w1", "_INBOX.worker.w1.x", True),
        ("apomesh.ctl.d1.node.w1", "", False),
        ("apomesh.ctl.d1.node.w1", "$JS.API.STREAM.PURGE.APOMESH_LOG", False),
        ("apomesh.ctl.d1.node.w1", "apomesh.log.s1", False),
        ("apomesh.ctl.d1.node.w1", "$KV.APOMESH_SKILLS.k", False),
        ("apomesh.ctl.d1.node.w1", "_INBOX.worker.w2.x", False),
        ("apomesh.ctl.d1.node.w1", "_INBOX.worker.w1", False),
        ("apomesh.ctl.d1.node.w1", "_INBOX.worker.w1.", False),
        ("apomesh.ctl.d1.node.w1", "_INBOX.worker.w10.x", False),
        ("apomesh.ctl.d1.node", "_INBOX.worker.node.x", False),
        ("apomesh.ctl.node.w1", "_INBOX.worker.w1.x", False),
        ("apomesh.ctl.d1.node.w1.x", "_INBOX.worker.x.y", False),
        ("apomesh.hb.x.w1", "_INBOX.worker.w1.x", False),
    ],
)
def test_the_daemon_answers_only_on_the_senders_own_inbox(
    subject: str, reply: str, answered: bool
) -> None:
    from apomesh.runtime.protocol import answerable

    assert answerable(subject, reply) is answered


def test_a_leaf_login_carries_only_its_edge_workers_subjects() -> None:
    from apomesh.runtime.nats_permissions import leaf_permissions

    rules = leaf_permissions(["e1", "e2"])
    assert rules.publish == (
        "apomesh.hb.e1",
        "apomesh.hb.e2",
        "apomesh.ctl.*.*.e1",
        "apomesh.ctl.*.*.e2",
    )
    assert rules.subscribe == (
        "apomesh.dispatch.e1",
        "apomesh.dispatch.e2",
        "_INBOX.worker.e1.>",
        "_INBOX.worker.e2.>",
    )
    assert rules.allow_responses
    with pytest.raises(ValueError):
        leaf_permissions(["a.b"])


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://u:secret@h:4222", "nats://u:***@h:4222"),
        ("tls://tok@h:4222", "tls://***@h:4222"),
        ("nats://h:4222", "nats://h:4222"),
        ("u:p@h:4222", "u:***@h:4222"),
        ("ws://u:p%40x@h:80/path", "ws://u:***@h:80/path"),
    ],
)
def test_urls_are_logged_without_their_secrets(url: str, shown: str) -> None:
    from apomesh.adapters.nats_connect import redact_url

    assert redact_url(url) == shown


def test_the_control_plane_role_has_no_jetstream_kv_or_log() -> None:
    control = control_permissions()
    assert set(control.publish) == {"apomesh.dispatch.*", "_INBOX.worker.>", "apomesh.echo.*"}
    assert set(control.subscribe) == {
        "apomesh.ctl.*.*.*",
        "apomesh.hb.*",
        "_INBOX.control.>",
        "apomesh.echo.*",
    }
    for denied in ("$JS.>", "$KV.>", "apomesh.log.>"):
        assert denied in control.publish_deny and denied in control.subscribe_deny
    assert not control.allow_responses  # an answer goes only where it may publish anyway


def test_the_control_connection_comes_from_the_control_keys(tmp_path: Path) -> None:
    from apomesh.core.errors import DefinitionError
    from apomesh.runtime.config import Config
    from apomesh.runtime.node import control_nats_options

    assert control_nats_options(Config()) is None
    password = tmp_path / "control.password"
    password.write_text("s3cret\n")
    options = control_nats_options(
        Config(nats=NatsConfig(control_user="control", control_password_file=str(password)))
    )
    assert options is not None
    assert (options["user"], options["password"]) == ("control", "s3cret")
    assert options["inbox_prefix"] == "_INBOX.control"
    seed_file, _ = make_nkey_user(tmp_path, "control")
    options = control_nats_options(Config(nats=NatsConfig(control_nkey_seed_file=str(seed_file))))
    assert options is not None and options["nkey_seed_file"] == str(seed_file)
    assert "user" not in options
    missing = NatsConfig(control_user="control", control_password_file=str(tmp_path / "none"))
    with pytest.raises(DefinitionError, match="control_password_file"):
        control_nats_options(Config(nats=missing))
