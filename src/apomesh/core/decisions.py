"""Pure recovery decisions: what a restarted daemon does with a session it finds on the log.

``classify`` applies the built-in rules exactly: a session with a durable ``SessionStarted`` and no
logged side effect is auto-resumed from its latest coordinator checkpoint, and so is one a drained
daemon suspended cleanly (``SessionState.cleanly_suspended``: resumed under the same agent refs, its
journaled effects served from the log); one with side effects,
without a bootstrap, or whose pins cannot be satisfied goes to the recoverable list with the reason.
Terminal sessions are never brought back. Recovery classifier plugins may be stricter or looser.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from apomesh.core.state import SessionState

Verdict = Literal["skip", "auto_resume", "recoverable"]

REASON_SIDE_EFFECTS = "side effects logged"
REASON_NO_BOOTSTRAP = "no durable SessionStarted"
REASON_PIN_MISMATCH = "stranded by pin mismatch"
REASON_UNDECODABLE = "undecodable log"
REASON_TERMINAL = "terminal"
REASON_DRAINED = "suspended by a graceful shutdown, no side effect in flight"


class Classification(msgspec.Struct, frozen=True):
    verdict: Verdict
    reason: str
    category: str = ""


def classify(state: SessionState, pin_problem: str | None = None) -> Classification:
    """The built-in classifier's verdict for a decoded, folded session."""
    if state.terminal:
        return Classification("skip", REASON_TERMINAL, "terminal")
    if state.bootstrap is None:
        return Classification("recoverable", REASON_NO_BOOTSTRAP, "no_bootstrap")
    if pin_problem is not None:
        return Classification(
            "recoverable", f"{REASON_PIN_MISMATCH}: {pin_problem}", "pin_mismatch"
        )
    if state.cleanly_suspended:
        return Classification("auto_resume", REASON_DRAINED, "drained")
    if state.has_side_effects:
        return Classification(
            "recoverable", f"{REASON_SIDE_EFFECTS} ({state.side_effects})", "side_effects"
        )
    return Classification("auto_resume", "no side effects logged", "auto")


def acknowledged_unknown(state: SessionState, agent: str, key: str) -> bool:
    """Whether an operator resumed the session past this unknown outcome (it was among those the
    resume showed): a ``hold`` then stops holding it. A new unknown outcome is held again."""
    return (agent, key) in state.acknowledged_unknown


def acknowledgement(state: SessionState) -> list[list[str]]:
    """What an operator's resume acknowledges: every unknown outcome the session holds now, as
    the ``acknowledged`` detail of its ``OperatorAction(resume)``."""
    return [[entry.agent, entry.key] for entry in state.unknown_outcomes]


def next_child_ref(state: SessionState, parent: str) -> str:
    """A fresh child ref under ``parent`` that the log has never used."""
    n = len(state.children_of(parent))
    ref = f"{parent}/{n}"
    while ref in state.agents:
        n += 1
        ref = f"{parent}/{n}"
    return ref
