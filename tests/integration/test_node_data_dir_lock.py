"""The data dir's lock on an in-process ``Node`` (embedded nats-server, real LMDB): a second
``Node`` on a data dir in use, or on an embedded store dir another data dir's daemon uses, stops
with ``DataDirInUse`` naming this pid before it starts anything, and the first goes on serving;
a closed ``Node`` lets go of both. The lock itself (``lock_dir``) names a live holder in another
process, blocks nobody once that holder is killed, and is not held on by child processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apomesh.adapters.private_files import DataDirInUse, lock_dir
from apomesh.core.errors import StoreError
from apomesh.runtime.config import load_config
from apomesh.runtime.node import PORT_FILE, Node, embedded_client_port


def node_config(data: Path, **nats: Any) -> Any:
    return load_config(
        None,
        env={},
        overrides={"daemon": {"data_dir": str(data), "workers": 1}, "nats": nats},
    )


async def run_one_session(node: Node, final: str) -> str:
    assert node.daemon is not None and node.service is not None
    definition = {
        "name": "one-turn",
        "coordination": "solo",
        "model": {"provider": "scripted", "turns": [{"final": final}]},
    }
    session_id = await node.service.create_session("go", agent=None, definition=definition, by="t")
    runtime = node.daemon.registry.live[session_id]
    assert runtime.task is not None
    await runtime.task
    return runtime.state.status


@pytest.mark.anyio
async def test_a_second_node_on_the_data_dir_stops_before_it_starts_anything(
    tmp_path: Path,
) -> None:
    config = node_config(tmp_path / "data")
    async with Node(config, http=False) as first:
        for _, worker in first.workers:
            await worker.wait_registered()
        server_pid = first.server.pid
        second = Node(config, http=False)
        with pytest.raises(DataDirInUse, match=f"in use by apomesh serve pid {os.getpid()}") as err:
            await second.start()
        assert err.value.pid == os.getpid()
        assert second.server is None and second.store is None and second.nc is None
        assert first.server.running and first.server.pid == server_pid
        assert await run_one_session(first, "still mine") == "completed"
    # Closed, it lets go: the next Node on the data dir starts.
    async with Node(config, http=False) as again:
        for _, worker in again.workers:
            await worker.wait_registered()
        assert await run_one_session(again, "next") == "completed"


@pytest.mark.anyio
async def test_an_embedded_store_dir_outside_the_data_dir_is_locked_too(tmp_path: Path) -> None:
    shared_store = tmp_path / "shared-nats"
    async with Node(node_config(tmp_path / "a", embedded_store_dir=str(shared_store)), http=False):
        other = Node(node_config(tmp_path / "b", embedded_store_dir=str(shared_store)), http=False)
        with pytest.raises(DataDirInUse, match="embedded nats-server store dir"):
            await other.start()
        assert other.server is None
    # The failed start let go of its own data dir.
    async with Node(node_config(tmp_path / "b"), http=False) as node:
        assert node.server is not None and node.server.running


HOLDER = """
import sys, time
from pathlib import Path
from apomesh.adapters.private_files import lock_dir

lock = lock_dir(Path(sys.argv[1]), "daemon.lock", what="data dir", holder="apomesh serve")
print("held", flush=True)
time.sleep(120)
"""


def test_the_lock_names_a_live_holder_and_a_killed_holder_blocks_nobody(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirInUse) as err:
            lock_dir(tmp_path, "daemon.lock", what="data dir", holder="apomesh serve")
        assert err.value.pid == holder.pid
        assert f"data dir {tmp_path} is in use by apomesh serve pid {holder.pid}" in str(err.value)
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    # The killed holder's file is still there, with its pid; it blocks nobody.
    assert (tmp_path / "daemon.lock").read_text().strip() == str(holder.pid)
    lock = lock_dir(tmp_path, "daemon.lock", what="data dir", holder="apomesh serve")
    try:
        assert (tmp_path / "daemon.lock").read_text().strip() == str(os.getpid())
    finally:
        lock.release()


def test_a_child_process_does_not_hold_the_lock_on(tmp_path: Path) -> None:
    lock = lock_dir(tmp_path, "daemon.lock", what="data dir", holder="apomesh serve")
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], close_fds=False
    )
    try:
        lock.release()
        again = lock_dir(tmp_path, "daemon.lock", what="data dir", holder="apomesh serve")
        again.release()
    finally:
        child.kill()
        child.wait()


def test_a_port_file_without_a_port_is_refused_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / PORT_FILE).write_text("not a port\n")
    with pytest.raises(StoreError, match=r"nats\.port should hold the embedded nats-server.s port"):
        embedded_client_port(node_config(data), data)
    assert embedded_client_port(node_config(data, embedded_port=4999), data) == 4999
    (data / PORT_FILE).write_text("4321\n")
    assert embedded_client_port(node_config(data), data) == 4321
