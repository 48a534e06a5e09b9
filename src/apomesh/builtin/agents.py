"""The built-in agent definitions."""

from __future__ import annotations

from typing import Any

DEFAULT_AGENT: dict[str, Any] = {
    "name": "echo",
    "version": "1.0.0",
    "instructions": "Answer with the goal.",
    "coordination": "solo",
    "model": {"provider": "scripted", "turns": [{"final": "done: {task}"}]},
}
"""The agent a session runs when it is created with neither a published agent nor a definition."""
