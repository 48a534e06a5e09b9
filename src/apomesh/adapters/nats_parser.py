"""The protocol parser apomesh's NATS connections read with: nats-py's, cheaper where the daemon
reads most.

- A message (``MSG``/``HMSG``) is framed by splitting its control line, not by nats-py's regular
  expressions (which try ``MSG`` and then ``HMSG`` on every message), and its payload is copied
  out of the buffer once. The messages framed are cut off the buffer's head together, once per
  read of the socket (or before the client is called), not one by one.
- A subject can be given a ``sink``: its messages then go straight to that function as (header
  block, payload), with no ``Msg`` built, no headers parsed, no queue and no task switch. A page of
  a batched direct get is read this way (``nats_connect.direct_get_batch``): a boot scan reads a
  million messages, at about 10 us each through nats-py and 3 us here. The messages after a
  sunk one that share its control line up to their size (a page's: the same subject and sid, no
  reply, no headers) are framed by that prefix alone, with no split of their line
  (``_deliver_run``): the pass over 100,000 stored sessions 0.3-0.6 s shorter.
- A subject can also be given a ``payload sink`` (``payload_sinks``), which takes the payload of
  each of its messages that has no headers, and nothing else: a ``list.append`` there costs no
  Python call per message. A header-less page (``no_hdr``: the boot scan's) is read this way, at
  about 0.65 us a message framed and kept against 0.95 us through a sink.

A message's header lines are read by ``header_lines``: nats-py's reading, without its generator
over each header name's characters (a boot scan's lease watch reads tens of thousands of
messages, each with a 35-character header name).

Every other line (``INFO``, ``PING``, ``PONG``, ``+OK``, ``-ERR``) is handed to nats-py's own parser
one line at a time, so the client's handlers run as they always do, and a message for a subject
without a sink goes to the client's ``_process_msg`` exactly as nats-py's parser sends it. A test
(tests/unit/test_nats_parser.py) holds this to the installed nats-py.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from nats.errors import ProtocolError
from nats.protocol.parser import Parser

__all__ = ["PayloadSink", "Sink", "SinkParser", "header_lines", "parse_header_block"]

Sink = Callable[[bytes | None, bytes], None]
"""Takes one message as (its header block or None, its payload); it must not raise."""
PayloadSink = Callable[[bytes], None]
"""Takes the payload of one message without headers; it must not raise."""

_CRLF = b"\r\n"
_STATUS_LINE = "NATS/1.0"
_SPACE = re.compile(r"\s")


class SinkParser(Parser):
    """nats-py's parser with messages framed by split and delivered to ``sinks`` by subject (a
    message without headers to the subject's ``payload_sinks`` entry instead, when it has one)."""

    def __init__(self, nc: Any = None) -> None:
        super().__init__(nc)
        self.sinks: dict[bytes, Sink] = {}
        self.payload_sinks: dict[bytes, PayloadSink] = {}

    async def parse(self, data: bytes = b"") -> None:
        self.buf.extend(data)
        buf = self.buf
        sinks = self.sinks
        payload_sinks = self.payload_sinks
        at = 0  # where the next message starts: the ones before it, framed, are cut off at the end
        try:
            while at < len(buf):
                line = at
                if buf.startswith(b"MSG ", at):
                    headed, skip = False, 4
                elif buf.startswith(b"HMSG ", at):
                    headed, skip = True, 5
                else:
                    del buf[:at]
                    at = 0
                    if not await self._one_line(buf):
                        return
                    continue
                end = buf.find(_CRLF, at)
                if end < 0:
                    return  # the control line is still coming
                fields = buf[at + skip : end].split()
                try:
                    size = int(fields[-1])
                    header_size = int(fields[-2]) if headed else 0
                    subject = bytes(fields[0])
                    sid = int(fields[1])
                except (ValueError, IndexError):
                    raise ProtocolError("nats: malformed MSG") from None
                start = end + 2
                stop = start + size
                if len(buf) < stop + 2:
                    return  # the payload is still coming
                if headed:
                    headers: bytes | None = bytes(buf[start : start + header_size])
                    payload = bytes(buf[start + header_size : stop])
                else:
                    headers = None
                    payload = bytes(buf[start:stop])
                at = stop + 2
                sink = sinks.get(subject)
                if sink is not None:
                    take = None if headed else payload_sinks.get(subject)
                    if take is None:
                        sink(headers, payload)
                    else:
                        take(payload)
                    if not headed and len(fields) == 3:
                        prefix = bytes(buf[line : end - len(fields[2])])
                        if buf.startswith(prefix, at):  # a run follows (a page's)
                            take = take or functools.partial(sink, None)
                            at = _deliver_run(buf, at, prefix, take)
                    continue
                reply = bytes(fields[2]) if len(fields) == (5 if headed else 4) else b""
                del buf[:at]
                at = 0
                await self.nc._process_msg(sid, subject, reply, payload, headers)
                if self.buf is not buf:
                    return  # the client reset the parser: what was read belongs to the old connection
        finally:
            if at:
                del buf[:at]

    async def _one_line(self, buf: bytearray) -> bool:
        """Hand the line at the buffer's head to nats-py's parser; False when it is not whole yet
        or the client reset the parser while handling it (a reconnection: what was read after it
        belongs to the connection that is gone)."""
        end = buf.find(_CRLF)
        if end < 0:
            return False
        rest = buf[end + 2 :]
        del buf[end + 2 :]
        await super().parse()
        if self.buf is not buf:
            return False
        buf.extend(rest)
        return True


def _deliver_run(buf: bytearray, at: int, prefix: bytes, take: PayloadSink) -> int:
    """Hand ``take`` the payload of each whole message from ``at`` whose control line is
    ``prefix`` (``MSG``, the subject and the sid of the message just delivered: no reply, no
    headers) and a size, as a page's are; answers where the first message not delivered starts."""
    width = len(prefix)
    starts, find = buf.startswith, buf.find
    while starts(prefix, at):
        end = find(_CRLF, at + width)
        if end < 0:
            break
        try:
            size = int(buf[at + width : end])
        except ValueError:
            break
        start = end + 2
        stop = start + size
        if len(buf) < stop + 2:
            break
        take(bytes(buf[start:stop]))
        at = stop + 2
    return at


def header_lines(raw: bytes) -> dict[str, str]:
    """``Name: Value`` lines as nats-py's client reads them (``Client._parse_header_lines``): a
    line without a colon, a name that is not ASCII or holds whitespace are passed over; a value is
    stripped and decoded as UTF-8, what does not decode replaced."""
    headers: dict[str, str] = {}
    for line in raw.split(_CRLF):
        name, colon, value = line.partition(b":")
        if not colon:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _SPACE.search(key) is None:
            headers[key] = value.strip().decode("utf-8", "replace")
    return headers


def parse_header_block(raw: bytes) -> dict[str, str]:
    """A message's header block (``NATS/1.0 [status [description]]`` then ``Key: Value`` lines)
    as nats-py reads it: the status line's code as ``Status`` and its text as ``Description``."""
    first, _, rest = raw.partition(_CRLF)
    line = first.decode(errors="replace")
    headers: dict[str, str] = {}
    status = line[len(_STATUS_LINE) :].strip() if line.startswith(_STATUS_LINE) else ""
    if status:
        code, _, description = status.partition(" ")
        if code.isdigit():
            headers["Status"] = code
        if description.strip():
            headers["Description"] = description.strip()
    headers.update(header_lines(rest))
    return headers
