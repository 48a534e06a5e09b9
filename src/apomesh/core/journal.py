"""Journal keys: the content hash that names a side-effecting tool call under its agent.

The canonical form is ``sha256(json([tool, args]))`` where the JSON has sorted keys at every level,
no whitespace, and numbers normalised: a float with an integral value becomes that integer (``1.0``
and ``1`` are one call), ``-0.0`` becomes ``0``, tuples become lists. Non-finite floats are refused
(they have no JSON form). The key is scoped by the agent ref that made the call, so two agents
making the same call are two effects.

A call's idempotency key (``ToolContext.idempotency_key``, for a downstream API that deduplicates
requests) is the journal key made unique across sessions and agents: the hex ``sha256`` of the
UTF-8 text ``apomesh-idempotency``, the session id, the agent ref and the journal key, joined by NUL
characters. It is as stable as the journal key: a replayed turn makes the same calls with the same
arguments and repeat numbers.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

from apomesh.core.errors import ToolError


def normalise(value: Any) -> Any:
    """The canonical value of tool arguments (see the module docstring)."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError(f"tool arguments may not hold the non-finite number {value!r}")
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {str(k): normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [normalise(v) for v in value]
    raise ToolError(f"tool arguments may hold only JSON values, not {type(value).__name__}")


def canonical_bytes(tool: str, args: dict[str, Any]) -> bytes:
    return msgspec.json.encode([tool, normalise(args)], order="sorted")


def call_key(tool: str, args: dict[str, Any]) -> str:
    """The journal key of a call: hex sha256 of its canonical form."""
    return hashlib.sha256(canonical_bytes(tool, args)).hexdigest()


def pause_key(agent: str, step: int, question: str) -> str:
    """A HITL pause id that a re-run of the same loop reaches again (same agent, step, question)."""
    digest = hashlib.sha256(msgspec.json.encode([agent, step, question])).hexdigest()
    return digest[:16]


IDEMPOTENCY_PREFIX = "apomesh-idempotency"


def idempotency_key(session_id: str, agent: str, journal_key: str) -> str:
    """The idempotency key of a journaled call (see the module docstring)."""
    text = "\0".join((IDEMPOTENCY_PREFIX, session_id, agent, journal_key))
    return hashlib.sha256(text.encode()).hexdigest()
