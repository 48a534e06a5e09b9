"""Journal keys: one key per call, whatever the spelling of its arguments; refusals are typed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apomesh.core.errors import ToolError
from apomesh.core.journal import call_key, canonical_bytes, normalise, pause_key


def test_a_key_is_hex_sha256() -> None:
    key = call_key("fs.append", {"path": "a.txt", "line": "x"})
    assert len(key) == 64 and int(key, 16) >= 0


def test_key_order_does_not_matter() -> None:
    assert call_key("t", {"a": 1, "b": 2, "c": 3}) == call_key("t", {"c": 3, "a": 1, "b": 2})


def test_nested_key_order_does_not_matter() -> None:
    one = {"outer": {"x": [{"p": 1, "q": 2}], "y": None}, "z": "s"}
    two = {"z": "s", "outer": {"y": None, "x": [{"q": 2, "p": 1}]}}
    assert call_key("t", one) == call_key("t", two)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (1, 1.0),
        (0, -0.0),
        (0.0, -0.0),
        (-3, -3.0),
        (2**53, float(2**53)),
        ([1, 2], (1, 2)),
        ({"k": (1, (2.0, 3))}, {"k": [1, [2, 3]]}),
    ],
)
def test_equal_values_spelled_differently_are_one_call(left: Any, right: Any) -> None:
    assert call_key("t", {"v": left}) == call_key("t", {"v": right})


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (1, 1.5),
        (1, "1"),
        (True, 1),
        (False, 0),
        (None, 0),
        ([1, 2], [2, 1]),
        ("", None),
        ({"a": 1}, {"a": 1, "b": None}),
    ],
)
def test_different_values_are_different_calls(left: Any, right: Any) -> None:
    assert call_key("t", {"v": left}) != call_key("t", {"v": right})


def test_different_tool_names_differ() -> None:
    args = {"path": "a.txt", "line": "x"}
    assert call_key("fs.append", args) != call_key("fs.write", args)


def test_the_tool_name_and_args_cannot_be_confused() -> None:
    assert call_key("a", {"b": "c"}) != call_key('a", {"b', {"": "c"})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused(bad: float) -> None:
    with pytest.raises(ToolError, match="non-finite"):
        call_key("t", {"v": bad})
    with pytest.raises(ToolError):
        call_key("t", {"deep": [{"v": bad}]})


@pytest.mark.parametrize("bad", [b"bytes", {1, 2}, object()])
def test_non_json_values_are_refused(bad: Any) -> None:
    with pytest.raises(ToolError, match="only JSON values"):
        call_key("t", {"v": bad})


def test_the_canonical_form_is_sorted_compact_json() -> None:
    data = canonical_bytes("fs.append", {"b": 1.0, "a": [-0.0, 2.5]})
    assert data == b'["fs.append",{"a":[0,2.5],"b":1}]'
    assert json.loads(data) == ["fs.append", {"a": [0, 2.5], "b": 1}]


def test_normalise_keeps_what_is_already_canonical() -> None:
    value = {"s": "x", "i": 3, "f": 0.25, "b": True, "n": None, "l": [1, "2"]}
    assert normalise(value) == value
    assert type(normalise(True)) is bool


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=100)
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4))
def test_the_key_survives_a_json_round_trip(args: dict[str, Any]) -> None:
    # A call replayed from its logged arguments (JSON on the wire) must find its journal entry.
    assert call_key("t", json.loads(json.dumps(args))) == call_key("t", args)


def test_pause_keys_are_stable_and_distinct() -> None:
    key = pause_key("root/0", 3, "Proceed?")
    assert key == pause_key("root/0", 3, "Proceed?") and len(key) == 16
    assert len({key, pause_key("root/1", 3, "Proceed?"), pause_key("root/0", 4, "Proceed?")}) == 3
