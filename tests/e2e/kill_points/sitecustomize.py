"""Exact kill points inside a real ``apomesh worker`` process, for the exact-replay tests.

Python imports ``sitecustomize`` at start-up from ``sys.path``; a worker started with this
directory on its ``PYTHONPATH`` and ``KILL_POINTS_DIR`` naming a directory stops itself
(``SIGSTOP``) at a point of an agent's step that a test armed by creating ``arm-<point>`` there:

- ``intent``: before sending the report that carries a side-effecting call's intent;
- ``effect``: after the daemon answered that intent with ``run``, before the effect;
- ``report``: after the effect, before the report carrying its result;
- ``done``: before sending a ``Done`` with the agent's plan or final answer;
- ``turn-stored`` (in an ``apomesh serve`` process): after the daemon stored a model turn's
  snapshot, before it appended the turn's pointer to the log;
- ``node-unstored`` (in an ``apomesh serve`` process): the next turn's report has just reached
  the daemon, carrying a node with journaled results (``TurnReport.node``: neither is stored
  nor logged yet), or after a node reported alone whose snapshot waits for that turn.

The first worker to reach an armed point takes it (``arm-<point>`` renamed to
``hit-<point>-<pid>``, so it fires once) and freezes there; the test then SIGKILLs that pid, or
leaves it frozen past the heartbeat threshold and thaws it later. Nothing else changes.
"""

from __future__ import annotations

import os

DIRECTORY = os.environ.get("KILL_POINTS_DIR")


def _install(directory: str) -> None:
    import signal
    from pathlib import Path
    from typing import Any

    from apomesh.runtime import worker as worker_module

    gates = Path(directory)
    real_send = worker_module.Worker.send

    def fire(point: str) -> None:
        try:
            os.rename(gates / f"arm-{point}", gates / f"hit-{point}-{os.getpid()}")
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGSTOP)

    async def send(self: Any, report: Any, *args: Any) -> Any:
        kind = type(report).__name__
        intent = kind == "JournalBegin" or getattr(report, "intent", None) is not None
        if intent:
            fire("intent")
        node = report if kind == "NodeReport" else getattr(report, "node", None)
        if kind == "JournalFinish" or (node is not None and node.results):
            fire("report")
        if kind == "Done" and report.outcome in ("final", "plan"):
            fire("done")
        reply = await real_send(self, report, *args)
        if intent and reply.status == "ok" and reply.decision == "run":
            fire("effect")
        return reply

    worker_module.Worker.send = send  # type: ignore[method-assign]

    from apomesh.core.events import TURN_SOURCE
    from apomesh.runtime import sessions as sessions_module
    from apomesh.runtime import snapshots as snapshots_module

    real_commit = snapshots_module.SnapshotStore.commit

    async def commit(self: Any, staged: Any, **kw: Any) -> Any:
        await real_commit(self, staged, **kw)
        if any(snapshot.source == TURN_SOURCE for snapshot in staged):
            fire("turn-stored")

    snapshots_module.SnapshotStore.commit = commit  # type: ignore[method-assign]

    real_on_turn = sessions_module.SessionRuntime._on_turn

    async def on_turn(self: Any, slot: Any, report: Any, size: int) -> Any:
        if slot.deferred is not None or (report.node is not None and report.node.results):
            fire("node-unstored")
        return await real_on_turn(self, slot, report, size)

    sessions_module.SessionRuntime._on_turn = on_turn  # type: ignore[method-assign]


if DIRECTORY:
    _install(DIRECTORY)
