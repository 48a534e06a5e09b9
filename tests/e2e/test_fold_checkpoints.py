"""Folded-state checkpoints across a daemon SIGKILL, on a real nats-server, a real ``apomesh serve``
process and its real state store (LMDB, written through to the replicated bucket, as a daemon given
NATS URLs runs it).

- A session that crossed the checkpoint threshold (ten events here) is resumed after a SIGKILL
  from its checkpoint: the boot scan folds only the events after it, and the state it resumes
  from is the fold of the whole log. Once the session ends its checkpoint is gone.
- A checkpoint the log contradicts (its event id is not the log's at its index) and one that does
  not decode are ignored: those sessions fold from their first event, and resume correctly.
- At the default ``fold_checkpoint_interval`` a parked session's checkpoint becomes current: after
  a SIGKILL the boot scan reads none of its events (the log's message count confirms it), and the
  restarted writer keeps counting, so after a second SIGKILL its checkpoint is current again.
- A session stranded for an operator (a side effect, then a SIGKILL) has no writer to store its
  checkpoint: the boot scan that folded it does, and the next start reads none of its events.

The first two run with a checkpoint interval of an hour: only the threshold writes one there.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import msgspec
import nats.js.errors
import pytest

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.nats_connect import connect
from apomesh.adapters.natsserver import NatsServer
from apomesh.adapters.replicated_store import STATE_BUCKET, kv_key
from apomesh.core.state import SessionState, fold
from apomesh.core.state_codec import decode_checkpoint
from apomesh.core.views import session_view
from apomesh.runtime.config import load_config
from apomesh.runtime.fold_checkpoints import CHECKPOINT_DB, FoldCheckpoints
from apomesh.runtime.node import open_state_store
from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess

pytestmark = pytest.mark.anyio

EVERY = 10
"""The checkpoint threshold the daemon runs with: a session of a few dozen events crosses it."""
DEADLINE = 60.0


def long_thinker(steps: int = 12) -> dict[str, Any]:
    """A solo agent that looks around ``steps`` times (no side effect), then asks a human and
    parks on the pause: its log holds still while the daemon is killed and restarted."""
    look = {"tool": "fs.list", "args": {"path": "."}}
    turns: list[dict[str, Any]] = [
        {"text": f"step {n}", "tool_calls": [look]} for n in range(steps)
    ]
    turns.append({"tool_calls": [{"tool": "ask_human", "args": {"question": "Go on?"}}]})
    turns.append({"final": "done"})
    return {
        "name": "long-thinker",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.list", "ask_human"],
        "model": {"provider": "scripted", "turns": turns},
    }


@pytest.fixture(scope="module")
def daemon(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    yield from running(
        nats_server, tmp_path_factory.mktemp("checkpoints"), every=EVERY, interval=3600
    )


@pytest.fixture
def current_daemon(
    fresh_nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """A daemon at the default checkpoint settings, on a nats-server of its own (no peer to take
    its sessions over while it is killed)."""
    yield from running(fresh_nats_server, tmp_path_factory.mktemp("current"))


def running(server: NatsServer, base: Path, **snapshots: int) -> Iterator[DaemonProcess]:
    """A daemon with one worker on ``server``, its data dir under ``base``, with these
    ``[snapshots]`` settings (``every``: ``fold_checkpoint_every``; ``interval``:
    ``fold_checkpoint_interval``), stopped at the end."""
    names = {"every": "EVERY", "interval": "INTERVAL"}
    env = {f"APOMESH_SNAPSHOTS_FOLD_CHECKPOINT_{names[k]}": str(v) for k, v in snapshots.items()}
    process = DaemonProcess([server.url], base / "daemon", workers=1, env=env)
    process.start()
    try:
        yield process
    finally:
        process.stop()


async def read_log(nats_url: str, session_id: str) -> SessionState:
    nc = await connect([nats_url])
    try:
        return fold(await JetStreamLog(nc).read(session_id), session_id)
    finally:
        await nc.close()


async def parked(client: Client, nats_url: str, session_id: str, after: int = -1) -> SessionState:
    """The session's folded log once it is parked on an open pause past index ``after``."""
    with anyio.fail_after(DEADLINE):
        while True:
            view = await client.get_session(session_id)
            if view.status == "paused" and view.last_index > after:
                state = await read_log(nats_url, session_id)
                if state.hitl_pending and state.last_index == view.last_index:
                    return state
            await anyio.sleep(0.05)


@contextlib.asynccontextmanager
async def daemon_store(daemon: DaemonProcess) -> AsyncIterator[AsyncStore]:
    """The state store of a stopped daemon, opened as it opens it (its LMDB, written through to
    the replicated bucket, which is the authority)."""
    config = load_config(None, env={}, overrides={"nats": {"urls": daemon.nats_urls}})
    store = AsyncStore(await open_state_store(config, daemon.data_dir, daemon.nats_urls, {}))
    try:
        yield store
    finally:
        await store.aclose()


async def stored(daemon: DaemonProcess) -> dict[str, bytes]:
    """The checkpoint records in a stopped daemon's state store, by session."""
    async with daemon_store(daemon) as store:
        return dict(await store.scan(CHECKPOINT_DB, ""))


async def checkpoint_dropped(nats_url: str, session_id: str) -> None:
    """Wait until the replicated state bucket (the store's authority, which its listings read)
    holds no checkpoint of the ended session: its writer drops it in a task of its own just after
    the end, so a kill at once can come first (the boot scan then skips the ended session)."""
    nc = await connect(nats_url)
    try:
        bucket = await nc.jetstream().key_value(STATE_BUCKET)
        with anyio.fail_after(DEADLINE):
            while True:
                try:
                    await bucket.get(kv_key(CHECKPOINT_DB, session_id))
                except nats.js.errors.KeyNotFoundError:
                    return
                await anyio.sleep(0.05)
    finally:
        await nc.close()


def boot_report(daemon: DaemonProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{daemon.url}/healthz", timeout=10).json()["boot"])


async def finish(client: Client, nats_url: str, session_id: str) -> None:
    state = await read_log(nats_url, session_id)
    (pause_id,) = state.hitl_pending
    await client.answer_hitl(session_id, pause_id, "yes")
    with anyio.fail_after(DEADLINE):
        while (await client.get_session(session_id)).status != "completed":
            await anyio.sleep(0.05)


async def same_as_the_log(client: Client, nats_url: str, session_id: str, before: int) -> None:
    """The restarted daemon drives the session from a state equal to the fold of its whole log:
    parked again on the same question, its view (the writer's state) is the log's."""
    state = await parked(client, nats_url, session_id, after=before)
    view = await client.get_session(session_id)
    expected = session_view(state)
    assert view.last_index == expected.last_index == state.last_index
    assert view.status == "paused"
    assert [(a.ref, a.parent, a.phase) for a in view.agents] == [
        (a.ref, a.parent, a.phase) for a in expected.agents
    ]
    assert view.side_effects == expected.side_effects == 0


async def test_a_long_session_resumes_from_its_checkpoint_reading_only_the_tail(
    daemon: DaemonProcess, nats_server: NatsServer
) -> None:
    client = Client(daemon.url)
    session_id = await client.start_session("think long", definition=long_thinker())
    before = await parked(client, nats_server.url, session_id)
    assert before.last_index > EVERY
    await anyio.to_thread.run_sync(daemon.kill)

    records = await stored(daemon)
    assert set(records) == {session_id}
    checkpoint = decode_checkpoint(records[session_id])
    assert EVERY <= checkpoint.index <= before.last_index
    assert checkpoint.seq is not None  # JetStream told the writer where the event is stored

    await anyio.to_thread.run_sync(daemon.start)
    report = boot_report(daemon)
    assert report["from_checkpoints"] == 1
    assert report["checkpoints_ignored"] == 0
    assert report["events_folded"] == before.last_index - checkpoint.index
    await same_as_the_log(client, nats_server.url, session_id, before.last_index)

    await finish(client, nats_server.url, session_id)
    await checkpoint_dropped(nats_server.url, session_id)
    await anyio.to_thread.run_sync(daemon.kill)
    assert await stored(daemon) == {}  # an ended session keeps no checkpoint
    await anyio.to_thread.run_sync(daemon.start)


async def test_a_checkpoint_the_log_contradicts_or_that_does_not_decode_is_ignored(
    daemon: DaemonProcess, nats_server: NatsServer
) -> None:
    client = Client(daemon.url)
    contradicted = await client.start_session("contradicted", definition=long_thinker())
    garbled = await client.start_session("garbled", definition=long_thinker())
    states = {s: await parked(client, nats_server.url, s) for s in (contradicted, garbled)}
    await anyio.to_thread.run_sync(daemon.kill)

    records = await stored(daemon)
    assert set(records) == {contradicted, garbled}
    # As if the log had been purged and the session id reused: another event at its index. (A
    # checkpoint that counted the session's messages, and whose count the log still has, is not
    # read again: a session's subject is only appended to, or purged whole with the session.)
    wrong = msgspec.structs.replace(
        decode_checkpoint(records[contradicted]), event_id="f" * 32, messages=None
    )
    async with daemon_store(daemon) as store:
        await FoldCheckpoints(store).write(wrong)
        await store.write_batch([(CHECKPOINT_DB, garbled, b"\xc1 not a checkpoint")])

    await anyio.to_thread.run_sync(daemon.start)
    report = boot_report(daemon)
    assert report["from_checkpoints"] == 0
    assert report["checkpoints_ignored"] == 2
    # Both folded from their first event.
    assert report["events_folded"] == sum(s.last_index + 1 for s in states.values())
    for session_id, state in states.items():
        await same_as_the_log(client, nats_server.url, session_id, state.last_index)
        await finish(client, nats_server.url, session_id)


async def current_in_the_bucket(nats_url: str, session_id: str, index: int) -> None:
    """Wait until the replicated bucket holds the session's checkpoint at ``index``."""
    nc = await connect(nats_url)
    try:
        bucket = await nc.jetstream().key_value(STATE_BUCKET)
        with anyio.fail_after(DEADLINE):
            while True:
                with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                    entry = await bucket.get(kv_key(CHECKPOINT_DB, session_id))
                    value = entry.value or b""
                    # A whole value (frame tag 0) is all a checkpoint of this size takes.
                    if value[:1] == b"\x00" and decode_checkpoint(value[1:]).index == index:
                        return
                await anyio.sleep(0.05)
    finally:
        await nc.close()


async def read_none_of_its_events(
    daemon: DaemonProcess, client: Client, nats_url: str, session_id: str, before: int
) -> None:
    """The started daemon's boot scan took the session's checkpoint as current (its only
    session: no event folded), and drives it from a state equal to the fold of its log."""
    report = boot_report(daemon)
    assert report["current_checkpoints"] == report["from_checkpoints"] == 1
    assert report["events_folded"] == 0
    await same_as_the_log(client, nats_url, session_id, before)


async def test_a_current_checkpoint_is_read_instead_of_the_log_after_a_sigkill(
    current_daemon: DaemonProcess, fresh_nats_server: NatsServer
) -> None:
    daemon = current_daemon
    client = Client(daemon.url)
    session_id = await client.start_session("think", definition=long_thinker(steps=3))
    before = await parked(client, fresh_nats_server.url, session_id)
    await current_in_the_bucket(fresh_nats_server.url, session_id, before.last_index)
    await anyio.to_thread.run_sync(daemon.kill)

    checkpoint = decode_checkpoint((await stored(daemon))[session_id])
    assert checkpoint.messages is not None and checkpoint.log_id is not None
    assert checkpoint.bootstrap is not None  # the shape is kept once, beside it

    await anyio.to_thread.run_sync(daemon.start)
    await read_none_of_its_events(
        daemon, client, fresh_nats_server.url, session_id, before.last_index
    )

    # The restarted writer counted on from the checkpoint: its next one is current too.
    again = await parked(client, fresh_nats_server.url, session_id, after=before.last_index)
    await current_in_the_bucket(fresh_nats_server.url, session_id, again.last_index)
    await anyio.to_thread.run_sync(daemon.kill)
    await anyio.to_thread.run_sync(daemon.start)
    await read_none_of_its_events(
        daemon, client, fresh_nats_server.url, session_id, again.last_index
    )
    await finish(client, fresh_nats_server.url, session_id)


async def test_a_session_folded_on_from_its_checkpoint_leaves_a_current_one_at_a_clean_stop(
    daemon: DaemonProcess, nats_server: NatsServer
) -> None:
    """The pass folds a checkpoint's tail and counts the session's messages on from the count
    the checkpoint holds; the writer keeps counting, and a clean stop writes its checkpoint: the
    next start reads none of its events."""
    client = Client(daemon.url)
    session_id = await client.start_session("think on", definition=long_thinker())
    before = await parked(client, nats_server.url, session_id)
    await anyio.to_thread.run_sync(daemon.kill)
    behind = decode_checkpoint((await stored(daemon))[session_id])
    assert behind.index < before.last_index  # only the threshold wrote it (an hour's interval)

    await anyio.to_thread.run_sync(daemon.start)
    report = boot_report(daemon)
    assert (report["current_checkpoints"], report["from_checkpoints"]) == (0, 1)
    assert report["events_folded"] == before.last_index - behind.index
    again = await parked(client, nats_server.url, session_id, after=before.last_index)

    await anyio.to_thread.run_sync(daemon.stop)
    await anyio.to_thread.run_sync(daemon.start)
    await read_none_of_its_events(daemon, client, nats_server.url, session_id, again.last_index)
    await finish(client, nats_server.url, session_id)


def writes_then_asks() -> dict[str, Any]:
    """A solo agent that appends a line to a file (a side effect: after a SIGKILL its session
    waits for an operator), then asks a human."""
    append = {"tool": "fs.append", "args": {"path": "notes.txt", "line": "a line"}}
    ask = {"tool": "ask_human", "args": {"question": "Go on?"}}
    return {
        "name": "writes-then-asks",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.append", "ask_human"],
        "model": {
            "provider": "scripted",
            "turns": [{"tool_calls": [append]}, {"tool_calls": [ask]}, {"final": "done"}],
        },
    }


@pytest.fixture
def quiet_daemon(
    fresh_nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """A daemon whose writers store no checkpoint of a short session (an hour's interval, a
    threshold of 100,000 events), on a nats-server of its own."""
    yield from running(
        fresh_nats_server, tmp_path_factory.mktemp("quiet"), every=100_000, interval=3600
    )


async def test_a_stranded_session_gets_its_checkpoint_from_the_boot_scan(
    quiet_daemon: DaemonProcess, fresh_nats_server: NatsServer
) -> None:
    daemon, url = quiet_daemon, fresh_nats_server.url
    client = Client(daemon.url)
    session_id = await client.start_session("write", definition=writes_then_asks())
    before = await parked(client, url, session_id)
    assert before.side_effects == 1
    await anyio.to_thread.run_sync(daemon.kill)
    assert await stored(daemon) == {}  # its writer stored none

    await anyio.to_thread.run_sync(daemon.start)
    report = boot_report(daemon)
    assert (report["recoverable"], report["from_checkpoints"]) == (1, 0)
    await current_in_the_bucket(url, session_id, before.last_index)  # the scan stored it

    await anyio.to_thread.run_sync(daemon.kill)
    await anyio.to_thread.run_sync(daemon.start)
    report = boot_report(daemon)
    assert report["recoverable"] == report["current_checkpoints"] == 1
    assert report["events_folded"] == 0
