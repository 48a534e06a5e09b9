"""The pieces of model turns between worker and event streams: cut to a size a NATS message
carries, and fanned out per session to the readers following it (a slow reader loses pieces,
nobody else does; a reader that stops is forgotten)."""

from __future__ import annotations

import anyio
import pytest

from apomesh.plugins.api import ModelDelta
from apomesh.runtime.live_deltas import LiveDeltas
from apomesh.runtime.protocol import TurnDelta, delta_pieces


def test_a_long_piece_is_cut_and_keeps_its_tool_name_on_the_first_cut() -> None:
    arguments = '{"content": "' + "x" * 25 + '"}'
    cuts = delta_pieces(ModelDelta("tool_call", call=1, tool="fs.write", arguments=arguments), 10)
    assert "".join(c.arguments for c in cuts) == arguments
    assert all(len(c.arguments) <= 10 and c.call == 1 for c in cuts)
    assert [c.tool for c in cuts] == ["fs.write"] + [""] * (len(cuts) - 1)
    text = ModelDelta("text", text="abcdefghij" * 3)
    assert [c.text for c in delta_pieces(text, 10)] == ["abcdefghij"] * 3
    small = ModelDelta("text", text="short")
    assert delta_pieces(small, 10) == [small]


def turn(session_id: str, text: str) -> TurnDelta:
    return TurnDelta("w1", session_id, "root", 1, 1, ModelDelta("text", text=text))


@pytest.mark.anyio
async def test_readers_get_their_sessions_pieces_and_a_slow_one_loses_the_overflow() -> None:
    deltas = LiveDeltas(backlog=2)
    first, second, other = deltas.follow("s1"), deltas.follow("s1"), deltas.follow("s2")
    assert (deltas.followers("s1"), deltas.followers("s2")) == (2, 1)
    for text in ("a", "b", "c"):
        deltas.publish(turn("s1", text))
    deltas.publish(turn("s2", "z"))
    deltas.publish(turn("s3", "nobody"))
    with anyio.fail_after(5):
        # Each reader holds at most its backlog: the third piece is lost to both (they did not
        # read in time), and no reader sees another session's pieces.
        assert [(await anext(first)).delta.text for _ in range(2)] == ["a", "b"]
        assert [(await anext(second)).delta.text for _ in range(2)] == ["a", "b"]
        assert (await anext(other)).delta.text == "z"
        deltas.publish(turn("s1", "d"))
        assert (await anext(first)).delta.text == "d"
    for reader in (first, second, other):
        await reader.aclose()
    assert deltas.followers("s1") == deltas.followers("s2") == 0
