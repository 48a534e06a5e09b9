"""Exact kill points inside a real ``apomesh worker`` process, for the exact-replay tests.

Python imports ``sitecustomize`` at start-up from ``sys.path``; a worker started with this
directory on its ``PYTHONPATH`` and ``KILL_POINTS_DIR`` naming a directory stops itself
(``SIGSTOP``) at a point of an agent's step that a test armed by creating ``arm-<point>`` there:

- ``intent``: before sending the report that carries a side-effecting call's intent;
- ``effect``: after the daemon answered that intent with ``run``, before the effect;
- ``report``: after the effect, before the report carrying its result;
- ``done``: before sending a ``Done`` with the agent's plan or final answer;
- ``turn-stored`` (in an ``apomesh serve`` process): after the daemon stored a model turn's
  snapshot, before it appended the turn's pointer to the log.

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
        if kind == "JournalFinish" or (kind == "NodeReport" and report.results):
            fire("report")
        if kind == "Done" and report.outcome in ("final", "plan"):
            fire("done")
        reply = await real_send(self, report, *args)
        if intent and reply.status == "ok" and reply.decision == "run":
            fire("effect")
        return reply

    worker_module.Worker.send = send  # type: ignore[method-assign]

    from apomesh.runtime import snapshots as snapshots_module
    from apomesh.runtime.protocol import TurnReport

    real_write = snapshots_module.SnapshotStore.write

    async def write(self: Any, agent_key: str, config: Any, report: Any, **kw: Any) -> Any:
        written = await real_write(self, agent_key, config, report, **kw)
        if isinstance(report, TurnReport):
            fire("turn-stored")
        return written

    snapshots_module.SnapshotStore.write = write  # type: ignore[method-assign]


if DIRECTORY:
    _install(DIRECTORY)
