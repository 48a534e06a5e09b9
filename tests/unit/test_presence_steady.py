"""Whether this daemon's presence record has been renewed without a gap (``Presence.steady``): a
peer's missing record says that peer is gone only then. A failed write, or two writes further
apart than ``RENEWAL_GAP`` renewal intervals (NATS stood still, or this process was held up), may
have let every record age out, the live peers' too: steadiness starts again from the next write."""

from __future__ import annotations

import asyncio
import logging

import pytest

from apomesh.runtime.presence import RENEWAL_GAP, Presence


class Table:
    """A presence table whose writes fail while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.written: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> None:
        if self.down:
            raise TimeoutError("nats: timeout")
        self.written[key] = value


def presence(table: Table, renew_every: float) -> Presence:
    return Presence(
        table,  # type: ignore[arg-type]
        incarnation="d1",
        url="",
        sessions=list,
        stranded=list,
        renew_every=renew_every,
    )


@pytest.mark.anyio
async def test_a_record_never_written_is_not_steady_and_the_first_write_is() -> None:
    record = presence(Table(), renew_every=60.0)
    assert not record.steady(0.0)
    await record.publish()
    assert record.steady(3600.0)  # a daemon's first write: nothing lapsed before it


@pytest.mark.anyio
async def test_a_failed_write_ends_steadiness_until_a_write_lands_and_a_ttl_passes() -> None:
    table = Table()
    record = presence(table, renew_every=60.0)
    await record.publish()
    table.down = True
    with pytest.raises(TimeoutError):
        await record.publish()
    assert not record.steady(0.0)
    table.down = False
    await record.publish()
    assert record.steady(0.0)
    assert not record.steady(3600.0)  # steady again only a settle time after that write


@pytest.mark.anyio
async def test_writes_further_apart_than_the_gap_start_steadiness_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = presence(Table(), renew_every=0.01)
    await record.publish()
    await asyncio.sleep(RENEWAL_GAP * 0.01 * 3)
    assert not record.steady(0.0)  # overdue: this daemon's own record may have lapsed
    with caplog.at_level(logging.INFO, logger="apomesh.daemon"):
        await record.publish()
    assert record.steady(0.0)
    assert not record.steady(3600.0)
    assert "presence record renewed again after" in caplog.text


@pytest.mark.anyio
async def test_the_renewal_loop_ends_when_cancelled_in_the_tick_of_a_nudge() -> None:
    # A shutdown cancels the loop right after the last sessions ended, and each end nudges the
    # record: a cancellation that arrives in the same tick as the nudge must still end the loop
    # (asyncio.wait_for on Python 3.11 returned the finished wait instead and the loop went on,
    # holding the daemon's shutdown for ever).
    record = presence(Table(), renew_every=60.0)
    renewing = asyncio.create_task(record.publish_forever())
    await asyncio.sleep(0.01)  # waiting for a change
    record.nudge()
    renewing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(renewing, 5.0)
