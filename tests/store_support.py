"""Opening the replicated state store in tests: LMDB in a directory and the ``APOMESH_STATE``
bucket on a real nats-server, from synchronous test code."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from apomesh.adapters.lmdb_store import LmdbStore
from apomesh.adapters.replicated_store import ReplicatedStore


def replicated_store(
    urls: str | Sequence[str], path: Path, *, replicas: int = 1, timeout: float = 5.0
) -> ReplicatedStore:
    """A ``ReplicatedStore`` on a new or existing LMDB dir ``path`` and the bucket at ``urls``."""
    servers = [urls] if isinstance(urls, str) else list(urls)
    local = LmdbStore(path)
    try:
        return asyncio.run(ReplicatedStore.open(local, servers, replicas=replicas, timeout=timeout))
    except BaseException:
        local.close()  # as the daemon does: an open tried again finds LMDB free
        raise


def empty_replicated_store(
    urls: str | Sequence[str], path: Path, *, replicas: int = 1, timeout: float = 5.0
) -> ReplicatedStore:
    """A ``ReplicatedStore`` whose bucket holds nothing yet (every record purged)."""
    store = replicated_store(urls, path, replicas=replicas, timeout=timeout)
    store._run(store.replica.purge())
    return store
