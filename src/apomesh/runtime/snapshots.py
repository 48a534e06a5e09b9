"""Agent snapshots on the daemon: what a node added, stored so bytes per step stay flat.

A snapshot is (definition, budget runtime state, working-memory conversation, model memory). The
definition is stored once per agent (``defs``); the conversation is stored as appended segments,
one per node (``segments``); a snapshot record (``snapshots``) names how far into the segments it
reaches plus the small state. Every ``compact_every`` segments the recent small segments are merged
into one, so the number of keys stays low without ever rewriting the whole conversation. A
supervisor reset starts a new conversation: the record's ``base_seq`` says where it begins.

The agent's call counts (how many times each journaled call was made, which keys its next repeat)
grow with every side-effecting call, so they are stored the same way: a segment carries the counts
its node changed, and a load merges them over every segment up to the record (a reset keeps them).
A segment without counts is the plain list of messages.

A model turn recorded before it is acted on (a ``TurnReport``, source ``turn``) is a snapshot
like any other: its record holds the turn (``SnapshotRecord.turn``, small: one model answer) and
the node that completes the turn writes a record without it. The turn's assistant message joins
the conversation only with that node, so a turn is never in the segments twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore, snapshot_key
from apomesh.core.definition import AgentConfig
from apomesh.plugins.api import Message
from apomesh.runtime.protocol import AgentMemory, BudgetState, NodeReport, RecordedTurn, TurnReport


class SnapshotRecord(msgspec.Struct):
    step: int
    base_seq: int
    last_seq: int
    model: dict[str, Any]
    budget: BudgetState
    source: str
    prompt: str = ""
    call_counts: dict[str, int] = {}
    """Only in records written before counts moved to the segments: the base they update."""
    turn: RecordedTurn | None = None
    """The model turn recorded and not completed by a node (see the module docstring)."""


class CountedSegment(msgspec.Struct):
    """A segment whose node changed the agent's call counts: its messages and those counts."""

    messages: list[Message]
    call_counts: dict[str, int]


_record_decoder = msgspec.msgpack.Decoder(SnapshotRecord)
_segment_decoder = msgspec.msgpack.Decoder(CountedSegment | list[Message])
_encoder = msgspec.msgpack.Encoder()


def segment_key(agent_key: str, seq: int) -> str:
    return f"{agent_key}\x00{seq:08x}"


def _segment(messages: list[Message], counts: dict[str, int]) -> bytes:
    return _encoder.encode(CountedSegment(messages, counts) if counts else messages)


@dataclass
class _Tail:
    """What the daemon remembers of an agent's recent segments between nodes."""

    next_seq: int
    base_seq: int
    next_snapshot: int
    small: list[tuple[int, list[Message]]] = field(default_factory=list)
    has_definition: bool = False
    counts: dict[str, int] | None = None
    """The call counts as stored so far (None until this process wrote them: store them whole)."""
    small_counts: dict[str, int] = field(default_factory=dict)
    """The counts the ``small`` segments changed, for the one they are merged into."""


class SnapshotStore:
    """Writes and loads agent snapshots in the LMDB store."""

    def __init__(self, store: AsyncStore, *, compact_every: int = 32) -> None:
        self.store = store
        self.compact_every = max(2, compact_every)
        self._tails: dict[str, _Tail] = {}

    async def _tail(self, agent_key: str) -> _Tail:
        tail = self._tails.get(agent_key)
        if tail is None:
            latest = await self.store.latest_snapshot(agent_key)
            segments = await self.store.scan("segments", agent_key + "\x00")
            next_seq = int(segments[-1][0].rpartition("\x00")[2], 16) + 1 if segments else 0
            if latest is None:
                tail = _Tail(next_seq=next_seq, base_seq=next_seq, next_snapshot=1)
            else:
                record = _record_decoder.decode(latest[1])
                tail = _Tail(
                    next_seq=next_seq,
                    base_seq=record.base_seq,
                    next_snapshot=latest[0] + 1,
                    has_definition=True,
                )
            self._tails[agent_key] = tail
        return tail

    async def write(
        self,
        agent_key: str,
        config: AgentConfig | None,
        report: NodeReport | TurnReport,
        *,
        after_id: int = 0,
    ) -> tuple[int, int]:
        """Store one node's snapshot; answers (snapshot_id, bytes written).

        ``after_id`` is the latest snapshot id the log points to: new ids continue above it even
        when the store lost its records, so a pointer on the log never names two snapshots."""
        tail = await self._tail(agent_key)
        tail.next_snapshot = max(tail.next_snapshot, after_id + 1)
        puts: list[tuple[str, str, bytes]] = []
        deletes: list[tuple[str, str]] = []
        if not tail.has_definition and config is not None:
            puts.append(("defs", agent_key, _encoder.encode(config)))
            tail.has_definition = True
        if report.reset:
            tail.base_seq = tail.next_seq
            tail.small = []
            tail.small_counts = {}
        known = tail.counts
        changed = {
            k: v for k, v in report.call_counts.items() if known is None or known.get(k) != v
        }
        if report.new_messages or changed:
            seq = tail.next_seq
            tail.next_seq += 1
            puts.append(
                ("segments", segment_key(agent_key, seq), _segment(report.new_messages, changed))
            )
            tail.small.append((seq, list(report.new_messages)))
            tail.small_counts.update(changed)
            if len(tail.small) >= self.compact_every:
                merged: list[Message] = [m for _, ms in tail.small for m in ms]
                last = tail.small[-1][0]
                puts[-1] = (
                    "segments",
                    segment_key(agent_key, last),
                    _segment(merged, tail.small_counts),
                )
                deletes.extend(("segments", segment_key(agent_key, s)) for s, _ in tail.small[:-1])
                tail.small = []
                tail.small_counts = {}
        tail.counts = dict(report.call_counts)
        record = SnapshotRecord(
            step=report.step,
            base_seq=tail.base_seq,
            last_seq=tail.next_seq - 1,
            model=report.model,
            budget=report.budget,
            source=report.source,
            prompt=report.prompt,
            turn=report.turn,
        )
        snapshot_id = tail.next_snapshot
        tail.next_snapshot += 1
        puts.append(("snapshots", snapshot_key(agent_key, snapshot_id), _encoder.encode(record)))
        await self.store.write_batch(puts, deletes)
        return snapshot_id, sum(len(k) + len(v) for _, k, v in puts)

    async def load(self, agent_key: str, snapshot_id: int | None = None) -> AgentMemory | None:
        """The working memory at ``snapshot_id`` (default: the latest), or None when there is none."""
        if snapshot_id is None:
            latest = await self.store.latest_snapshot(agent_key)
            if latest is None:
                return None
            raw = latest[1]
        else:
            got = await self.store.get_snapshot(agent_key, snapshot_id)
            if got is None:
                return None
            raw = got
        record = _record_decoder.decode(raw)
        messages: list[Message] = []
        counts = dict(record.call_counts)
        for key, value in await self.store.scan("segments", agent_key + "\x00"):
            seq = int(key.rpartition("\x00")[2], 16)
            if seq > record.last_seq:
                continue
            segment = _segment_decoder.decode(value)
            if isinstance(segment, CountedSegment):
                counts.update(segment.call_counts)
                segment = segment.messages
            if seq >= record.base_seq:
                messages.extend(segment)
        return AgentMemory(
            messages=messages,
            model=record.model,
            budget=record.budget,
            step=record.step,
            prompt=record.prompt,
            call_counts=counts,
            turn=record.turn,
        )

    async def records(self, agent_key: str) -> list[tuple[int, SnapshotRecord]]:
        """Every snapshot record of an agent, oldest first (for verification)."""
        out = []
        for key, value in await self.store.scan("snapshots", agent_key + "\x00"):
            out.append((int(key.rpartition("\x00")[2], 16), _record_decoder.decode(value)))
        return out

    def forget(self, agent_key: str) -> None:
        self._tails.pop(agent_key, None)
