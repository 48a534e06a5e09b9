"""The boot scan's fast path: fold every session on the JetStream log in one pass over the stream
(``JetStreamLog.fold_all``).

Reading sessions one by one costs a direct get each, and the server's cost for each grows with how
finely sessions are interleaved in the stream (it steps over every other session's events between
two of this one's): about 1 ms per session at 1,000 stored sessions, 2-3 ms at 10,000. One pass
in stream order reads every event exactly once instead, a page of up to ``page`` events per
request, without headers (nats-py parses headers slowly; the envelope names its own session and
index), and folds each envelope into its session's state as it arrives.

The pass only vouches for what it could check: a payload that does not decode (its session is
unknown without headers: the page is read again with them to name it), a session whose envelopes
do not fold (a gap, a duplicate, an envelope filed under another session's subject) and a session
listed on the stream but absent from the pass are ``suspect``; the caller reads those one by one
through the log adapter, which names the exact error. Sessions in ``skip`` (those with a
completed-session record) are passed over unread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apomesh.adapters.nats_connect import JS_API_PREFIX, api_request, direct_get_batch
from apomesh.core.envelope import decode
from apomesh.core.errors import CodecError, FoldError
from apomesh.core.state import SessionState, apply, new_state

MAX_PAGE_BYTES = 16 * 1024 * 1024


@dataclass
class StreamFold:
    """What one pass over the log stream folded."""

    states: dict[str, SessionState] = field(default_factory=dict)
    suspect: set[str] = field(default_factory=set)
    events: int = 0
    pages: int = 0


async def fold_stream(
    nc: Any,
    stream: str,
    subject_prefix: str,
    *,
    skip: set[str],
    page: int = 10_000,
    timeout: float = 10.0,
) -> StreamFold:
    """Fold every session of ``stream`` (subjects ``<subject_prefix>.<session_id>``) that is not in
    ``skip``, reading the stream once in order. See the module docstring for ``suspect``."""
    result = StreamFold()
    info = await api_request(nc, f"{JS_API_PREFIX}.STREAM.INFO.{stream}", {}, timeout=timeout)
    state = info.get("state", {})
    seq, last_seq = int(state.get("first_seq") or 1), int(state.get("last_seq") or 0)
    wildcard = f"{subject_prefix}.*"
    states = result.states
    while seq <= last_seq:
        request = {
            "seq": seq,
            "next_by_subj": wildcard,
            "batch": page,
            "max_bytes": MAX_PAGE_BYTES,
            "no_hdr": True,
        }
        got = await direct_get_batch(nc, stream, request, timeout=timeout)
        if not got.messages:
            break
        result.pages += 1
        undecodable = False
        for msg in got.messages:
            try:
                env = decode(msg.data)
            except CodecError:
                undecodable = True
                continue
            result.events += 1
            session_id = env.session_id
            if session_id in skip or session_id in result.suspect:
                continue
            folded = states.get(session_id)
            if folded is None:
                folded = states[session_id] = new_state(session_id)
            try:
                apply(folded, env)
            except FoldError:
                result.suspect.add(session_id)
                del states[session_id]
        if undecodable:
            for session_id in await _undecodable_sessions(
                nc, stream, wildcard, seq, len(got.messages), subject_prefix, timeout
            ):
                result.suspect.add(session_id)
                states.pop(session_id, None)
        if got.pending <= 0 or not got.last_sequence:
            break
        seq = got.last_sequence + 1
    return result


async def _undecodable_sessions(
    nc: Any, stream: str, wildcard: str, seq: int, count: int, prefix: str, timeout: float
) -> set[str]:
    """The sessions whose events in the page starting at ``seq`` do not decode (read with
    headers this time, which name each event's subject)."""
    request = {"seq": seq, "next_by_subj": wildcard, "batch": count, "max_bytes": MAX_PAGE_BYTES}
    got = await direct_get_batch(nc, stream, request, timeout=timeout)
    found = set()
    for msg in got.messages:
        try:
            decode(msg.data)
        except CodecError:
            subject = (msg.headers or {}).get("Nats-Subject", "")
            if subject.startswith(prefix + "."):
                found.add(subject[len(prefix) + 1 :])
    return found
