"""Fixtures shared by every test directory: the async backend anyio's pytest plugin runs on."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # nats-py is asyncio-only, so every async test runs on asyncio.
    return "asyncio"
