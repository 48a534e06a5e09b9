"""The boot scan reads the log's list of sessions (with their message counts) while its one pass
over the stream runs: without a fold checkpoint the pass starts at the stream's first message and
does not wait for the list; with one, the pass waits for the list (it may start past the first
message when every listed session has a checkpoint, or read nothing when every one is current).
A real nats-server (the node's embedded one) and real LMDB; the log adapter's two reads are
wrapped to record their order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.api_support import asker
from tests.integration.test_node_reports import one_worker_config

from apomesh.adapters.jetstream_log import JetStreamLog, MessageCounts
from apomesh.runtime.fold_checkpoints import FoldCheckpoints
from apomesh.runtime.node import Node
from apomesh.runtime.sessions import SessionRuntime

pytestmark = pytest.mark.anyio


def _config(tmp_path: Path, **snapshots: Any) -> Any:
    return one_worker_config(tmp_path, snapshots=snapshots)


async def _park_one(tmp_path: Path, **snapshots: Any) -> str:
    """A session parked on its question, left on the log by a node that then stops."""
    (session_id,) = await _park(tmp_path, 1, **snapshots)
    return session_id


async def _park(tmp_path: Path, count: int, **snapshots: Any) -> list[str]:
    """``count`` sessions parked on their question one after the other (each one's messages
    after the one before's), left on the log by a node that then stops."""
    session_ids = []
    async with Node(_config(tmp_path, **snapshots), http=False) as node:
        assert node.daemon is not None and node.service is not None
        for _, worker in node.workers:
            await worker.wait_registered()
        for _ in range(count):
            session_id = await node.service.create_session(
                "ask", agent=None, definition=asker(), by="t"
            )
            runtime = node.daemon.registry.live[session_id]
            for _ in range(400):
                if runtime.state.status == "paused":
                    break
                await asyncio.sleep(0.025)
            assert runtime.state.status == "paused"
            session_ids.append(session_id)
    return session_ids


def _record_order(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Wrap the log's list and pass, noting their order: the list answers once the pass has
    begun, or after 2 s without it (a pass that waits for the list must not deadlock)."""
    order: list[tuple[str, Any]] = []
    pass_begun = asyncio.Event()
    listed = JetStreamLog.count_messages
    fold_all = JetStreamLog.fold_all

    async def count_messages(self: JetStreamLog) -> MessageCounts:
        sessions = await listed(self)
        order.append(("listing asked", None))
        try:
            await asyncio.wait_for(pass_begun.wait(), timeout=2.0)
        except TimeoutError:
            order.append(("listing answered before the pass", None))
        else:
            order.append(("listing answered after the pass began", None))
        return sessions

    async def fold_all_recorded(self: JetStreamLog, skip: set[str], **kwargs: Any) -> Any:
        order.append(("pass", kwargs.get("sessions")))
        pass_begun.set()
        return await fold_all(self, skip, **kwargs)

    monkeypatch.setattr(JetStreamLog, "count_messages", count_messages)
    monkeypatch.setattr(JetStreamLog, "fold_all", fold_all_recorded)
    return order


async def test_without_checkpoints_the_pass_starts_before_the_list_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:
        # No checkpoint is written, not even at the node's stop.
        patched.setattr(FoldCheckpoints, "write_changed", _write_nothing)
        session_id = await _park_one(tmp_path)
    order = _record_order(monkeypatch)
    async with Node(_config(tmp_path), http=False) as node:
        assert node.daemon is not None
        report = node.daemon.boot_report
        assert report["from_checkpoints"] == 0
        assert report["auto_resume"] + report["recoverable"] == 1
        assert session_id in node.daemon.registry.live or session_id in (
            node.daemon.registry.stranded
        )
    assert ("pass", None) in order  # no list handed to the pass: it starts at the first message
    assert ("listing answered after the pass began", None) in order


async def _write_nothing(self: FoldCheckpoints) -> int:
    return 0


async def test_with_a_checkpoint_the_pass_is_given_the_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node's stop writes the parked session's checkpoint, current.
    session_id = await _park_one(tmp_path)
    order = _record_order(monkeypatch)
    async with Node(_config(tmp_path), http=False) as node:
        assert node.daemon is not None
        report = node.daemon.boot_report
        assert report["from_checkpoints"] == report["current_checkpoints"] == 1
        assert report["events_folded"] == 0
        assert report["auto_resume"] + report["recoverable"] == 1
    passes = [sessions for what, sessions in order if what == "pass"]
    assert passes == [[session_id]]
    assert order.index(("pass", [session_id])) > order.index(("listing asked", None))


@pytest.mark.parametrize("tamper", ["another stream", "another count"])
async def test_a_checkpoint_the_counts_do_not_confirm_is_read_on_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tamper: str
) -> None:
    """A checkpoint is current only on the stream it counted on (a stream deleted and made again
    has another creation time) and at the count the log holds: otherwise the pass reads the
    session from the checkpoint's message on (its event id checked there), as before."""
    session_id = await _park_one(tmp_path)
    listed = JetStreamLog.count_messages

    async def count_messages(self: JetStreamLog) -> MessageCounts:
        counts = await listed(self)
        if tamper == "another stream":
            return MessageCounts(counts.counts, "1999-01-01T00:00:00Z")
        return MessageCounts(
            {**counts.counts, session_id: counts.counts[session_id] + 1}, counts.log_id
        )

    monkeypatch.setattr(JetStreamLog, "count_messages", count_messages)
    async with Node(_config(tmp_path), http=False) as node:
        assert node.daemon is not None
        report = node.daemon.boot_report
        assert (report["current_checkpoints"], report["from_checkpoints"]) == (0, 1)
        assert report["checkpoints_ignored"] == 0
        assert report["auto_resume"] + report["recoverable"] == 1


async def test_a_session_without_a_checkpoint_is_read_from_its_first_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session whose first checkpoint was not written yet (started just before its daemon
    stopped) is looked up: the pass starts at its first message, not at the stream's first, so
    the older session's messages before it are not read."""
    made = SessionRuntime.current_checkpoint
    allowed: list[str] = []

    def only_the_first_session(self: SessionRuntime) -> Any:
        allowed[:] = allowed or [self.session_id]
        return made(self) if self.session_id == allowed[0] else None

    with monkeypatch.context() as patched:
        patched.setattr(SessionRuntime, "current_checkpoint", only_the_first_session)
        older, newer = await _park(tmp_path, 2)
    assert allowed == [older]

    passes: list[Any] = []
    fold_all = JetStreamLog.fold_all

    async def fold_all_noted(self: JetStreamLog, skip: set[str], **kwargs: Any) -> Any:
        folded = await fold_all(self, skip, **kwargs)
        # How many events each session has, noted before the scan takes the states away.
        passes.append((folded, {s: state.last_index + 1 for s, state in folded.states.items()}))
        return folded

    monkeypatch.setattr(JetStreamLog, "fold_all", fold_all_noted)
    async with Node(_config(tmp_path), http=False) as node:
        assert node.daemon is not None
        report = node.daemon.boot_report
    assert (report["current_checkpoints"], report["from_checkpoints"]) == (1, 1)
    assert report["auto_resume"] + report["recoverable"] == 2
    ((folded, in_log),) = passes
    assert folded.current == {older} and not folded.suspect
    assert folded.folded == report["events_folded"] == in_log[newer]  # the newer one, whole
    # Of the older one, only what it appended after the newer one started (its stop's marks).
    assert in_log[newer] <= folded.events < in_log[newer] + in_log[older] // 2
