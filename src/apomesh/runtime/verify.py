"""Session verification (``apomesh sessions verify ID``): fold a session's log from its start and
check it against what the daemon stored about it in LMDB.

The log is the truth; LMDB holds the snapshot bytes it points to, a fast-path copy of the tool-call
journal and the completed-session record. Verification reports every place they disagree:

- the log decodes and folds whole, and no event id appears twice (a duplicated event);
- every ``AgentSnapshotted`` pointer has its record, with the same step and source;
- each agent's latest snapshot loads, reaches the step the log says, and was taken of the
  definition the agent was born with;
- every journal record in LMDB has its intent on the log, and a recorded outcome the log agrees
  with;
- the completed-session record, when there is one, belongs to a terminal log and agrees with it
  (status, last index, output, side-effect count).

Nothing here writes. A record stored but never pointed to (a crash between the LMDB write and the
append) is a note, not a problem: the log never relied on it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore, journal_prefix, snapshot_prefix
from apomesh.core.definition import AgentConfig
from apomesh.core.envelope import Envelope
from apomesh.core.errors import CodecError, FoldError, NotFound
from apomesh.core.events import AgentSnapshotted
from apomesh.core.state import SessionState, fold
from apomesh.core.views import VerificationProblem, VerificationView
from apomesh.runtime.snapshots import SnapshotRecord, SnapshotStore

_record_decoder = msgspec.msgpack.Decoder(SnapshotRecord)
_config_decoder = msgspec.msgpack.Decoder(AgentConfig)
_journal_decoder = msgspec.msgpack.Decoder(dict[str, Any])


class _CompletedRecord(msgspec.Struct):
    """The fields of the daemon's completed-session record that verification compares."""

    session_id: str
    status: str
    output: str | None
    last_index: int
    side_effects: int


_completed_decoder = msgspec.msgpack.Decoder(_CompletedRecord)


async def verify_session(log: Any, store: AsyncStore, session_id: str) -> VerificationView:
    """Check session ``session_id``'s log against ``store``. Raises ``NotFound`` for a session
    with no events; an undecodable log is reported, not raised."""
    problems: list[VerificationProblem] = []
    notes: list[str] = []
    try:
        envelopes: list[Envelope] = await log.read(session_id)
    except (CodecError, FoldError) as exc:
        return VerificationView(
            session_id=session_id,
            ok=False,
            problems=[VerificationProblem(kind="undecodable", message=str(exc))],
        )
    if not envelopes:
        raise NotFound(f"session {session_id}")
    try:
        state = fold(envelopes, session_id)
    except (CodecError, FoldError) as exc:
        return VerificationView(
            session_id=session_id,
            ok=False,
            events=len(envelopes),
            problems=[
                VerificationProblem(
                    kind="undecodable", message=str(exc), index=getattr(exc, "index", None)
                )
            ],
        )
    problems += _duplicate_ids(envelopes)
    checked_snapshots = await _check_snapshots(store, state, envelopes, problems, notes)
    checked_journal = await _check_journal(store, state, problems)
    has_record = await _check_completed(store, state, problems, notes)
    return VerificationView(
        session_id=session_id,
        ok=not problems,
        status=state.status,
        events=len(envelopes),
        last_index=state.last_index,
        agents=len(state.agents),
        snapshots_checked=checked_snapshots,
        journal_checked=checked_journal,
        completed_record=has_record,
        problems=problems,
        notes=notes,
    )


def _duplicate_ids(envelopes: list[Envelope]) -> list[VerificationProblem]:
    counts = Counter(env.event_id for env in envelopes)
    return [
        VerificationProblem(
            kind="duplicate_event_id",
            message=f"event id {env.event_id} appears {counts[env.event_id]} times",
            index=env.index,
        )
        for env in envelopes
        if counts[env.event_id] > 1
    ]


async def _check_snapshots(
    store: AsyncStore,
    state: SessionState,
    envelopes: list[Envelope],
    problems: list[VerificationProblem],
    notes: list[str],
) -> int:
    records: dict[str, dict[int, SnapshotRecord]] = {}
    for ref in state.agents:
        agent_key = f"{state.session_id}/{ref}"
        stored: dict[int, SnapshotRecord] = {}
        for key, value in await store.scan("snapshots", snapshot_prefix(agent_key)):
            snapshot_id = int(key.rpartition("\x00")[2], 16)
            try:
                stored[snapshot_id] = _record_decoder.decode(value)
            except msgspec.DecodeError as exc:
                problems.append(
                    VerificationProblem(
                        kind="snapshot_unreadable",
                        message=f"snapshot {snapshot_id} does not decode: {exc}",
                        agent=ref,
                    )
                )
        records[ref] = stored
    checked = 0
    pointed: dict[str, set[int]] = {}
    for env in envelopes:
        event = env.event
        if not isinstance(event, AgentSnapshotted):
            continue
        checked += 1
        pointed.setdefault(event.agent, set()).add(event.snapshot_id)
        record = records.get(event.agent, {}).get(event.snapshot_id)
        if record is None:
            problems.append(
                VerificationProblem(
                    kind="snapshot_missing",
                    message=f"the log points to snapshot {event.snapshot_id} (step {event.step})"
                    " but the store has no such record",
                    agent=event.agent,
                    index=env.index,
                )
            )
        elif record.step != event.step or record.source != event.source:
            problems.append(
                VerificationProblem(
                    kind="snapshot_mismatch",
                    message=f"snapshot {event.snapshot_id}: the log says step {event.step} "
                    f"({event.source}), the store step {record.step} ({record.source})",
                    agent=event.agent,
                    index=env.index,
                )
            )
    snapshots = SnapshotStore(store)
    for ref, agent in state.agents.items():
        unpointed = sorted(set(records.get(ref, {})) - pointed.get(ref, set()))
        if unpointed:
            notes.append(
                f"{ref}: snapshot(s) {', '.join(map(str, unpointed))} stored but never logged"
                " (a crash between the store write and the append)"
            )
        if agent.snapshot_id is None or agent.snapshot_id not in records.get(ref, {}):
            continue
        agent_key = f"{state.session_id}/{ref}"
        try:
            memory = await snapshots.load(agent_key, agent.snapshot_id)
        except Exception as exc:  # any failure to rebuild the memory is the finding itself
            problems.append(
                VerificationProblem(
                    kind="snapshot_unreadable",
                    message=f"latest snapshot {agent.snapshot_id} does not load: {exc}",
                    agent=ref,
                )
            )
            continue
        if memory is None or memory.step != agent.step:
            problems.append(
                VerificationProblem(
                    kind="snapshot_mismatch",
                    message=f"latest snapshot {agent.snapshot_id} loads at step "
                    f"{memory.step if memory else None}, the log says {agent.step}",
                    agent=ref,
                )
            )
        stored_definition = await store.get("defs", agent_key)
        if stored_definition is None:
            problems.append(
                VerificationProblem(
                    kind="definition_mismatch",
                    message="the agent's stored definition is missing",
                    agent=ref,
                )
            )
        elif agent.config is not None:
            try:
                same = _config_decoder.decode(stored_definition) == agent.config
            except msgspec.DecodeError:
                same = False
            if not same:
                problems.append(
                    VerificationProblem(
                        kind="definition_mismatch",
                        message="the stored definition differs from the config the agent was"
                        " born with",
                        agent=ref,
                    )
                )
    return checked


async def _check_journal(
    store: AsyncStore, state: SessionState, problems: list[VerificationProblem]
) -> int:
    checked = 0
    for ref in state.agents:
        agent_key = f"{state.session_id}/{ref}"
        prefix = journal_prefix(agent_key)
        for key, value in await store.scan("journal", prefix):
            checked += 1
            call_key = key[len(prefix) :]
            entry = state.journal.get((ref, call_key))
            if entry is None:
                problems.append(
                    VerificationProblem(
                        kind="journal_not_on_log",
                        message=f"the store journals call {call_key[:12]} but the log has no"
                        " intent for it",
                        agent=ref,
                    )
                )
                continue
            try:
                record = _journal_decoder.decode(value)
            except msgspec.DecodeError:
                record = {}
            outcome = record.get("outcome")
            if outcome is not None and (
                outcome != entry.outcome or record.get("result") != entry.result
            ):
                problems.append(
                    VerificationProblem(
                        kind="journal_mismatch",
                        message=f"{entry.tool} {call_key[:12]}: the store says {outcome!r}, the"
                        f" log {entry.outcome!r}",
                        agent=ref,
                        index=entry.intent_index,
                    )
                )
    return checked


async def _check_completed(
    store: AsyncStore,
    state: SessionState,
    problems: list[VerificationProblem],
    notes: list[str],
) -> bool:
    raw = await store.get_completed(state.session_id)
    if raw is None:
        if state.terminal:
            notes.append(
                "terminal on the log but no completed record yet (the boot scan writes it)"
            )
        return False
    try:
        record = _completed_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        problems.append(
            VerificationProblem(
                kind="completed_mismatch", message=f"the completed record does not decode: {exc}"
            )
        )
        return True
    if not state.terminal:
        problems.append(
            VerificationProblem(
                kind="completed_not_terminal",
                message=f"a completed record ({record.status}) exists but the log has no"
                " terminal event",
            )
        )
        return True
    expected = {
        "status": state.status,
        "last_index": state.last_index,
        "output": state.output,
        "side_effects": state.side_effects,
    }
    for name, value in expected.items():
        stored = getattr(record, name)
        if stored != value:
            problems.append(
                VerificationProblem(
                    kind="completed_mismatch",
                    message=f"the completed record says {name}={stored!r}, the log {value!r}",
                )
            )
    return True
