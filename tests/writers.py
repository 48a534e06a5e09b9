"""Session writers (``SessionRuntime``) for the tests that drive one directly: no daemon, no
worker pool, no snapshot store unless given, the default limits, and an ``on_end`` that does
nothing unless given."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from apomesh.plugins.manager import PluginHost
from apomesh.runtime.config import load_config
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.sessions import SessionDeps


async def _no_end(*_: Any) -> None:
    return None


def writer_deps(
    tmp_path: Path,
    *,
    log: Any = None,
    workers: Any = None,
    store: Any = None,
    plugins: PluginHost | None = None,
    on_end: Any = _no_end,
    **more: Any,
) -> SessionDeps:
    """The collaborators of a writer under test (``more``: the other ``SessionDeps`` fields)."""
    return SessionDeps(
        log=cast(Any, log),
        workers=cast(Any, workers),
        snapshots=cast(Any, None),
        store=cast(Any, store),
        plugins=plugins or PluginHost(),
        limits=load_config(None, env={}).limits,
        metrics=DaemonMetrics(),
        incarnation="test",
        workspace=tmp_path,
        on_end=on_end,
        spawn=asyncio.ensure_future,
        closing=lambda: False,
        **more,
    )
