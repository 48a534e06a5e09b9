"""Recovery on real processes and a real nats-server: what the boot scan does with each kind of
session it finds, the operator's view of unknown outcomes, a daemon that lost its LMDB, session
verification against the store, and recovery classifiers as plugins.

The SIGKILL chaos (workers, daemons, a frozen worker, a restarted nats-server) is in
``test_chaos.py``; this module sets up each recovery case precisely, often by writing a session's
log straight to JetStream as a daemon that died would have left it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import lmdb
import msgspec
import pytest
from tests.e2e.chaos_kit import (
    appender,
    check_session,
    shape_of,
    stored_session,
    thinker,
)

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.kv import KvBuckets
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.nats_connect import connect
from apomesh.adapters.natsserver import NatsServer
from apomesh.core.decisions import Classification
from apomesh.core.envelope import Envelope
from apomesh.core.state import SessionState
from apomesh.plugins.api import Tool
from apomesh.plugins.hookspecs import hookimpl
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.config import load_config
from apomesh.runtime.daemon import Daemon
from apomesh.sdk.client import Client, ConfirmationRequired, EventRecord
from apomesh.testing import Mesh


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "200"},
    )


async def write_log(nats_url: str, *sessions: list[Envelope]) -> None:
    nc = await connect([nats_url])
    try:
        log = JetStreamLog(nc)
        await log.ensure()
        for envelopes in sessions:
            await log.append(envelopes[0].session_id, envelopes)
    finally:
        await nc.close()


async def restart(mesh: Mesh) -> None:
    """SIGKILL the daemon and start it again: its boot scan finds what the log holds."""
    await anyio.to_thread.run_sync(mesh.daemon.kill)
    await anyio.to_thread.run_sync(mesh.daemon.start)


async def boot(mesh: Mesh) -> None:
    """Start the (bare) mesh, as after a crash: the daemon's boot scan finds what the log holds."""
    await anyio.to_thread.run_sync(mesh.start)


async def finished(client: Client, session_id: str) -> list[EventRecord]:
    with anyio.fail_after(60):
        return [record async for record in client.events(session_id)]


# --- the operator sees unknown outcomes before confirming -----------------------------------------


@pytest.mark.anyio
async def test_unknown_outcome_is_shown_before_the_operator_confirms_and_resolved_by_the_probe(
    bare_mesh: Mesh,
) -> None:
    goal = "unknown-outcome"
    args = {"path": f"chaos/{goal}.txt", "line": f"{goal} line 0"}
    session_id = uuid.uuid4().hex
    # The daemon died between logging the intent and hearing the result.
    await write_log(
        bare_mesh.nats_url,
        stored_session(
            session_id, shape_of(appender(2)), goal=goal, events=5, open_intent=("fs.append", args)
        ),
    )
    await boot(bare_mesh)
    async with Client(bare_mesh.url) as client:
        preview = await client.recovery_preview(session_id)
        assert preview.category == "side_effects"
        assert [(u.agent, u.tool, u.args) for u in preview.unknown_outcomes] == [
            ("root", "fs.append", args)
        ]
        with pytest.raises(ConfirmationRequired) as refused:
            await client.resume(session_id, confirm=False)
        assert refused.value.preview.unknown_outcomes == preview.unknown_outcomes
        listed = run_cli("recover", "list", "--url", bare_mesh.url)
        assert listed.returncode == 0 and session_id[:8] in listed.stdout
        resumed = run_cli("recover", "resume", session_id, "--yes", "--url", bare_mesh.url)
        assert resumed.returncode == 0, resumed.stderr
        assert "outcome is unknown" in resumed.stdout and f"{goal} line 0" in resumed.stdout
        records = await finished(client, session_id)
        verification = await client.verify_session(session_id)
    check = check_session(records, verification, bare_mesh.daemon.workspace)
    assert check.ok, check.problems
    recorded = [r.event for r in records if r.kind == "ToolCallRecorded"]
    # fs.append has a probe: asked after the resume, it finds the line was never appended, so
    # the call runs now, once (its "fail" policy is only the fallback when a probe cannot tell).
    assert recorded[0]["outcome"] == "ok"
    intents = [r.event for r in records if r.kind == "ToolCallIntent"]
    assert [i.get("resolution", "") for i in intents if i["args"] == args] == ["", "not_happened"]
    assert [r.event["action"] for r in records if r.kind == "OperatorAction"] == ["resume"]
    assert [r.event["reason"] for r in records if r.kind == "AgentResuming"] == ["operator resume"]
    lines = (bare_mesh.daemon.workspace / session_id / args["path"]).read_text().splitlines()
    assert lines.count(f"{goal} line 0") == 1 and f"{goal} line 1" in lines


# --- what the boot scan does with each kind of session --------------------------------------------


@pytest.mark.anyio
async def test_boot_scan_resumes_safe_sessions_lists_the_rest_and_never_revives_the_ended(
    bare_mesh: Mesh,
) -> None:
    shape = shape_of(thinker(2))
    safe, effects, ended, unborn, garbage = (uuid.uuid4().hex for _ in range(5))
    half_started = stored_session(unborn, shape, goal="unborn", events=1)
    await write_log(
        bare_mesh.nats_url,
        stored_session(safe, shape, goal="safe", events=8),
        stored_session(
            effects,
            shape,
            goal="effects",
            side_effect=("fs.append", {"path": "x", "line": "y"}, False),
        ),
        stored_session(ended, shape, goal="ended", terminal=True),
        half_started,  # the daemon died between SessionStarted and the root's birth
    )
    nc = await connect([bare_mesh.nats_url])
    try:
        await nc.publish(f"apomesh.log.{garbage}", b"\x93not an envelope")
        await nc.flush()
    finally:
        await nc.close()
    await boot(bare_mesh)
    async with Client(bare_mesh.url) as client:
        recoverable = {r.session_id: r for r in await client.list_recoverable()}
        assert set(recoverable) == {effects, garbage}
        assert recoverable[effects].reason.startswith("side effects logged")
        assert recoverable[effects].side_effects == 1
        assert recoverable[garbage].category == "undecodable"
        assert "cannot be decoded" in bare_mesh.daemon.output_tail()
        for session_id in (safe, unborn):
            records = await finished(client, session_id)
            assert records[-1].kind == "SessionEnded" and records[-1].event["status"] == "completed"
            recovered = [r.event for r in records if r.kind == "SessionRecovered"]
            assert [r["path"] for r in recovered] == ["auto"]
        safe_log = await finished(client, safe)
        assert [r.event["reason"] for r in safe_log if r.kind == "AgentResuming"] == [
            "daemon restart"
        ]
        ended_view = await client.get_session(ended)
        assert ended_view.status == "completed"
        assert ended_view.last_index == 19  # nothing appended to an ended session
        verification = await client.verify_session(ended)
        assert verification["completed_record"] is True  # the boot scan wrote the missing record
        # Its snapshots were stored by the dead daemon: missing here, and said so.
        assert {p["kind"] for p in verification["problems"]} == {"snapshot_missing"}
        # Resuming the side-effect session deliberately lets it finish (the root starts over from
        # its birth config: the dead daemon's snapshots are not in this store).
        await client.resume(effects)
        records = await finished(client, effects)
        assert records[-1].event["status"] == "completed"
        assert sum(1 for r in records if r.kind == "ToolCallIntent") == 1


# --- losing the daemon's LMDB ---------------------------------------------------------------------


def _lmdb_alone(mesh: Mesh) -> None:
    """Start the (bare) mesh's daemon with LMDB alone (``[store] replicated = "off"``) and two
    workers: a daemon given NATS URLs, as the mesh's is, writes through to the replicated bucket
    by default."""
    mesh.daemon.env["APOMESH_STORE_REPLICATED"] = "off"
    mesh.start(2)


@pytest.mark.anyio
async def test_lost_lmdb_never_reruns_a_side_effect_and_the_session_completes(
    bare_mesh: Mesh,
) -> None:
    goal = "lost-lmdb"
    await anyio.to_thread.run_sync(_lmdb_alone, bare_mesh)
    async with Client(bare_mesh.url) as client:
        session_id = await client.start_session(goal, definition=appender(6, delay=0.3))
        recorded = 0
        with anyio.fail_after(30):
            async for record in client.events(session_id):
                recorded += record.kind == "ToolCallRecorded"
                if recorded == 3:
                    break
        await anyio.to_thread.run_sync(bare_mesh.daemon.kill)
        shutil.rmtree(bare_mesh.daemon.data_dir / "lmdb")
        await anyio.to_thread.run_sync(bare_mesh.daemon.start)
        preview = await client.recovery_preview(session_id)
        assert preview.side_effects >= 3
        await client.resume(session_id)  # at once: the lease owner survived in daemon.id
        records = await finished(client, session_id)
        verification = await client.verify_session(session_id)
    check = check_session(records, verification, bare_mesh.daemon.workspace)
    # The snapshots the lost store held are reported missing; nothing else disagrees.
    kinds = {p["kind"] for p in verification["problems"]}
    assert kinds == {"snapshot_missing"}, verification
    check.problems = [p for p in check.problems if not p.startswith("verification")]
    assert check.ok, check.problems
    assert check.status == "completed"
    # The log alone said which lines were written: each exactly once (or at most once when the
    # kill cut a call short), and the restarted agent replayed them from the log's journal.
    lines = (bare_mesh.daemon.workspace / session_id / f"chaos/{goal}.txt").read_text().splitlines()
    assert len(lines) == len(set(lines))
    intents = [r for r in records if r.kind == "ToolCallIntent"]
    assert len(intents) == len({r.event["key"] for r in intents}) == 6


# --- verification ---------------------------------------------------------------------------------


def _tamper(data_dir: Path, session_id: str) -> None:
    """Drop the root's latest snapshot, change a journal result and the completed record."""
    env = lmdb.open(str(data_dir / "lmdb"), max_dbs=16, map_size=1 << 30)
    try:
        agent_key = f"{session_id}/root"
        with env.begin(write=True) as txn:
            snapshots = env.open_db(b"snapshots", txn=txn)
            cursor = txn.cursor(snapshots)
            latest = None
            for key, _ in cursor:
                if key.startswith(agent_key.encode() + b"\x00"):
                    latest = key
            assert latest is not None
            txn.delete(latest, db=snapshots)
            journal = env.open_db(b"journal", txn=txn)
            for key, value in txn.cursor(journal):
                if key.startswith(agent_key.encode() + b"\x00"):
                    record = msgspec.msgpack.decode(value)
                    if "outcome" in record:
                        record["result"] = "something else"
                        txn.put(key, msgspec.msgpack.encode(record), db=journal)
                        break
            completed = env.open_db(b"completed", txn=txn)
            record = msgspec.msgpack.decode(txn.get(session_id.encode(), db=completed))
            record["output"] = "not what the log says"
            txn.put(session_id.encode(), msgspec.msgpack.encode(record), db=completed)
    finally:
        env.close()


@pytest.mark.anyio
async def test_verify_agrees_with_a_clean_session_and_reports_every_disagreement(
    bare_mesh: Mesh,
) -> None:
    await anyio.to_thread.run_sync(_lmdb_alone, bare_mesh)  # the tampering is done to LMDB
    async with Client(bare_mesh.url) as client:
        session_id = await client.start_session("verified", definition=appender(3, delay=0.0))
        await finished(client, session_id)
        # The event stream ends at the terminal event; the completed record is written as the
        # writer leaves, a moment after it.
        with anyio.fail_after(30):
            while not (report := await client.verify_session(session_id))["completed_record"]:
                await anyio.sleep(0.05)
        assert report["ok"], report
        assert report["status"] == "completed" and report["completed_record"] is True
        # Three steps (each its turn, recorded before its call, and its node), the final turn.
        assert report["snapshots_checked"] == 7 and report["journal_checked"] == 3
        clean = run_cli("sessions", "verify", session_id, "--url", bare_mesh.url)
        assert clean.returncode == 0, clean.stdout + clean.stderr
        await anyio.to_thread.run_sync(bare_mesh.daemon.stop)
        _tamper(bare_mesh.daemon.data_dir, session_id)
        await anyio.to_thread.run_sync(bare_mesh.daemon.start)
        report = await client.verify_session(session_id)
        assert not report["ok"]
        kinds = sorted(p["kind"] for p in report["problems"])
        assert kinds == ["completed_mismatch", "journal_mismatch", "snapshot_missing"], report
        dirty = run_cli("sessions", "verify", session_id, "--url", bare_mesh.url)
        assert dirty.returncode == 1 and "snapshot_missing" in dirty.stdout
        missing = await anyio.to_thread.run_sync(
            lambda: httpx.get(f"{bare_mesh.url}/v1/sessions/{uuid.uuid4().hex}/verify")
        )
        assert missing.status_code == 404


# --- recovery classifiers are plugins -------------------------------------------------------------


class AutoResumeIdempotent:
    """Allows auto-resume when every logged side effect comes from an idempotent tool."""

    name = "idempotent-only"

    def classify(
        self, state: SessionState, pin_problem: str | None, tools: dict[str, Tool]
    ) -> Classification | None:
        if state.terminal or state.bootstrap is None or pin_problem is not None:
            return None
        entries = state.journal.values()
        if entries and all(
            tools.get(e.tool) is not None and tools[e.tool].idempotent for e in entries
        ):
            return Classification("auto_resume", "only idempotent side effects logged", "auto")
        return None


class OperatorAlways:
    """Stricter than the default: nothing resumes without an operator."""

    name = "operator-always"

    def classify(
        self, state: SessionState, pin_problem: str | None, tools: dict[str, Tool]
    ) -> Classification | None:
        if state.terminal:
            return None
        return Classification("recoverable", "this site resumes nothing on its own", "policy")


def classifier_plugin(classifier: object) -> object:
    class Plugin:
        apomesh_plugin_name = f"test-{getattr(classifier, 'name', 'classifier')}"

        @hookimpl
        def register_recovery_classifiers(self, register: Callable[[Any], None]) -> None:
            register(classifier)

    return Plugin()


@contextlib.asynccontextmanager
async def in_process_daemon(
    nats_url: str, tmp: Path, host: PluginHost
) -> AsyncIterator[tuple[Daemon, JetStreamLog]]:
    """A daemon in this process on the NATS at ``nats_url`` (its data dir ``tmp``, ``host``'s
    plugins), not started, and its log; closed with everything it opened."""
    nc = await connect([nats_url])
    store = AsyncStore(LmdbStore(tmp / "lmdb"))
    config = load_config(None, env={}, overrides={"daemon": {"data_dir": str(tmp)}})
    log = JetStreamLog(nc)
    daemon = Daemon(
        config,
        nc=nc,
        log_adapter=log,
        heartbeats=HeartbeatStream(nc),
        kv=await KvBuckets.open(nc),
        store=store,
        plugins=host,
        workspace=tmp / "workspace",
    )
    try:
        yield daemon, log
    finally:
        await daemon.aclose()
        await nc.close()
        await store.aclose()


async def boot_scan_with(
    server: NatsServer, tmp: Path, host: PluginHost, sessions: dict[str, list[Envelope]]
) -> tuple[dict[str, Any], dict[str, str], set[str]]:
    """Write ``sessions`` to a fresh log, boot an in-process daemon with ``host``'s plugins and
    answer (its boot report, the recoverable sessions' categories, the auto-resumed ids)."""
    await write_log(server.url, *sessions.values())
    async with in_process_daemon(server.url, tmp, host) as (daemon, _):
        await daemon.start()
        return (
            dict(daemon.boot_report),
            {sid: rec.category for sid, rec in daemon.registry.stranded.items()},
            set(daemon.registry.live),
        )


def _classified_sessions(host: PluginHost) -> dict[str, list[Envelope]]:
    shape = shape_of(thinker(2), host)
    write = ("fs.write", {"path": "out.txt", "content": "same"}, True)
    append = ("fs.append", {"path": "out.txt", "line": "again"}, False)
    return {
        "quiet": stored_session("quiet", shape, events=6),
        "idempotent": stored_session("idempotent", shape, side_effect=write),
        "appending": stored_session("appending", shape, side_effect=append),
    }


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("classifier", "auto", "recoverable"),
    [
        (None, {"quiet"}, {"idempotent": "side_effects", "appending": "side_effects"}),
        (
            OperatorAlways(),
            set(),
            {"quiet": "policy", "idempotent": "policy", "appending": "policy"},
        ),
    ],
    ids=["builtin", "stricter"],
)
async def test_recovery_classifier_plugins_decide_before_the_builtin_rules(
    fresh_nats_server: NatsServer,
    tmp_path: Path,
    classifier: object | None,
    auto: set[str],
    recoverable: dict[str, str],
) -> None:
    host = PluginHost.for_tests(*([classifier_plugin(classifier)] if classifier else []))
    with anyio.fail_after(60):  # a daemon that cannot start or stop fails here, not at 300 s
        report, listed, resumed = await boot_scan_with(
            fresh_nats_server, tmp_path, host, _classified_sessions(host)
        )
    assert resumed == auto
    assert listed == recoverable
    assert report["auto_resume"] == len(auto) and report["recoverable"] == len(recoverable)


@pytest.mark.anyio
async def test_the_boot_scan_starts_the_sessions_it_adopted_in_waves_once_all_are_classified(
    fresh_nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions adopted by the scan are leased as they are classified and started afterwards,
    ``START_WAVE`` at a time: each wave logs its ``SessionRecovered`` and every one is started.
    The collector paused for the scan runs again after it, and what the scan froze out of its
    walks is given back once the waves are started."""
    from apomesh.runtime import recovery

    monkeypatch.setattr(recovery, "START_WAVE", 2)
    host = PluginHost.for_tests()
    shape = shape_of(thinker(2), host)
    sessions = {f"quiet{n}": stored_session(f"quiet{n}", shape, events=6) for n in range(7)}
    await write_log(fresh_nats_server.url, *sessions.values())
    async with in_process_daemon(fresh_nats_server.url, tmp_path, host) as (daemon, log):
        with anyio.fail_after(60):
            await daemon.start()
            assert daemon.boot_report["auto_resume"] == 7
            live = dict(daemon.registry.live)
            assert set(live) == set(sessions)
            for runtime in live.values():
                await runtime.opened.wait()  # no worker: each waits for room after its opening
            for session_id in sessions:
                kinds = [type(env.event).__name__ for env in await log.read(session_id)]
                assert kinds[6] == "SessionRecovered", kinds
            assert all(r.task is not None and not r.task.done() for r in live.values())
            assert gc.isenabled()
            while gc.get_freeze_count():
                await anyio.sleep(0.01)
