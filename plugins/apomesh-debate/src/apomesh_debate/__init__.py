"""apomesh-debate: the ``debate`` coordination kind for apomesh (see ``apomesh_debate.plugin``)."""

from __future__ import annotations

from apomesh_debate.plugin import Debate, DebateFailed

__all__ = ["Debate", "DebateFailed"]
