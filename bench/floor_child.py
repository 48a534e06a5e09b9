"""The naive loop of ``bench_workload.py`` as its own process, for the kill -9 recovery figure:
``python bench/floor_child.py URL DIR SESSIONS STEPS``. Each session picks up from its LMDB
snapshot and the events after it, so a restart after kill -9 goes on where it stopped. It imports
only what the loop needs (nats-py, LMDB), so its restart is not slowed by the framework's imports.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import lmdb
import nats
import nats.js.errors
from nats.js.api import StorageType, StreamConfig

FLOOR_CHILD = Path(__file__).resolve()

TURN_TEXT = "Looked the record up; appending the step's line next. " * 3
"""The model's words each turn: with the two calls and their results, ~300 bytes a step."""


async def floor_child(url: str, base: Path, sessions: int, steps: int) -> None:
    """Run (or go on with) ``sessions`` sessions of ``steps`` steps on the NATS at ``url``."""
    nc = await nats.connect(url, name="bench-floor")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="FLOOR", subjects=["floor.>"], storage=StorageType.FILE))
    env = lmdb.open(str(base / "floor-lmdb"), map_size=1 << 30, sync=True)
    folder = base / "bench"
    folder.mkdir(exist_ok=True)

    def put(key: bytes, value: bytes) -> None:
        with env.begin(write=True) as txn:
            txn.put(key, value)

    async def session(n: int) -> None:
        subject = f"floor.s{n}"
        with env.begin() as txn:
            stored = txn.get(subject.encode())
        seq, next_step = (0, 0)
        if stored is not None:
            seq, next_step = (int(x) for x in stored[:40].split(b",")[:2])
        try:  # the events after the snapshot: here the last one tells the step it reached
            msg = await js.get_last_msg("FLOOR", subject)
            if msg.seq > seq:
                seq, next_step = msg.seq, int(msg.data.split(b",")[0]) + 1
        except nats.js.errors.NotFoundError:
            pass
        fd = os.open(folder / f"s{n}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for step in range(next_step, steps):
                event = f"{step},{TURN_TEXT}".encode().ljust(300)
                ack = await js.publish(
                    subject, event, headers={"Nats-Expected-Last-Subject-Sequence": str(seq)}
                )
                seq = ack.seq
                os.write(fd, f"s{n} step {step}".ljust(63).encode() + b"\n")
                await asyncio.to_thread(
                    put, subject.encode(), f"{seq},{step + 1},".encode().ljust(300)
                )
        finally:
            os.close(fd)

    await asyncio.gather(*(session(n) for n in range(sessions)))
    await nc.close()
    env.close()


if __name__ == "__main__":
    url, base, sessions, steps = sys.argv[1:5]
    asyncio.run(floor_child(url, Path(base), int(sessions), int(steps)))
