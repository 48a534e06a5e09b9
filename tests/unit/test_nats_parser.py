"""``SinkParser`` against nats-py's own parser: the same calls on the client for the same bytes,
however they are cut into reads; sinks get their subject's messages in order; a reset while a
line is handled drops what was read after it; the header block read as nats-py reads it."""

from __future__ import annotations

import random
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from apomesh.adapters.nats_parser import SinkParser, header_lines, parse_header_block

pytestmark = pytest.mark.anyio


class Recorder:
    """What a parser asks of its client, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.parser: Parser | None = None
        self.reset_on_ping = False

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        self.calls.append(("msg", sid, bytes(subject), bytes(reply), data, headers))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))
        if self.reset_on_ping and self.parser is not None:
            self.parser.reset()

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, message: str) -> None:
        self.calls.append(("err", message))


def protocol(rng: random.Random, count: int) -> bytes:
    """A server's side of a connection: messages with and without headers and reply subjects,
    status messages, and the control lines between them."""
    out = bytearray()
    for n in range(count):
        kind = rng.random()
        if kind < 0.35:
            payload = rng.randbytes(rng.randint(0, 300)).replace(b"\r\n", b"\n\r")
            reply = f" _INBOX.r{n}" if rng.random() < 0.5 else ""
            out += f"MSG subj.{n % 7} {n % 5 + 1}{reply} {len(payload)}\r\n".encode()
            out += payload + b"\r\n"
        elif kind < 0.7:
            headers = b"NATS/1.0\r\nNats-Sequence: %d\r\nNats-Subject: a.b\r\n\r\n" % n
            if rng.random() < 0.3:
                headers = b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 3\r\n\r\n"
            payload = b"" if headers.startswith(b"NATS/1.0 204") else rng.randbytes(40)
            reply = f" _INBOX.h{n}" if rng.random() < 0.3 else ""
            total = len(headers) + len(payload)
            out += f"HMSG subj.{n % 7} {n % 5 + 1}{reply} {len(headers)} {total}\r\n".encode()
            out += headers + payload + b"\r\n"
        elif kind < 0.8:
            out += b"PING\r\n"
        elif kind < 0.9:
            out += b"PONG\r\n"
        elif kind < 0.93:
            out += b"+OK\r\n"
        elif kind < 0.95:
            out += b"-ERR 'Permissions Violation for Publish to \"x.%d\"'\r\n" % n
        else:
            out += b'INFO {"server_id":"x%d","max_payload":1048576}\r\n' % n
    return bytes(out)


async def feed(parser: Parser, data: bytes, rng: random.Random) -> None:
    at = 0
    while at < len(data):
        step = rng.choice([1, 2, 7, 64, 1000, 32768])
        await parser.parse(data[at : at + step])
        at += step


@pytest.mark.parametrize("seed", range(12))
async def test_the_client_sees_what_nats_py_parser_gives_it(seed: int) -> None:
    data = protocol(random.Random(seed), 400)
    theirs, ours = Recorder(), Recorder()
    await feed(Parser(theirs), data, random.Random(seed + 100))
    parser = SinkParser(ours)
    await feed(parser, data, random.Random(seed + 200))
    assert ours.calls == theirs.calls
    assert not parser.buf


async def test_a_sink_takes_its_subject_in_order_and_the_rest_goes_on() -> None:
    data = protocol(random.Random(5), 600)
    everything = Recorder()
    await feed(Parser(everything), data, random.Random(1))
    ours = Recorder()
    parser = SinkParser(ours)
    sunk: list[tuple[bytes | None, bytes]] = []
    parser.sinks[b"subj.3"] = lambda headers, payload: sunk.append((headers, payload))
    await feed(parser, data, random.Random(2))
    to_sink = [c for c in everything.calls if c[0] == "msg" and c[2] == b"subj.3"]
    assert sunk == [(c[5], c[4]) for c in to_sink]
    assert to_sink
    assert ours.calls == [c for c in everything.calls if c not in to_sink]


def page_protocol(rng: random.Random, count: int) -> bytes:
    """A batched direct get's answer as the server sends it (runs of messages to one subject and
    sid, no reply, no headers) with other traffic between the runs: the same subject with
    another sid, a reply or headers, subjects and sids that share its first characters."""
    out = bytearray()
    for n in range(count):
        kind = rng.random()
        payload = rng.randbytes(rng.randint(0, 200)).replace(b"\r\n", b"\n\r")
        if kind < 0.75:
            line = f"MSG page.in 1 {len(payload)}"
        elif kind < 0.8:
            line = f"MSG page.in 12 {len(payload)}"
        elif kind < 0.85:
            line = f"MSG page.in 1 _INBOX.r{n} {len(payload)}"
        elif kind < 0.9:
            line = f"MSG page.inner 1 {len(payload)}"
        elif kind < 0.95:
            headers = b"NATS/1.0\r\nNats-Sequence: %d\r\n\r\n" % n
            total = len(headers) + len(payload)
            out += f"HMSG page.in 1 {len(headers)} {total}\r\n".encode() + headers
            out += payload + b"\r\n"
            continue
        else:
            out += b"PING\r\n"
            continue
        out += line.encode() + b"\r\n" + payload + b"\r\n"
    return bytes(out)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("payload_sink", [False, True])
async def test_a_run_of_page_messages_goes_to_its_sink_whole_and_in_order(
    seed: int, payload_sink: bool
) -> None:
    """With a payload sink as well, the messages without headers go to it (as their payload)
    and only the others to the sink."""
    data = page_protocol(random.Random(seed), 800)
    everything = Recorder()
    await feed(Parser(everything), data, random.Random(seed + 1))
    ours = Recorder()
    parser = SinkParser(ours)
    sunk: list[tuple[bytes | None, bytes]] = []
    payloads: list[bytes] = []
    parser.sinks[b"page.in"] = lambda headers, payload: sunk.append((headers, payload))
    if payload_sink:
        parser.payload_sinks[b"page.in"] = payloads.append
    await feed(parser, data, random.Random(seed + 2))
    to_sink = [c for c in everything.calls if c[0] == "msg" and c[2] == b"page.in"]
    if payload_sink:
        assert payloads == [c[4] for c in to_sink if c[5] is None]
        assert sunk == [(c[5], c[4]) for c in to_sink if c[5] is not None] and sunk
    else:
        assert sunk == [(c[5], c[4]) for c in to_sink] and not payloads
    assert len(to_sink) > 500
    assert ours.calls == [c for c in everything.calls if c not in to_sink]
    assert not parser.buf


async def test_a_reset_while_a_line_is_handled_drops_what_came_after_it() -> None:
    client = Recorder()
    parser = SinkParser(client)
    client.parser = parser
    client.reset_on_ping = True
    await parser.parse(b"MSG a 1 2\r\nhi\r\nPING\r\nMSG a 1 2\r\nho\r\n")
    assert client.calls == [("msg", 1, b"a", b"", b"hi", None), ("ping",)]
    assert not parser.buf
    await parser.parse(b"MSG a 1 3\r\nnew\r\n")
    assert client.calls[-1] == ("msg", 1, b"a", b"", b"new", None)


async def test_a_malformed_message_line_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        await SinkParser(Recorder()).parse(b"MSG a x 2\r\nhi\r\n")
    with pytest.raises(ProtocolError):
        await SinkParser(Recorder()).parse(b"BOGUS\r\n")


@pytest.mark.parametrize(
    "block",
    [
        b"NATS/1.0\r\nNats-Sequence: 12\r\nNats-Subject: apomesh.log.s1\r\n\r\n",
        b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 0\r\nNats-Last-Sequence: 99\r\n\r\n",
        b"NATS/1.0 404 Message Not Found\r\n\r\n",
        b"NATS/1.0 503\r\n\r\n",
        b"NATS/1.0 408 Bad Request\r\n\r\n",
    ],
)
async def test_a_header_block_reads_as_nats_py_reads_it(block: bytes) -> None:
    assert parse_header_block(block) == await NATS()._process_headers(block)


@pytest.mark.parametrize(
    "lines",
    [
        b"Nats-Expected-Last-Subject-Sequence: 0\r\n\r\n",
        b"KV-Operation: DEL\r\nNats-Msg-Id: s1:4\r\n\r\n",
        b"Name:Value\r\nTabbed:\tv \r\n\r\n",
        b"Bad Name: dropped\r\nGood: kept\r\n",
        b"Caf\xc3\xa9: dropped\r\nValue: caf\xc3\xa9 \xff\r\n",
        b"no colon here\r\n\r\n: empty name\r\n",
        b"Dup: one\r\nDup: two\r\n",
        b"Sep\x1cName: dropped\r\n",
        b"",
    ],
)
def test_header_lines_read_as_nats_py_reads_them(lines: bytes) -> None:
    assert header_lines(lines) == NATS._parse_header_lines(lines)


def test_apomesh_connections_read_header_lines_with_header_lines() -> None:
    from apomesh.adapters.nats_connect import _Client

    assert _Client._parse_header_lines is header_lines
