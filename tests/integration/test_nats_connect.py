"""``adapters.nats_connect.connect`` on a real nats-server: the pings it asks of nats-py (a server
that stops answering is left within seconds, not minutes), and a connection closed on purpose
that says nothing of reconnecting."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from apomesh.adapters.nats_connect import connect

pytestmark = pytest.mark.anyio


async def test_pings_are_asked_of_nats_py(nats_server: Any) -> None:
    client = await connect(nats_server.url, ping_interval=1.5, max_pings_outstanding=3)
    try:
        assert client.options["ping_interval"] == 1.5
        assert client.options["max_outstanding_pings"] == 3
    finally:
        await client.close()


async def test_a_connection_closed_on_purpose_says_nothing_of_reconnecting(
    nats_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await connect(nats_server.url)
    with caplog.at_level(logging.INFO, logger="apomesh.nats"):
        await client.close()
    assert "reconnecting" not in caplog.text
