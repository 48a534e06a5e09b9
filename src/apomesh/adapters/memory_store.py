"""An in-memory ``StateStore`` for unit tests: the LMDB store's contract on plain dicts.

It shares the LMDB store's key layout and key rules (non-empty UTF-8, at most 511 bytes, known
database names) so a test that passes here means the same thing on disk. One lock makes every call
atomic, as a transaction is; nothing survives the process.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from apomesh.adapters.lmdb_store import (
    DATABASES,
    StoreRecords,
    check_database,
    encode_key,
    snapshot_key,
    snapshot_prefix,
)
from apomesh.core.errors import StoreError


class MemoryStore(StoreRecords):
    """``StateStore`` on dicts; thread-safe; ``close()`` makes later calls raise ``StoreError``."""

    def __init__(self) -> None:
        self._records: dict[str, dict[str, bytes]] = {name: {} for name in DATABASES}
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the in-memory store is closed")

    def write_batch(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Apply the ``puts`` and then the ``deletes`` at once, or none of them on a bad record."""
        checked_puts = []
        for db, key, value in puts:
            check_database(db)
            encode_key(key)
            checked_puts.append((db, key, bytes(value)))
        for db, key in deletes:
            check_database(db)
            encode_key(key)
        with self._lock:
            self._check_open()
            for db, key, value in checked_puts:
                self._records[db][key] = value
            for db, key in deletes:
                self._records[db].pop(key, None)

    def get(self, db: str, key: str) -> bytes | None:
        check_database(db)
        encode_key(key)
        with self._lock:
            self._check_open()
            return self._records[db].get(key)

    def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) in ``db`` whose key starts with ``prefix``, in key order."""
        check_database(db)
        if prefix:
            encode_key(prefix)
        with self._lock:
            self._check_open()
            # Python orders str by code point, which is the order LMDB gives their UTF-8 bytes.
            return sorted(
                (key, value) for key, value in self._records[db].items() if key.startswith(prefix)
            )

    def delete_snapshots_before(self, agent_key: str, snapshot_id: int) -> int:
        prefix = snapshot_prefix(agent_key)
        end = snapshot_key(agent_key, snapshot_id)
        with self._lock:
            self._check_open()
            snapshots = self._records["snapshots"]
            doomed = [key for key in snapshots if key.startswith(prefix) and key < end]
            for key in doomed:
                del snapshots[key]
            return len(doomed)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
