"""apomesh: durable agent sessions on NATS JetStream.

A session is the pure fold of its event log; a lost worker or a restarted daemon resumes it from
snapshots and coordinator checkpoints, and journaled side effects never run twice. The public entry
points are the ``apomesh`` command (``apomesh.cli``), the async client ``apomesh.Client``, and the
Python API of docs/python.md: ``@apomesh.tool`` on an async function, ``apomesh.Agent`` and the
embedded mesh ``apomesh.local()`` (``async with apomesh.local() as mesh: await mesh.run(agent,
goal)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apomesh._version import __version__

if TYPE_CHECKING:
    from apomesh.core.errors import SessionNotCompleted
    from apomesh.embedded import Agent, LocalMesh, local
    from apomesh.plugins.api import ProbeResult, ToolContext
    from apomesh.plugins.python_tools import ToolSet, tool
    from apomesh.sdk.client import Client, SyncClient

__all__ = [
    "Agent",
    "Client",
    "LocalMesh",
    "ProbeResult",
    "SessionNotCompleted",
    "SyncClient",
    "ToolContext",
    "ToolSet",
    "__version__",
    "local",
    "tool",
]

# Each name is loaded only when asked for, so the pure core stays light to import (the SDK pulls
# in httpx, the local mesh the whole runtime).
_LAZY = {
    "Client": "apomesh.sdk.client",
    "SyncClient": "apomesh.sdk.client",
    "Agent": "apomesh.embedded",
    "LocalMesh": "apomesh.embedded",
    "local": "apomesh.embedded",
    "ProbeResult": "apomesh.plugins.api",
    "SessionNotCompleted": "apomesh.core.errors",
    "ToolContext": "apomesh.plugins.api",
    "ToolSet": "apomesh.plugins.python_tools",
    "tool": "apomesh.plugins.python_tools",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'apomesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
