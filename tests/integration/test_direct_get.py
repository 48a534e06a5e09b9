"""Batched direct gets on a real nats-server: a connection ``connect`` opened reads pages through
its parser's sinks, a plain nats-py connection through a subscription, and both see the same
messages, payloads and headers, across pages larger than one read of the socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from apomesh.adapters.nats_connect import NATS, connect, direct_get_batch
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
        out += [(m.data, m.headers) for m in page.messages]
        if not page.messages or page.pending <= 0:
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
    if not no_hdr:
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
