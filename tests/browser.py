"""Driving the operator console in Debian's headless Chromium with Playwright: how it is launched
(the ``browser`` and ``page`` fixtures in tests/conftest.py use this) and selector helpers. The browser is
never downloaded: ``/usr/bin/chromium`` (or ``$APOMESH_CHROMIUM``) must be installed, and a missing
one fails the tests rather than skipping them."""

from __future__ import annotations

import os
from typing import Any

CHROMIUM = os.environ.get("APOMESH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def by_testid(name: str, **data: str) -> str:
    selector = f'[data-testid="{name}"]'
    for key, value in data.items():
        selector += f'[data-{key.replace("_", "-")}="{value}"]'
    return selector


async def wait_for(
    page: Any, selector: str, state: str = "visible", timeout_ms: int = 30_000
) -> Any:
    return await page.wait_for_selector(selector, state=state, timeout=timeout_ms)
