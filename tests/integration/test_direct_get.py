"""Batched direct gets (and batches of requests) on a real nats-server: a connection ``connect`` opened reads pages through
its parser's sinks, a plain nats-py connection through a subscription, and both see the same
messages, payloads and headers, across pages larger than one read of the socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from apomesh.adapters.nats_connect import NATS, connect, direct_get_batch, request_many
from apomesh.adapters.nats_parser import SinkParser

pytestmark = pytest.mark.anyio

STREAM = "PAGES"


@pytest.fixture
async def nc(nats_server: Any) -> AsyncIterator[NATS]:
    client = await connect(nats_server.url)
    js = client.jetstream()
    await js.add_stream(name=STREAM, subjects=["pages.*"], allow_direct=True)
    for n in range(3000):
        await js.publish(f"pages.{n % 9}", b"%d:" % n + b"x" * (n % 500), headers={"N": str(n)})
    yield client
    await js.delete_stream(STREAM)
    await client.close()


async def read_all(client: NATS, request: dict[str, Any]) -> list[tuple[bytes, Any]]:
    seq, out = 1, []
    while True:
        page = await direct_get_batch(client, STREAM, {**request, "seq": seq}, timeout=10)
        out += [(m.data, m.headers) for m in page.messages]  # with headers
        out += [(payload, None) for payload in page.payloads]  # without (``no_hdr``)
        if not (page.messages or page.payloads) or page.pending <= 0:
            return out
        seq = page.last_sequence + 1


@pytest.mark.parametrize("no_hdr", [False, True])
async def test_both_ways_of_reading_a_page_agree(nc: NATS, nats_server: Any, no_hdr: bool) -> None:
    assert isinstance(nc._ps, SinkParser)
    plain = await nats.connect(nats_server.url)
    try:
        request = {"next_by_subj": "pages.*", "batch": 700, "no_hdr": no_hdr}
        ours = await read_all(nc, request)
        theirs = await read_all(plain, request)
    finally:
        await plain.close()
    assert len(ours) == 3000
    assert ours == theirs
    assert [data.split(b":")[0] for data, _ in ours] == [b"%d" % n for n in range(3000)]
    assert not nc._ps.sinks and not nc._ps.payload_sinks  # gone with their pages
    if no_hdr:
        page = await direct_get_batch(nc, STREAM, {**request, "seq": 1}, timeout=10)
        assert page.payloads == [data for data, _ in ours[:700]]
    else:
        assert [headers["N"] for _, headers in ours] == [str(n) for n in range(3000)]
        assert ours[5][1]["Nats-Subject"] == "pages.5"
        assert ours[5][1]["Nats-Sequence"] == "6"


async def test_a_page_of_nothing_and_a_filtered_page(nc: NATS) -> None:
    empty = await direct_get_batch(
        nc, STREAM, {"seq": 1, "next_by_subj": "pages.none", "batch": 10}, timeout=10
    )
    assert empty.messages == [] and empty.pending == 0
    page = await direct_get_batch(
        nc, STREAM, {"seq": 1, "next_by_subj": "pages.4", "batch": 10}, timeout=10
    )
    assert [m.data.split(b":")[0] for m in page.messages] == [
        b"%d" % (4 + 9 * k) for k in range(10)
    ]
    assert page.pending == 3000 // 9 - 10 + (1 if 3000 % 9 > 4 else 0)
    assert not nc._ps.sinks  # each page's sink is gone with its page


async def echo(client: NATS, subject: str) -> Any:
    """A responder answering each request with its payload reversed and its ``K`` header."""

    async def answer(msg: Any) -> None:
        await msg.respond(msg.data[::-1] + b"|" + (msg.headers or {}).get("K", "").encode())

    return await client.subscribe(subject, cb=answer)


async def ignore(msg: Any) -> None:
    pass


async def test_a_batch_of_requests_answered_in_order(nc: NATS, nats_server: Any) -> None:
    """``request_many`` on a connection with sinks and on a plain nats-py one: answers come back
    in the order asked, headers and all; one sent where nobody listens is None (no responders),
    as is one that a listener never answers within the timeout, without holding up the rest."""
    assert isinstance(nc._ps, SinkParser)
    plain = await nats.connect(nats_server.url)
    responder = await connect(nats_server.url)
    try:
        await echo(responder, "echo.*")
        await responder.subscribe("silent", cb=ignore)  # hears, never answers
        await responder.flush()
        requests: list[tuple[str, bytes, dict[str, str] | None]] = [
            (f"echo.{n % 7}", b"%05d" % n, {"K": str(n)} if n % 2 else None) for n in range(600)
        ]
        expected = [
            payload[::-1] + b"|" + (h or {}).get("K", "").encode() for _, payload, h in requests
        ]
        for client in (nc, plain):
            answers = await request_many(client, requests, timeout=10)
            assert [a.data if a else None for a in answers] == expected
        assert not nc._ps.sinks  # the batch's sinks are gone with it
        mixed = [("echo.1", b"ab", None), ("nobody.here", b"x", None), ("silent", b"y", None)]
        for client in (nc, plain):
            answers = await request_many(client, mixed, timeout=0.5)
            assert [a.data if a else None for a in answers] == [b"ba|", None, None]
            # Nobody listening is an answer too: the batch does not wait out its timeout for it
            # (an hour here: waiting it out would fail the test on the suite's own timeout).
            answers = await request_many(client, mixed[:2], timeout=3600)
            assert [a.data if a else None for a in answers] == [b"ba|", None]
    finally:
        await plain.close()
        await responder.close()
