"""The KV buckets against a real nats-server: create-only agents, the skill catalog with its
history, ownership leases by compare-and-set kept alive by their owner's presence record, and the
daemons' presence records."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import nats.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.api import KeyValueConfig

from apomesh.adapters import kv
from apomesh.adapters.kv import (
    AGENTS_BUCKET,
    DAEMONS_BUCKET,
    LEASES_BUCKET,
    SKILLS_BUCKET,
    KvBuckets,
    decode_key,
    encode_key,
)
from apomesh.adapters.nats_connect import NATS, close_quietly, connect
from apomesh.core.errors import CatalogError, LogUnavailable, PublishConflict


@pytest.fixture
async def nc(nats_server: Any) -> AsyncIterator[NATS]:
    client = await connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def buckets(nc: NATS) -> KvBuckets:
    return await KvBuckets.open(nc)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@given(st.text(min_size=1))
def test_any_name_encodes_to_a_kv_safe_key_and_back(name: str) -> None:
    key = encode_key(name)
    assert all(c.isascii() and (c.isalnum() or c in "-_=") for c in key)
    assert decode_key(key) == name


def test_plain_names_stay_readable() -> None:
    assert encode_key("house-style_2") == "house-style_2"
    assert encode_key("writer@1.0.0") == "writer=401=2E0=2E0"
    assert encode_key("a/b") == "a=2Fb"
    with pytest.raises(ValueError):
        encode_key("")


pytestmark = pytest.mark.anyio


async def test_open_creates_the_three_buckets_and_reopens_them(
    nc: NATS, buckets: KvBuckets
) -> None:
    js = nc.jetstream()
    for bucket in (AGENTS_BUCKET, SKILLS_BUCKET, LEASES_BUCKET, DAEMONS_BUCKET):
        assert (await js.stream_info(f"KV_{bucket}")).config.num_replicas == 1
    assert (await js.stream_info(f"KV_{SKILLS_BUCKET}")).config.max_msgs_per_subject == 16
    assert not (await js.stream_info(f"KV_{LEASES_BUCKET}")).config.max_age  # no TTL of their own
    assert (await js.stream_info(f"KV_{DAEMONS_BUCKET}")).config.max_age == 30
    await KvBuckets.open(nc)  # idempotent


async def test_a_lease_bucket_with_a_ttl_loses_it_when_opened(fresh_nats_server: Any) -> None:
    """Leases had a TTL of their own before the presence record kept them: a bucket made then is
    brought to none, or the leases of parked sessions would age out."""
    client = await connect(fresh_nats_server.url)
    try:
        js = client.jetstream()
        await js.create_key_value(KeyValueConfig(bucket=LEASES_BUCKET, history=1, ttl=30))
        await KvBuckets.open(client)
        assert not (await js.stream_info(f"KV_{LEASES_BUCKET}")).config.max_age
    finally:
        await close_quietly(client)


async def test_a_published_agent_is_create_only(buckets: KvBuckets) -> None:
    key = unique("writer") + "@1.0.0"
    await buckets.agents.create(key, b"definition v1")
    await buckets.agents.create(key, b"definition v1")  # the same bytes again: a no-op
    with pytest.raises(PublishConflict, match="already published"):
        await buckets.agents.create(key, b"something else")
    assert await buckets.agents.get(key) == b"definition v1"
    assert key in await buckets.agents.keys()
    assert await buckets.agents.get(unique("nobody") + "@0") is None


async def test_the_skill_catalog_keeps_revisions_and_forgets_deleted_skills(
    buckets: KvBuckets,
) -> None:
    name = unique("house style")
    first = await buckets.skills.put(name, b"be brief")
    second = await buckets.skills.put(name, b"be briefer")
    assert second > first
    assert await buckets.skills.get(name) == b"be briefer"
    assert await buckets.skills.get_revision(name) == (b"be briefer", second)
    assert name in await buckets.skills.keys()
    history = await buckets.skills.history(name)
    assert [(entry.value, entry.deleted) for entry in history] == [
        (b"be brief", False),
        (b"be briefer", False),
    ]
    await buckets.skills.delete(name)
    assert await buckets.skills.get(name) is None
    assert name not in await buckets.skills.keys()
    assert (await buckets.skills.history(name))[-1].deleted
    assert await buckets.skills.history(unique("never")) == []


async def test_a_listing_right_after_a_put_names_every_skill_and_history_every_revision(
    buckets: KvBuckets,
) -> None:
    """Read back at once, again and again: the listing and the history come from the stream
    itself, not from a key watcher that can end before its first key arrives."""
    names = [unique("listed") for _ in range(25)]
    for n, name in enumerate(names):
        await buckets.skills.put(name, b"first")
        revision = await buckets.skills.put(name, b"second")
        assert set(names[: n + 1]) <= set(await buckets.skills.keys())
        history = await buckets.skills.history(name)
        assert [(entry.value, entry.deleted) for entry in history] == [
            (b"first", False),
            (b"second", False),
        ]
        assert history[-1].revision == revision
    await buckets.skills.delete(names[0])
    assert names[0] not in await buckets.skills.keys()
    assert set(names[1:]) <= set(await buckets.skills.keys())


async def test_a_lease_has_one_owner_at_a_time(buckets: KvBuckets) -> None:
    leases = buckets.leases
    a, b = unique("daemon-a"), unique("daemon-b")
    await buckets.daemons.put(a, b"record a")
    await buckets.daemons.put(b, b"record b")
    session = unique("s") + ".with/odd@chars"
    assert await leases.owner(session) is None
    assert await leases.acquire(session, a)
    assert not await leases.acquire(session, b)  # a is alive: its lease holds
    assert await leases.acquire(session, a)  # holding it already
    assert await leases.owner(session) == a
    assert not await leases.release(session, b)
    assert await leases.owner(session) == a
    assert await leases.release(session, a)
    assert await leases.owner(session) is None
    assert await leases.acquire(session, b)
    assert await leases.owner(session) == b


async def test_a_lease_whose_owner_is_not_present_is_free(buckets: KvBuckets) -> None:
    leases = buckets.leases
    gone, alive = unique("daemon-gone"), unique("daemon-alive")
    await buckets.daemons.put(alive, b"record")
    session = unique("s")
    assert await leases.acquire(session, gone)  # its record was never published, or aged out
    assert await leases.owner(session) is None
    assert await leases.holders() == {} or session not in await leases.holders()
    assert await leases.acquire(session, alive)  # taken over by compare-and-set
    assert await leases.owner(session) == alive
    assert not await leases.acquire(session, gone)  # and it now holds against the old owner
    assert not await leases.release(session, gone)


async def test_every_held_lease_is_listed_in_one_read(fresh_nats_server: Any) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        buckets = await KvBuckets.open(client)
        leases = buckets.leases
        assert await leases.holders() == {}
        for n in range(3):
            await buckets.daemons.put(f"daemon-{n}", b"record")
        held = {f"s-{n}.odd/{n}": f"daemon-{n % 3}" for n in range(40)}
        for session, owner in held.items():
            assert await leases.acquire(session, owner)
        released = "s-7.odd/7"
        assert await leases.release(released, held.pop(released))  # a released one is not held
        assert await leases.acquire("s-of-a-dead-daemon", "daemon-dead")  # nor one of the dead
        assert await leases.holders() == held
    finally:
        await close_quietly(client)


async def test_holders_reads_the_bucket_page_by_page_and_a_lease_reads_from_the_leader(
    fresh_nats_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``holders`` reads the leases' stream in pages of batched direct gets (so the bucket
    allows them, an older bucket brought to it when opened), the later message of a key
    rewritten since winning; a lease's own reads stay off direct gets (a replica a moment
    behind could answer those)."""
    client = await connect(fresh_nats_server.url)
    try:
        js = client.jetstream()
        await js.create_key_value(KeyValueConfig(bucket=LEASES_BUCKET, history=1))
        assert not (await js.stream_info(f"KV_{LEASES_BUCKET}")).config.allow_direct
        buckets = await KvBuckets.open(client)
        assert (await js.stream_info(f"KV_{LEASES_BUCKET}")).config.allow_direct
        leases = buckets.leases
        assert leases._kv._direct is False
        monkeypatch.setattr(kv, "HOLDERS_PAGE", 7)
        await buckets.daemons.put("daemon-a", b"record")
        await buckets.daemons.put("daemon-b", b"record")
        held = {f"s-{n}": "daemon-a" for n in range(40)}
        for session, owner in held.items():
            assert await leases.acquire(session, owner)
        for session in ("s-3", "s-17"):  # rewritten: released, then taken by another owner
            assert await leases.release(session, "daemon-a")
            assert await leases.acquire(session, "daemon-b")
            held[session] = "daemon-b"
        assert await leases.release("s-21", held.pop("s-21"))
        assert await leases.holders() == held
    finally:
        await close_quietly(client)


async def test_many_leases_are_taken_together_as_one_by_one(buckets: KvBuckets) -> None:
    """``acquire_many`` (the boot scan's): free leases taken, its own kept, a dead owner's taken
    over, a live owner's refused; more sessions than one window of creates in flight."""
    leases = buckets.leases
    me, peer = unique("daemon-me"), unique("daemon-peer")
    await buckets.daemons.put(me, b"record")
    await buckets.daemons.put(peer, b"record")
    free = [unique(f"free-{n}") for n in range(600)]
    mine, dead, peers = unique("mine"), unique("dead") + "/odd", unique("peers")
    assert await leases.acquire(mine, me)
    assert await leases.acquire(dead, unique("daemon-dead"))
    assert await leases.acquire(peers, peer)
    taken = await leases.acquire_many([*free, mine, dead, peers], me)
    assert taken == {*free, mine, dead}
    holders = await leases.holders()
    assert all(holders[session] == me for session in taken)
    assert holders[peers] == peer
    assert await leases.release(free[0], me)  # released at the revision it was taken at
    assert await leases.owner(free[0]) is None


def acquired_one_by_one(leases: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sessions ``leases.acquire`` is asked for from now on (``acquire_many``'s one-by-one
    fallback), in order."""
    asked: list[str] = []
    acquire = leases.acquire

    async def counted(session_id: str, owner: str) -> bool:
        asked.append(session_id)
        return bool(await acquire(session_id, owner))

    monkeypatch.setattr(leases, "acquire", counted)
    return asked


async def test_leases_read_by_holders_are_set_at_their_revision_together(
    buckets: KvBuckets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted daemon's boot scan: ``holders`` reads the bucket, then ``acquire_many`` sets
    the existing leases at the revisions read (its own, released ones, a dead owner's) without
    one ``acquire`` each; a live owner's is refused, and one that moved since the read is taken
    one by one as before."""
    leases = buckets.leases
    me, peer, dead = unique("daemon-me"), unique("daemon-peer"), unique("daemon-dead")
    await buckets.daemons.put(me, b"record")
    await buckets.daemons.put(peer, b"record")
    mine = [unique(f"mine-{n}") for n in range(300)]
    released, of_the_dead, of_the_peer = unique("released"), unique("dead"), unique("peer")
    moved, unread = unique("moved"), unique("unread")
    for session in mine:
        assert await leases.acquire(session, me)
    assert await leases.acquire(released, me)
    assert await leases.release(released, me)
    assert await leases.acquire(of_the_dead, dead)
    assert await leases.acquire(of_the_peer, peer)
    assert await leases.acquire(moved, dead)
    await leases.holders()
    # Moved after the read (a dead owner's lease released and taken again by it): the
    # compare-and-set at the revision read fails and ``acquire`` decides.
    assert await leases.release(moved, dead)
    assert await leases.acquire(moved, dead)
    assert await leases.acquire(unread, me)  # taken after the read: not in it
    one_by_one = acquired_one_by_one(leases, monkeypatch)
    sessions = [*mine, released, of_the_dead, of_the_peer, moved, unread]
    taken = await leases.acquire_many(sessions, me, window=64)
    assert taken == {*mine, released, of_the_dead, moved, unread}
    assert sorted(one_by_one) == sorted([moved, unread])
    holders = await leases.holders()
    assert all(holders[session] == me for session in taken)
    assert holders[of_the_peer] == peer
    for session in (mine[0], released, of_the_dead):  # each released at the revision it took
        assert await leases.release(session, me)
        assert await leases.owner(session) is None


async def test_a_gone_owners_leases_read_by_owners_are_taken_over_together(
    buckets: KvBuckets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A takeover: ``owners`` reads the leases of the sessions a gone daemon drove (naming only
    holders that are alive), then ``acquire_many`` sets them at the revisions read (a released
    one at its delete marker's), none of them taken one by one; a session whose lease a live
    peer holds is named and refused."""
    leases = buckets.leases
    me, peer, gone = unique("daemon-me"), unique("daemon-peer"), unique("daemon-gone")
    await buckets.daemons.put(me, b"record")
    await buckets.daemons.put(peer, b"record")
    of_the_gone = [unique(f"gone-{n}") for n in range(150)]
    of_the_peer, never_leased, released = unique("peer"), unique("never"), unique("released")
    for session in [*of_the_gone, released]:
        assert await leases.acquire(session, gone)
    assert await leases.release(released, gone)  # handed over: a delete marker
    assert await leases.acquire(of_the_peer, peer)
    sessions = [*of_the_gone, of_the_peer, never_leased, released]
    assert await leases.owners(sessions) == {of_the_peer: peer}
    one_by_one = acquired_one_by_one(leases, monkeypatch)
    taken = await leases.acquire_many(sessions, me, window=64)
    assert taken == {*of_the_gone, never_leased, released}
    assert one_by_one == []  # the live peer's lease is refused as read, without a request
    assert await leases.owners(sessions) == {**dict.fromkeys(taken, me), of_the_peer: peer}


async def test_an_owner_nats_cannot_tell_of_keeps_its_leases_for_now(
    buckets: KvBuckets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``acquire_many`` asking whether the owner of a lease it read is alive, and NATS not
    answering: that owner's leases are left alone (asked for again later), no error escapes, and
    the free sessions are taken."""
    leases = buckets.leases
    me, other = unique("daemon-me"), unique("daemon-other")
    await buckets.daemons.put(me, b"record")
    held, free = unique("held"), unique("free")
    assert await leases.acquire(held, other)
    await leases.holders()

    async def no_answer(owner: bytes) -> bool:
        raise nats.errors.TimeoutError

    monkeypatch.setattr(leases, "_alive", no_answer)
    one_by_one = acquired_one_by_one(leases, monkeypatch)
    assert await leases.acquire_many([held, free], me) == {free}
    assert one_by_one == []


async def test_two_owners_taking_many_leases_at_once_never_share_one(buckets: KvBuckets) -> None:
    """Two daemons' boot scans adopting the same 700 sessions at the same moment: each session's
    lease goes to exactly one of them."""
    owners = [unique("daemon-a"), unique("daemon-b")]
    for owner in owners:
        await buckets.daemons.put(owner, b"record")
    sessions = [unique(f"shared-{n}") for n in range(700)]
    first, second = await asyncio.gather(
        *(buckets.leases.acquire_many(sessions, owner) for owner in owners)
    )
    assert not first & second
    assert first | second == set(sessions)
    holders = await buckets.leases.holders()
    assert all(holders[s] == owners[0] for s in first)
    assert all(holders[s] == owners[1] for s in second)


@pytest.mark.parametrize("held_by_the_dead", [False, True], ids=["free", "held-by-a-dead-owner"])
async def test_racing_owners_never_both_win(buckets: KvBuckets, held_by_the_dead: bool) -> None:
    """Eight live owners at once for a free lease, or for one whose owner is gone (a takeover
    by compare-and-set): exactly one wins."""
    session = unique("race")
    if held_by_the_dead:
        assert await buckets.leases.acquire(session, unique("daemon-dead"))
    owners = [unique(f"daemon-{number}") for number in range(8)]
    for owner in owners:
        await buckets.daemons.put(owner, b"record")
    winners: list[str] = []

    async def contend(owner: str) -> None:
        if await buckets.leases.acquire(session, owner):
            winners.append(owner)

    async with anyio.create_task_group() as group:
        for owner in owners:
            group.start_soon(contend, owner)
    assert len(winners) == 1
    assert await buckets.leases.owner(session) == winners[0]


async def test_a_lease_lapses_with_its_owners_presence_record_and_another_owner_takes_it(
    fresh_nats_server: Any,
) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        # A TTL long enough that "b is refused while a holds it" holds on a loaded machine too.
        buckets = await KvBuckets.open(client, lease_ttl=3.0)
        await buckets.daemons.put("daemon-a", b"record a")
        await buckets.daemons.put("daemon-b", b"record b")
        assert await buckets.leases.acquire("s-1", "daemon-a")
        assert not await buckets.leases.acquire("s-1", "daemon-b")
        with anyio.fail_after(20):
            # b renews its record; a does not, and its lease lapses with it.
            while not await buckets.leases.acquire("s-1", "daemon-b"):
                await buckets.daemons.put("daemon-b", b"record b")
                await anyio.sleep(0.1)
        assert await buckets.leases.owner("s-1") == "daemon-b"
    finally:
        await close_quietly(client)


async def test_many_leases_stay_held_by_one_renewed_presence_record(
    fresh_nats_server: Any,
) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        buckets = await KvBuckets.open(client, lease_ttl=2.0)
        sessions = [f"s-{n}" for n in range(20)]
        await buckets.daemons.put("daemon-a", b"record a")
        for session in sessions:
            assert await buckets.leases.acquire(session, "daemon-a")
        with anyio.fail_after(30):
            for _ in range(10):  # 3 s, past the TTL: only the record is renewed, no lease
                await buckets.daemons.put("daemon-a", b"record a")
                await anyio.sleep(0.3)
        assert await buckets.leases.holders() == dict.fromkeys(sessions, "daemon-a")
        assert not await buckets.leases.acquire(sessions[0], "daemon-b")
    finally:
        await close_quietly(client)


async def test_every_lease_change_is_seen_by_a_watcher(buckets: KvBuckets) -> None:
    seen: list[tuple[str, str | None]] = []
    stop = await buckets.leases.watch(lambda session, owner: seen.append((session, owner)))
    try:
        session = unique("s") + ".odd/name"
        a, b = unique("daemon-a"), unique("daemon-b")
        await buckets.daemons.put(b, b"record b")
        assert await buckets.leases.acquire(session, a)  # a has no record: b may take it over
        assert await buckets.leases.acquire(session, b)
        assert await buckets.leases.release(session, b)
        with anyio.fail_after(10):
            while [change for change in seen if change[0] == session] != [
                (session, a),
                (session, b),
                (session, None),
            ]:
                await anyio.sleep(0.02)
    finally:
        await stop()


async def present(buckets: KvBuckets, *names: str) -> list[str]:
    """Owners with a presence record (alive), one for each name, made unique."""
    owners = [unique(name) for name in names]
    for owner in owners:
        await buckets.daemons.put(owner, b"record")
    return owners


async def watched(
    buckets: KvBuckets, seen: list[tuple[str, str | None]], since: int, me: str
) -> Any:
    return await buckets.leases.watch(
        lambda session, owner: seen.append((session, owner)), since=since, owner=me
    )


async def until_seen(seen: list[tuple[str, str | None]], wanted: tuple[str, str | None]) -> None:
    with anyio.fail_after(10):
        while wanted not in seen:
            await anyio.sleep(0.02)


async def test_a_watch_from_a_position_leaves_out_a_run_of_its_own_takes(
    buckets: KvBuckets,
) -> None:
    """A boot scan's: the position read, 300 leases taken together (more than one window), then
    the watch from that position: none of the 300 comes back, a change after them does."""
    leases = buckets.leases
    me, peer = await present(buckets, "daemon-me", "daemon-peer")
    since, sessions = await leases.position(), [unique(f"mine-{n}") for n in range(300)]
    assert await leases.acquire_many(sessions, me, window=64) == set(sessions)
    seen: list[tuple[str, str | None]] = []
    stop = await watched(buckets, seen, since, me)
    try:
        later = unique("later")
        assert await leases.acquire(later, peer)
        await until_seen(seen, (later, peer))
        assert seen == [(later, peer)]
    finally:
        await stop()


@pytest.mark.parametrize("meanwhile", ["another-owner-took-one", "one-taken-was-released"])
async def test_a_watch_from_a_position_gives_every_change_after_it_unless_all_were_its_own(
    buckets: KvBuckets, meanwhile: str
) -> None:
    """The same, with another owner's lease taken among the 300 (a peer's boot scan at the same
    time), or one of the 300 released again (its take no longer known): every change after the
    position comes, the 300 included, so another owner's change to a lease taken here is never
    passed over."""
    leases = buckets.leases
    me, peer = await present(buckets, "daemon-me", "daemon-peer")
    since, sessions = await leases.position(), [unique(f"mine-{n}") for n in range(300)]
    assert await leases.acquire_many(sessions[:150], me, window=64) == set(sessions[:150])
    other = unique("other")
    if meanwhile == "another-owner-took-one":
        assert await leases.acquire(other, peer)
    else:
        assert await leases.release(sessions[0], me)
    assert await leases.acquire_many(sessions[150:], me, window=64) == set(sessions[150:])
    seen: list[tuple[str, str | None]] = []
    stop = await watched(buckets, seen, since, me)
    try:
        await until_seen(seen, (sessions[-1], me))
        if meanwhile == "another-owner-took-one":
            assert {(session, me) for session in sessions} <= set(seen)
            assert (other, peer) in seen
        else:  # the bucket keeps a key's last message only: its take is gone, its release is not
            assert {(session, me) for session in sessions[1:]} <= set(seen)
            assert (sessions[0], None) in seen
    finally:
        await stop()


async def test_a_daemons_presence_record_is_listed_until_withdrawn_or_aged_out(
    fresh_nats_server: Any,
) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        buckets = await KvBuckets.open(client, lease_ttl=2.0)
        presence = buckets.daemons
        await presence.put("daemon-a", b"record a")
        await presence.put("daemon/b", b"record b")
        assert await presence.all() == {"daemon-a": b"record a", "daemon/b": b"record b"}
        await presence.delete("daemon/b")
        assert await presence.all() == {"daemon-a": b"record a"}
        with anyio.fail_after(60):  # not renewed: the bucket's TTL ages it out
            while await presence.all():
                await anyio.sleep(0.1)
    finally:
        await close_quietly(client)


async def test_reopening_with_other_settings_updates_or_says_why(fresh_nats_server: Any) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        js = client.jetstream()
        await KvBuckets.open(client, skill_history=4)
        await KvBuckets.open(client, skill_history=8)
        assert (await js.stream_info(f"KV_{SKILLS_BUCKET}")).config.max_msgs_per_subject == 8
        with pytest.raises(CatalogError, match="replicas"):
            await KvBuckets.open(client, replicas=3)
    finally:
        await close_quietly(client)


async def test_a_dead_server_is_log_unavailable(fresh_nats_server: Any) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        buckets = await KvBuckets.open(client, timeout=1.0)
        fresh_nats_server.kill()
        with anyio.fail_after(10), pytest.raises(LogUnavailable):
            await buckets.skills.get("anything")
        with anyio.fail_after(10), pytest.raises(LogUnavailable):
            await buckets.leases.acquire("s-1", "daemon-a")
    finally:
        await close_quietly(client)


@pytest.fixture
def small_payload_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A nats-server whose ``max_payload`` is 64 KiB (the default is 1 MiB)."""

    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(
        msgspec.structs.replace(
            single_node(tmp_path_factory.mktemp("small")), max_payload=64 * 1024
        )
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_presence_record_over_max_payload_is_put_in_parts_and_read_whole(
    small_payload_server: Any,
) -> None:
    """A daemon driving thousands of sessions has a presence record larger than one message:
    it is put in parts under a head, read back whole, keeps the daemon's leases alive, and its
    old parts go (two generations on, and all of them once a record fits again)."""
    import nats.errors
    from nats.js.kv import KeyValue

    from apomesh.runtime.presence import Presence

    client = await connect(small_payload_server.url)
    try:
        buckets = await KvBuckets.open(client)
        sessions = [uuid.uuid4().hex for _ in range(6_000)]  # about 200 KB of record
        presence = Presence(
            buckets.daemons,
            incarnation="daemon-big",
            url="",
            sessions=lambda: sessions,
            stranded=lambda: sessions[:100],
        )
        encoded = msgspec.msgpack.encode(presence.record())
        assert len(encoded) > 3 * 64 * 1024
        raw: KeyValue = buckets.daemons._kv
        with pytest.raises(nats.errors.MaxPayloadError):
            await raw.put("whole", encoded)  # one message cannot carry it
        # A peer reads it (its own table: nothing of the record is known to it but the bucket).
        peer_buckets = await KvBuckets.open(client)
        peer = Presence(
            peer_buckets.daemons, incarnation="daemon-peer", url="", sessions=list, stranded=list
        )
        for _ in range(4):  # new generations replace the old
            await presence.publish()
            peers = await peer.peers()
            assert sorted(peers["daemon-big"].sessions) == sorted(sessions)
            assert sorted(peers["daemon-big"].stranded) == sorted(sessions[:100])
        assert await buckets.leases.acquire("s-1", "daemon-big")
        assert not await buckets.leases.acquire("s-1", "daemon-other")  # its owner is alive
        parts = await part_generations(client)
        assert 1 <= len(parts) <= 2, parts  # older generations were deleted

        sessions[:] = sessions[:10]  # the record fits in one message again: no parts are left
        await presence.publish()
        assert await part_generations(client) == set()
        assert sorted((await peer.peers())["daemon-big"].sessions) == sorted(sessions)
        await presence.withdraw()
        assert "daemon-big" not in await peer.peers()
    finally:
        await close_quietly(client)


async def part_generations(client: NATS) -> set[str]:
    """The presence part generations the bucket holds values for now."""
    js = client.jetstream()
    prefix = f"$KV.{DAEMONS_BUCKET}."
    info = await js.stream_info(f"KV_{DAEMONS_BUCKET}", subjects_filter=prefix + ">")
    kv = await js.key_value(DAEMONS_BUCKET)
    found: set[str] = set()
    for subject in info.state.subjects or {}:
        key = subject[len(prefix) :]
        if ".part." not in key:
            continue
        try:
            entry = await kv.get(key)
        except Exception:
            continue
        if entry.value:
            found.add(key.split(".part.")[1].split(".")[0])
    return found


async def test_a_lease_read_as_its_own_is_taken_back_in_one_compare_and_set(
    buckets: KvBuckets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted daemon's stranded sessions: ``holders`` read their leases as its own, and an
    operator's resume takes each back at the revision read, also after the boot scan's
    ``acquire_many`` of other sessions; one that moved since the read (a peer took it over
    meanwhile) is decided as ever, and a live peer keeps it."""
    leases = buckets.leases
    me, peer = unique("daemon-me"), unique("daemon-peer")
    await buckets.daemons.put(me, b"record")
    await buckets.daemons.put(peer, b"record")
    kept, released, taken_over = unique("kept"), unique("released"), unique("taken-over")
    ended = unique("ended")
    for session in (kept, released, taken_over, ended):
        assert await leases.acquire(session, me)
    assert await leases.release(released, me)
    await leases.holders()
    # The boot scan takes the leases of the auto-resumable sessions (here none) together after
    # the read: that must not lose what was read of the others. Then it keeps the reads of the
    # sessions it stranded only.
    assert await leases.acquire_many([], me) == set()
    leases.keep_reads([kept, released, taken_over])
    assert await leases.release(taken_over, me)
    assert await leases.acquire(taken_over, peer)  # after the read
    creates: list[str] = []
    create = leases._kv.create

    async def counted(key: str, value: bytes) -> int:
        creates.append(key)
        return await create(key, value)

    monkeypatch.setattr(leases._kv, "create", counted)
    assert await leases.acquire(kept, me)
    assert await leases.acquire(released, me)
    assert creates == []  # each in one compare-and-set
    assert await leases.acquire(ended, me)  # its read not kept: a refused create, then a read
    assert creates == [encode_key(ended)]
    assert not await leases.acquire(taken_over, me)  # the compare-and-set failed; peer alive
    holders = await leases.holders()
    assert holders[kept] == me and holders[released] == me and holders[taken_over] == peer
    assert await leases.release(kept, me)  # at the revision the compare-and-set answered
    assert await leases.owner(kept) is None
