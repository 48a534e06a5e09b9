"""The daemon: builds its parts, starts them and stops them.

``Daemon`` is handed its adapters (one NATS connection, the event log, the heartbeat stream, the KV
buckets, the LMDB store, the plugin host; ``apomesh.runtime.node`` builds them) and assembles:

- ``WorkerPool`` (``runtime.workers``): registration, liveness, placement, dispatches per worker;
- ``SessionRegistry`` (``runtime.registry``): live and stranded sessions, leases, state lookup;
- ``SessionRuntime`` (``runtime.sessions``): each session's single writer, built by the registry
  with the collaborators in ``SessionDeps``;
- ``ControlPlane`` (``runtime.control``): the ``ctl.*`` and heartbeat subscriptions;
- ``BootScan`` (``runtime.recovery``): the classification of every session at boot;
- ``Presence`` (``runtime.presence``): this daemon's record among the live daemons, and theirs;
- ``Takeover`` (``runtime.recovery``): adopting the sessions of a daemon that is gone;
- ``Retention`` (``runtime.retention``): purging ended sessions past ``[retention] ended_after``.

The parts are handed their collaborators, never the daemon; the use cases (create, resume, cancel,
answer, migrate) live in ``runtime.service``. Only the node imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.kv import KvBuckets
from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.nats_connect import JetStreamWait
from apomesh.adapters.private_files import read_private_file, write_private_file
from apomesh.core.errors import ApomeshError, LogUnavailable
from apomesh.core.ports import EventLog
from apomesh.core.state import SessionState
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.config import Config
from apomesh.runtime.control import ControlPlane
from apomesh.runtime.live_deltas import LiveDeltas
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.presence import Presence
from apomesh.runtime.recovery import BootScan, Takeover
from apomesh.runtime.registry import SessionRegistry, renew_interval
from apomesh.runtime.retention import SWEEP_EVERY, Retention
from apomesh.runtime.sessions import SessionDeps, SessionRuntime
from apomesh.runtime.snapshots import SnapshotStore
from apomesh.runtime.workers import WorkerPool

log = logging.getLogger("apomesh.daemon")

PRESENCE_CALL_SECONDS = 2.0
"""The longest a drain waits for one presence read or write."""
DRAIN_SUBJECT_PREFIX = "apomesh.daemon.drain."
"""``<prefix><daemon id>``: a request asking that daemon to drain (``Daemon.drain_for_peers``)."""


class Daemon:
    """Build it with its adapters, then ``await start()``; ``aclose()`` stops it."""

    def __init__(
        self,
        config: Config,
        *,
        nc: NATS,
        control_nc: NATS | None = None,
        log_adapter: EventLog,
        heartbeats: HeartbeatStream,
        kv: KvBuckets,
        store: AsyncStore,
        plugins: PluginHost,
        workspace: Path,
        jetstream: JetStreamWait | None = None,
    ) -> None:
        self.config = config
        self.nc = nc
        self.jetstream = jetstream or JetStreamWait(config.nats.jetstream_ready_timeout)
        """How ``start`` waits for JetStream to answer its streams (``Node`` passes the wait its
        own opening of the KV buckets began: one deadline and one warning for the start)."""
        # Worker requests are answered, heartbeats heard and dispatches sent on the control-plane
        # connection (a login without JetStream, KV or log rights) when there is one.
        self.control_nc = control_nc or nc
        self.log = log_adapter
        self.heartbeats = heartbeats
        self.kv = kv
        self.store = store
        self.plugins = plugins
        self.workspace = workspace
        self.incarnation = uuid.uuid4().hex[:12]
        self.daemon_id = self.incarnation  # replaced by the data dir's stable id in start()
        self.metrics = DaemonMetrics()
        self.deltas = LiveDeltas()
        """The pieces of model turns being written, for the sessions' live event streams."""
        self.snapshots = SnapshotStore(store, compact_every=config.snapshots.compact_every)
        self.boot_report: dict[str, Any] = {}
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drain_sub: Any = None
        self._unwatch_leases: Callable[[], Awaitable[None]] | None = None
        self._drained: asyncio.Task[list[str]] | None = None
        self._started = False
        self.renew_every = renew_interval(kv.leases.ttl)

        self.registry = SessionRegistry(
            log_adapter=log_adapter,
            leases=kv.leases,
            store=store,
            snapshots=self.snapshots,
            spawn=self._spawn,
            logger=log,
        )
        scheme = "https" if config.http.tls_cert else "http"
        self.presence = Presence(
            kv.daemons,
            incarnation=self.incarnation,
            url=f"{scheme}://{config.http.listen}",
            sessions=lambda: list(self.registry.live),
            stranded=lambda: list(self.registry.stranded),
            load=lambda: sum(w.load for w in self.workers.workers.values()),
            renew_every=self.renew_every,
            logger=log,
        )
        self.registry.owner_url = self.presence.url_of
        self.registry.changed = self.presence.nudge
        self.registry.closing = self._winding_down
        self.takeover = Takeover(
            log_adapter=log_adapter,
            registry=self.registry,
            presence=self.presence,
            plugins=plugins,
            stopped=self._winding_down,
            settle=kv.leases.ttl,
            logger=log,
        )
        self.registry.let_go = self.takeover.let_go
        self.workers = WorkerPool(
            config,
            nc=self.control_nc,
            incarnation=self.incarnation,
            metrics=self.metrics,
            on_registered=self._wake_sessions,
            logger=log,
        )
        self.session_deps = SessionDeps(
            log=log_adapter,
            workers=self.workers,
            snapshots=self.snapshots,
            store=store,
            plugins=plugins,
            limits=config.limits,
            metrics=self.metrics,
            incarnation=self.incarnation,
            workspace=workspace,
            on_end=self.registry.end,
            spawn=self._spawn,
            closing=lambda: self._closing,
            checkpoints=self.registry.fold_checkpoints,
            checkpoint_every=config.snapshots.fold_checkpoint_every,
            node_commit_delay=config.snapshots.node_commit_delay,
        )
        self.registry.make_runtime = self._make_runtime
        self.control = ControlPlane(
            nc=self.control_nc,
            limits=config.limits,
            workers=self.workers,
            route=self.registry.writer,
            metrics=self.metrics,
            spawn=self._spawn,
            deltas=self.deltas,
            logger=log,
        )
        self.retention = Retention(
            log_adapter=log_adapter,
            store=store,
            registry=self.registry,
            forget=self.registry.folds.forget,
        )
        self.boot = BootScan(
            log_adapter=log_adapter,
            store=store,
            registry=self.registry,
            plugins=plugins,
            spawn=self._spawn,
            closing=self._winding_down,
            logger=log,
            takeover=self.takeover,
        )

    def _winding_down(self) -> bool:
        """Draining or closing: no session is started, adopted or driven again from now on."""
        return self._closing or self.presence.state != "active"

    @property
    def closing(self) -> bool:
        """True once ``aclose`` began: nothing waits for the log any more."""
        return self._closing

    def _make_runtime(self, state: SessionState, fresh_children: bool) -> SessionRuntime:
        return SessionRuntime(self.session_deps, state, fresh_children=fresh_children)

    async def _wake_sessions(self) -> None:
        for runtime in list(self.registry.live.values()):
            await runtime.poke()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, *, recover: bool = True) -> None:
        self.daemon_id = await self._stable_id()
        self.registry.owner = self.daemon_id
        self.presence.daemon_id = self.daemon_id
        self._started = True
        self.workers.daemon_id = self.daemon_id  # names it on dispatches and control subjects
        await self.jetstream.answered(self._ensure_streams)
        await self.control.start()
        self._spawn(
            self.workers.liveness_forever(
                pending_beats=self.control.pending_beats, closing=lambda: self._closing
            )
        )
        # Present before any lease is taken: a lease holds while its owner's record is there, so
        # sessions adopted by a long boot scan are never taken by a peer meanwhile.
        with contextlib.suppress(Exception):
            await self.presence.publish()
        self._spawn(self.presence.publish_forever())
        self._spawn(
            self.registry.fold_checkpoints.keep_current(
                self.config.snapshots.fold_checkpoint_interval
            )
        )
        # The lease watch matters for sessions driven here, and none is before the boot scan
        # adopts its own: it follows every change after this position, from the scan's end, less
        # the scan's own lease takes when nobody else changed a lease meanwhile (each would come
        # back through the client's consumer to say what this daemon knows). Where the position
        # cannot be read, the watch starts now, as before any adoption.
        leases_at = await self.registry.lease_position()
        if leases_at is None:
            self._unwatch_leases = await self.registry.watch_leases()
        with contextlib.suppress(Exception):
            for worker_id in await self.heartbeats.latest():
                await self.workers.ask_reregister(worker_id, force=True)
        if recover:
            # Expired sessions go before the scan, so its numbers count what is left.
            purged = await self._sweep_retention()
            self.boot_report = {**await self.boot.run(), "purged": purged}
            if self.config.retention.ended_after_seconds is not None:
                self._spawn(self._sweep_retention_forever())
        if self._unwatch_leases is None:
            self._unwatch_leases = await self.registry.watch_leases(since=leases_at)
        # Written before the start returns, not only nudged (a nudged write waits 50 ms or more
        # to gather changes): the record names every session the scan stranded as soon as this
        # daemon is up, so one that dies right after still leaves them to a peer's operator.
        try:
            await self.presence.publish()
        except Exception:
            self.presence.nudge()  # the renewal loop tries again
        if recover:
            # A peer that is gone is noticed within a lease TTL: a few looks per renewal.
            self._spawn(self.takeover.sweep_forever(max(0.2, self.renew_every / 2)))
        self._drain_sub = await self.nc.subscribe(
            DRAIN_SUBJECT_PREFIX + self.daemon_id, cb=self._on_drain_request
        )

    async def _ensure_streams(self) -> None:
        await self.log.ensure()
        await self.heartbeats.ensure()

    async def _sweep_retention(self) -> int:
        """Purge the sessions that ended longer ago than ``[retention] ended_after``."""
        keep = self.config.retention.ended_after_seconds
        if keep is None:
            return 0
        try:
            return len(await self.retention.sweep(time.time() - keep))
        except ApomeshError as exc:
            log.warning("retention sweep stopped: %s (the next sweep goes on)", exc)
            return 0

    async def _sweep_retention_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(SWEEP_EVERY)
            await self._sweep_retention()

    async def _on_drain_request(self, msg: Any) -> None:
        self.start_drain()
        with contextlib.suppress(Exception):
            await msg.respond(b"draining")

    def start_drain(self) -> None:
        """Drain for maintenance (``apomesh daemons drain``): place no new session, stop every
        session at a node boundary and hand them over to the live peers; this daemon keeps
        answering reads. Idempotent."""
        if self._drained is None:
            self._drained = self._spawn(self.drain_for_peers())

    async def request_drain(self, daemon_id: str) -> None:
        """Ask the daemon ``daemon_id`` (this one, or a peer over NATS) to drain."""
        if daemon_id == self.daemon_id:
            self.start_drain()
            return
        try:
            await self.nc.request(DRAIN_SUBJECT_PREFIX + daemon_id, b"", timeout=5.0)
        except Exception as exc:
            raise LogUnavailable(
                f"daemon {daemon_id} did not answer the drain request: {exc}"
            ) from None

    async def drain_for_peers(self) -> list[str]:
        """Suspend every session at a node boundary (``SessionSuspended``, within
        ``[daemon] shutdown_timeout``); with live peers, give their leases back and publish the
        record ``drained`` listing them, so that a peer adopts them at once with no unknown
        outcome. Without peers the leases are kept (this daemon resumes them when it starts
        again). Answers the sessions handed over."""
        # A NATS going away must not hold the shutdown: each presence call is bounded.
        self.presence.state = "draining"
        with contextlib.suppress(Exception):
            async with asyncio.timeout(PRESENCE_CALL_SECONDS):
                await self.presence.publish()
        await self.registry.drain(self.config.daemon.shutdown_timeout)
        try:
            async with asyncio.timeout(PRESENCE_CALL_SECONDS):
                peers = await self.presence.live_peers()
        except Exception as exc:
            log.warning("drain: the live peers cannot be listed (%s); leases kept", exc)
            peers = []
        handed: list[str] = []
        if peers:
            handed = await self.registry.hand_over(hold_cut_off=self.kv.leases.ttl)
            self.presence.handed_over = handed
            log.info("drain: %d sessions handed over to %d live peers", len(handed), len(peers))
        self.presence.state = "drained"
        with contextlib.suppress(Exception):
            async with asyncio.timeout(PRESENCE_CALL_SECONDS):
                await self.presence.publish()
        return handed

    async def _stable_id(self) -> str:
        """The data dir's daemon identity (the owner name of its session leases). Kept in a file
        beside LMDB as well as in it, so a lost LMDB does not strand the sessions this daemon
        leased until its presence record ages out."""
        id_file = self.config.daemon.data_path() / "daemon.id"
        stored = await self.store.get("meta", "daemon_id")
        from_file = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            from_file = read_private_file(id_file).decode("utf-8").strip() or None
        daemon_id = from_file or (stored.decode() if stored is not None else self.daemon_id)
        if stored is None or stored.decode() != daemon_id:
            await self.store.write_batch([("meta", "daemon_id", daemon_id.encode())])
        if from_file != daemon_id:
            with contextlib.suppress(OSError):
                # 0600, and never through a symlink planted at that name.
                write_private_file(id_file, (daemon_id + "\n").encode())
        return daemon_id

    async def aclose(self) -> None:
        # Drain first, while the control plane still hears the workers: every session stops at a
        # node boundary and is marked suspended, so the next daemon resumes it by itself
        # (``[daemon] shutdown_timeout`` is the grace period; what is still running then is cut).
        if self._drained is None and self._started:
            self._drained = self._spawn(self.drain_for_peers())
        if self._drained is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._drained)
        self._closing = True
        if self._drain_sub is not None:
            with contextlib.suppress(Exception):
                await self._drain_sub.unsubscribe()
        if self._unwatch_leases is not None:
            with contextlib.suppress(Exception):
                await self._unwatch_leases()
        # Without live peers, leases are not given back here: they lapse with the presence record
        # (left to age out), and this
        # daemon (its id is kept in the data dir) takes its own back at once when it starts
        # again. A release request left unanswered while NATS is going away must never hold the
        # shutdown.
        await self.registry.stop_all()
        # The sessions that appended since the last write leave a current checkpoint.
        with contextlib.suppress(Exception):
            await self.registry.fold_checkpoints.write_changed()
        await self.control.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
