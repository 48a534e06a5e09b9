"""Agent snapshots on the daemon: what a node added, stored so bytes per step stay flat.

A snapshot is (definition, budget runtime state, working-memory conversation, model memory). The
definition is stored once per agent (``defs``); the conversation is stored as appended segments,
one per node (``segments``); a snapshot record (``snapshots``) names how far into the segments it
reaches plus the small state. Every ``compact_every`` segments the recent small segments are merged
into one, so the number of keys stays low without ever rewriting the whole conversation; the merged
segment keeps where each node's part ends and which counts it changed, so an earlier snapshot
still loads exactly its own messages after compaction. A
supervisor reset starts a new conversation: the record's ``base_seq`` says where it begins.

The agent's call counts (how many times each journaled call was made, which keys its next repeat)
grow with every side-effecting call, so they are stored the same way: a segment carries the counts
its node changed, and a load merges them over every segment up to the record (a reset keeps them).
A segment without counts is the plain list of messages.

A compaction writes the merged segment and deletes the small ones it holds in one store write; on
the replicated store a write cut off part way can leave the merged segment beside them (whole
values land first, deletes after: ``adapters/replicated_store.py``), so a load takes each part
once and ``load_logged`` deletes a segment a later one holds whole.

A model turn recorded before it is acted on (a ``TurnReport``, source ``turn``) is a snapshot
like any other: its record holds the turn (``SnapshotRecord.turn``, small: one model answer) and
the node that completes the turn writes a record without it. The turn's assistant message joins
the conversation only with that node, so a turn is never in the segments twice.

The LMDB copies of the agent's journal entries (``journal``) that its writer has not stored yet
travel in the same write as the snapshot (``commit(journal=...)``): one commit per node instead of
one per copy.

A snapshot is staged (``stage``: numbered and encoded, nothing stored) and committed later
(``commit``), several in one commit: the session writer keeps a node's snapshot staged until the
agent's next turn and commits both at once (``runtime.sessions.DeferredNode``). A staged snapshot
carries the tail it leads to, and only a commit moves the agent's tail there, so one that is never
committed leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore, journal_key, snapshot_key
from apomesh.core.definition import AgentConfig
from apomesh.plugins.api import Message
from apomesh.runtime.protocol import AgentMemory, BudgetState, NodeReport, RecordedTurn, TurnReport

Part = tuple[int, list[Message], dict[str, int]]
"""One node's part of the conversation: its segment sequence number, its messages, and the call
counts it changed."""


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


class CountedSegment(msgspec.Struct, omit_defaults=True):
    """A segment whose node changed the agent's call counts: its messages and those counts.

    A merged segment (several nodes' segments compacted under the last one's key) also says
    where each node's part ends: ``seqs`` (each part's sequence number), ``ends`` (how many of
    ``messages`` the parts up to it hold) and ``part_counts`` (the counts each changed), so a
    snapshot that reaches into the middle loads exactly its own parts."""

    messages: list[Message]
    call_counts: dict[str, int]
    seqs: list[int] = []
    ends: list[int] = []
    part_counts: list[dict[str, int]] = []


_record_decoder = msgspec.msgpack.Decoder(SnapshotRecord)
_segment_decoder = msgspec.msgpack.Decoder(CountedSegment | list[Message])
_encoder = msgspec.msgpack.Encoder()


def segment_key(agent_key: str, seq: int) -> str:
    return f"{agent_key}\x00{seq:08x}"


def _segment(messages: list[Message], counts: dict[str, int]) -> bytes:
    return _encoder.encode(CountedSegment(messages, counts) if counts else messages)


class StagedSnapshot(msgspec.Struct, frozen=True):
    """A snapshot numbered and encoded by ``SnapshotStore.stage``, not stored yet."""

    agent_key: str
    snapshot_id: int
    source: str
    written: int
    """Its bytes (keys and values), as a snapshot pointer states them."""
    puts: list[tuple[str, str, bytes]]
    deletes: list[tuple[str, str]]
    tail: _Tail
    """What the store's tail of the agent is once this is committed (the next one's start)."""


class _Tail(msgspec.Struct):
    """What the daemon remembers of an agent's recent segments between nodes."""

    next_seq: int
    base_seq: int
    next_snapshot: int
    small: list[Part] = msgspec.field(default_factory=list)
    has_definition: bool = False
    counts: dict[str, int] | None = None
    """The call counts as committed so far by this process (None until it wrote some); a
    report's counts that differ from these (and from ``staged_counts``) go in its segment. Every
    tail of the agent shares this one dict: it grows with the agent's journaled calls, so a
    staged snapshot never copies it."""
    staged_counts: dict[str, int] = msgspec.field(default_factory=dict)
    """Counts of snapshots staged on this tail and not committed yet (a step's few), laid over
    ``counts``; a commit folds them in."""

    def copy(self) -> _Tail:
        return _Tail(
            self.next_seq,
            self.base_seq,
            self.next_snapshot,
            list(self.small),
            self.has_definition,
            self.counts,
            dict(self.staged_counts),
        )

    def changed(self, counts: Mapping[str, int]) -> dict[str, int]:
        """Of a report's ``counts``, those that differ from what is known (all, before any)."""
        if self.counts is None and not self.staged_counts:
            return dict(counts)
        committed = self.counts or {}
        staged = self.staged_counts
        return {k: v for k, v in counts.items() if staged.get(k, committed.get(k)) != v}

    def committed(self) -> _Tail:
        """This tail once its snapshot is committed: its staged counts folded into ``counts``."""
        if self.staged_counts:
            if self.counts is None:
                self.counts = {}
            self.counts.update(self.staged_counts)
            self.staged_counts = {}
        return self


class SnapshotStore:
    """Writes and loads agent snapshots in the LMDB store."""

    def __init__(self, store: AsyncStore, *, compact_every: int = 32) -> None:
        self.store = store
        self.compact_every = max(2, compact_every)
        self._tails: dict[str, _Tail] = {}
        """Each agent's tail as committed (a staged snapshot carries its own until then)."""
        self._issued: dict[str, int] = {}
        """The last snapshot id staged for each agent: never staged twice, even when a commit
        that failed is staged again."""

    async def _tail(self, agent_key: str) -> _Tail:
        tail = self._tails.get(agent_key)
        if tail is None:
            latest = await self.store.latest_snapshot(agent_key)
            segments = await self.store.scan("segments", agent_key + "\x00")
            next_seq = _number(segments[-1][0]) + 1 if segments else 0
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

    async def stage(
        self,
        agent_key: str,
        config: AgentConfig | None,
        report: NodeReport | TurnReport,
        *,
        after_id: int = 0,
        on: StagedSnapshot | None = None,
    ) -> StagedSnapshot:
        """One node's snapshot, numbered and encoded but not stored yet: ``commit`` stores it.
        It continues from ``on`` (a snapshot of the agent staged and maybe not committed yet,
        which is then committed first or with it) or else from what is committed; a staged
        snapshot never committed leaves nothing behind.

        ``after_id`` is the latest snapshot id the log points to: new ids continue above it even
        when the store lost its records, so a pointer on the log never names two snapshots."""
        tail = (on.tail if on is not None else await self._tail(agent_key)).copy()
        tail.next_snapshot = max(
            tail.next_snapshot, after_id + 1, self._issued.get(agent_key, 0) + 1
        )
        puts: list[tuple[str, str, bytes]] = []
        deletes: list[tuple[str, str]] = []
        if not tail.has_definition and config is not None:
            puts.append(("defs", agent_key, _encoder.encode(config)))
            tail.has_definition = True
        if report.reset:
            tail.base_seq = tail.next_seq
            tail.small = []
        changed = tail.changed(report.call_counts)
        if report.new_messages or changed:
            seq = tail.next_seq
            tail.next_seq += 1
            puts.append(
                ("segments", segment_key(agent_key, seq), _segment(report.new_messages, changed))
            )
            tail.small.append((seq, list(report.new_messages), changed))
            if len(tail.small) >= self.compact_every:
                last = tail.small[-1][0]
                puts[-1] = ("segments", segment_key(agent_key, last), _merged(tail.small))
                deletes.extend(
                    ("segments", segment_key(agent_key, s)) for s, _, _ in tail.small[:-1]
                )
                tail.small = []
        # A report carries the counts its agent changed since its last report (an older worker
        # sends them all): what is known grows by them once this snapshot is committed.
        tail.staged_counts.update(report.call_counts)
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
        self._issued[agent_key] = snapshot_id
        puts.append(("snapshots", snapshot_key(agent_key, snapshot_id), _encoder.encode(record)))
        written = sum(len(k) + len(v) for _, k, v in puts)
        return StagedSnapshot(agent_key, snapshot_id, report.source, written, puts, deletes, tail)

    async def commit(
        self,
        staged: Sequence[StagedSnapshot],
        *,
        journal: Mapping[str, Mapping[str, bytes]] | None = None,
    ) -> None:
        """Store staged snapshots, oldest first, and ``journal`` (agent key -> call key ->
        record: journal copies) in one commit: all of it or, on an error, none."""
        puts: list[tuple[str, str, bytes]] = []
        deletes: list[tuple[str, str]] = []
        for snapshot in staged:
            puts.extend(snapshot.puts)
            deletes.extend(snapshot.deletes)
        for agent_key, copies in (journal or {}).items():
            puts.extend(("journal", journal_key(agent_key, k), v) for k, v in copies.items())
        await self.store.write_batch(puts, deletes)
        for snapshot in staged:
            self._tails[snapshot.agent_key] = snapshot.tail.committed()

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
        segments = await self.store.scan("segments", agent_key + "\x00")
        return _memory(record, [p for k, v in segments for p in _parts(_number(k), v)])

    def fresh(self, agent_key: str) -> None:
        """The agent was never dispatched (its log has no ``dispatched``), so the store holds
        nothing of it: its tail starts empty, with no read."""
        self._tails.setdefault(agent_key, _Tail(next_seq=0, base_seq=0, next_snapshot=1))

    async def load_logged(self, agent_key: str, snapshot_id: int | None) -> AgentMemory | None:
        """The working memory a new dispatch continues from: the snapshot the log points to
        (``snapshot_id``; None: the agent has none yet), never a newer one. Snapshots and segment
        parts stored after it but never logged (the daemon stopped between storing a node and
        appending its pointer; the worker never heard back, so nothing depended on them) are
        dropped first, so neither this dispatch nor any later snapshot of the agent holds them.

        One read of the store brings the agent's snapshot records and segments (a restart resumes
        many agents at once, and each trip to a worker thread waits its turn); the memory and the
        agent's tail come from what it brought, less what is dropped."""
        prefix = agent_key + "\x00"
        snapshots, segments = await self.store.scan_many(
            [("snapshots", prefix), ("segments", prefix)]
        )
        logged = snapshot_id or 0
        raw: bytes | None = None
        latest: tuple[int, bytes] | None = None
        deletes: list[tuple[str, str]] = []
        for key, value in snapshots:
            number = _number(key)
            if number > logged:
                deletes.append(("snapshots", key))
                continue
            latest = (number, value)
            if number == snapshot_id:
                raw = value
        record = _record_decoder.decode(raw) if raw is not None else None
        last_seq = record.last_seq if record is not None else -1
        covered: set[int] = set()
        live: list[tuple[str, list[Part], bool]] = []
        for key, value in reversed(segments):
            stored = _parts(_number(key), value)
            kept = [part for part in stored if part[0] <= last_seq]
            if not kept or covered.issuperset(seq for seq, _, _ in kept):
                # Past the snapshot, or held whole by a later segment (a compaction whose
                # deletes never reached the replicated store: docs/architecture.md).
                deletes.append(("segments", key))
                continue
            covered.update(seq for seq, _, _ in kept)
            live.append((key, kept, len(kept) < len(stored)))
        live.reverse()
        parts = [part for _, kept, _ in live for part in kept]
        last_segment = _number(live[-1][0]) if live else None
        # A compacted segment reaching past the snapshot is kept up to it.
        puts = [("segments", key, _merged(kept)) for key, kept, trimmed in live if trimmed]
        if puts or deletes:
            await self.store.write_batch(puts, deletes)
        if puts or deletes or agent_key not in self._tails:
            # What ``_tail`` would read back from the store now.
            next_seq = last_segment + 1 if last_segment is not None else 0
            if latest is None:
                tail = _Tail(next_seq=next_seq, base_seq=next_seq, next_snapshot=1)
            else:
                tail = _Tail(
                    next_seq=next_seq,
                    base_seq=_record_decoder.decode(latest[1]).base_seq,
                    next_snapshot=latest[0] + 1,
                    has_definition=True,
                )
            self._tails[agent_key] = tail
        return _memory(record, parts) if record is not None else None

    async def records(self, agent_key: str) -> list[tuple[int, SnapshotRecord]]:
        """Every snapshot record of an agent, oldest first (for verification)."""
        out = []
        for key, value in await self.store.scan("snapshots", agent_key + "\x00"):
            out.append((_number(key), _record_decoder.decode(value)))
        return out

    def forget(self, agent_key: str) -> None:
        self._tails.pop(agent_key, None)
        self._issued.pop(agent_key, None)


def _merged(parts: list[Part]) -> bytes:
    """One compacted segment holding ``parts`` (sequence number, messages, changed counts)."""
    ends: list[int] = []
    messages: list[Message] = []
    merged_counts: dict[str, int] = {}
    for _, ms, cs in parts:
        messages.extend(ms)
        ends.append(len(messages))
        merged_counts.update(cs)
    merged = CountedSegment(
        messages,
        merged_counts,
        seqs=[seq for seq, _, _ in parts],
        ends=ends,
        part_counts=[cs for _, _, cs in parts],
    )
    return _encoder.encode(merged)


def _number(key: str) -> int:
    """The snapshot id or segment sequence number a ``snapshots`` or ``segments`` key ends with."""
    return int(key.rpartition("\x00")[2], 16)


def _memory(record: SnapshotRecord, parts: list[Part]) -> AgentMemory:
    """The working memory of ``record`` over the agent's segment ``parts``, oldest first."""
    messages: list[Message] = []
    counts = dict(record.call_counts)
    seen: set[int] = set()
    for seq, part, changed in parts:
        if seq > record.last_seq or seq in seen:
            continue  # past the record, or a part a compacted segment holds again
        seen.add(seq)
        counts.update(changed)
        if seq >= record.base_seq:
            messages.extend(part)
    return AgentMemory(
        messages=messages,
        model=record.model,
        budget=record.budget,
        step=record.step,
        prompt=record.prompt,
        call_counts=counts,
        turn=record.turn,
    )


def _parts(seq: int, value: bytes) -> list[Part]:
    """The (sequence number, messages, changed counts) parts one stored segment holds."""
    segment = _segment_decoder.decode(value)
    if isinstance(segment, list):
        return [(seq, segment, {})]
    if not segment.seqs:
        return [(seq, segment.messages, segment.call_counts)]
    starts = [0, *segment.ends[:-1]]
    return [
        (part_seq, segment.messages[start:end], counts)
        for part_seq, start, end, counts in zip(
            segment.seqs, starts, segment.ends, segment.part_counts, strict=True
        )
    ]
