"""Fixtures shared by every test directory: the async backend anyio's pytest plugin runs on, and a
real headless Chromium page for the console tests (a page fails its test if the console raises)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # nats-py is asyncio-only, so every async test runs on asyncio.
    return "asyncio"


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright
    from tests.browser import CHROMIUM, CHROMIUM_ARGS

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def page(browser: Any) -> AsyncIterator[Any]:
    context = await browser.new_context(viewport={"width": 1360, "height": 1000})
    opened = await context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    await context.close()
    assert errors == [], f"the console raised: {errors}"
