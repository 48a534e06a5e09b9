"""apomesh: durable agent sessions on NATS JetStream.

A session is the pure fold of its event log; a lost worker or a restarted daemon resumes it from
snapshots and coordinator checkpoints, and journaled side effects never run twice. The public entry
points are the ``apomesh`` command (``apomesh.cli``) and the async client ``apomesh.Client``.
"""

from __future__ import annotations

from apomesh._version import __version__

__all__ = ["Client", "SyncClient", "__version__"]


def __getattr__(name: str) -> object:
    # The SDK pulls in httpx; load it only when asked for so the pure core stays light to import.
    if name in ("Client", "SyncClient"):
        from apomesh.sdk import client

        return getattr(client, name)
    raise AttributeError(name)
