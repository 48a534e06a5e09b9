"""The heartbeat stream: the latest beat of every worker, kept so a restarted daemon knows them.

Workers beat with a plain core-NATS publish on ``apomesh.hb.<worker_id>`` (no JetStream API, so a
worker behind a leaf node needs nothing more). Stream ``APOMESH_HB`` captures those subjects and
keeps one message per subject: the latest beat. ``HeartbeatStream.latest()`` reads them all back,
for a daemon that starts with no memory of who was alive. Liveness itself is decided by the daemon
from a live core subscription on ``HEARTBEAT_WILDCARD``, on its own monotonic clock: a worker is
lost after a configured number of missed beats, never because one request failed. Beats older
than ``max_age`` (a day by default) drop out of the stream, so long-gone workers do not linger.
"""

from __future__ import annotations

import nats.js.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from apomesh.adapters.nats_connect import NATS, direct_get_pages, unavailable_as_log_error
from apomesh.core.errors import LogError

HEARTBEAT_STREAM = "APOMESH_HB"
HEARTBEAT_PREFIX = "apomesh.hb"
HEARTBEAT_WILDCARD = f"{HEARTBEAT_PREFIX}.*"


def beat_subject(worker_id: str) -> str:
    """The subject a worker publishes its beats on."""
    if not worker_id or any(c in worker_id for c in ".*> \t\r\n"):
        raise ValueError(
            f"invalid worker id {worker_id!r}: one subject token, no '.', '*', '>' or spaces"
        )
    return f"{HEARTBEAT_PREFIX}.{worker_id}"


class HeartbeatStream:
    """Creates the heartbeat stream and reads the latest beat per worker."""

    def __init__(
        self,
        nc: NATS,
        replicas: int = 1,
        *,
        stream: str = HEARTBEAT_STREAM,
        max_age: float = 24 * 3600.0,
        timeout: float = 5.0,
        page: int = 1000,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=timeout)
        self.replicas = replicas
        self.stream = stream
        self._max_age = max_age
        self._timeout = timeout
        self._page = page

    async def ensure(self) -> None:
        """Create the stream, or bring an existing one to the wanted replicas and limits."""
        wanted = StreamConfig(
            name=self.stream,
            description="apomesh worker heartbeats: the latest beat per worker",
            subjects=[HEARTBEAT_WILDCARD],
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            max_msgs_per_subject=1,
            max_age=self._max_age,
            discard=DiscardPolicy.OLD,
            allow_direct=True,
        )
        with unavailable_as_log_error(f"ensure stream {self.stream}"):
            try:
                info = await self._js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                try:
                    await self._js.add_stream(wanted)
                except nats.js.errors.APIError as exc:
                    raise LogError(
                        f"cannot create stream {self.stream}: {exc.description}"
                    ) from None
                return
            current = info.config
            if (
                (current.num_replicas or 1) == self.replicas
                and current.max_msgs_per_subject == 1
                and current.allow_direct
                and set(current.subjects or []) == {HEARTBEAT_WILDCARD}
            ):
                return
            try:
                await self._js.update_stream(wanted)
            except nats.js.errors.APIError as exc:
                raise LogError(
                    f"stream {self.stream} has {current.num_replicas} replicas and"
                    f" max_msgs_per_subject={current.max_msgs_per_subject}; wanted {self.replicas} and 1,"
                    f" but the server refused the update: {exc.description}"
                ) from None

    async def latest(self) -> dict[str, bytes]:
        """The latest beat payload of every worker the stream holds, by worker id.

        The stream keeps one message per subject, so reading it in sequence order gives every
        worker's latest beat; a beat that lands during the read replaces an older one further
        on, and the later sequence wins.
        """
        prefix = f"{HEARTBEAT_PREFIX}."
        beats: dict[str, bytes] = {}
        request = {"next_by_subj": HEARTBEAT_WILDCARD, "batch": self._page}
        async for page in direct_get_pages(self._nc, self.stream, request, timeout=self._timeout):
            for msg in page.messages:
                headers = msg.headers or {}
                subject = headers.get("Nats-Subject", "")
                if subject.startswith(prefix):
                    beats[subject[len(prefix) :]] = msg.data
        return beats

    async def forget(self, worker_id: str) -> None:
        """Drop a worker's kept beat (it was unregistered for good)."""
        with unavailable_as_log_error(f"forget worker {worker_id}"):
            await self._js.purge_stream(self.stream, subject=beat_subject(worker_id))
