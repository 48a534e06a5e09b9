"""The built-in recovery classifier: the default rules of ``apomesh.core.decisions.classify``.

It never defers, so it is asked last (after every third-party classifier): a session with a
durable ``SessionStarted`` and no logged side effect is auto-resumed; one with side effects,
without a bootstrap, or whose pins cannot be satisfied goes to the recoverable list.
"""

from __future__ import annotations

from apomesh.core.decisions import Classification, classify
from apomesh.core.state import SessionState
from apomesh.plugins.api import Tool


class BuiltinRecoveryClassifier:
    """``classify`` exactly, as a ``RecoveryClassifier`` named ``builtin``."""

    name: str = "builtin"

    def classify(
        self, state: SessionState, pin_problem: str | None, tools: dict[str, Tool]
    ) -> Classification | None:
        return classify(state, pin_problem)
