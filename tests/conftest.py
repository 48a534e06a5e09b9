"""Fixtures shared by every test directory: the async backend anyio's pytest plugin runs on, and a
real headless Chromium page for the console tests (a page fails its test if the console raises;
the browser is shared by the module, each page has a fresh context).

When the tests collected need the browser and Debian's chromium is not installed, the run
provisions it before any test starts: as root it installs the package with apt-get; otherwise it
stops at once with the exact command to run (a browser is never downloaded, and a console test is
never skipped).

Before any test, the project's own modules are byte-compiled (as a wheel install leaves them):
under ``PYTHONDONTWRITEBYTECODE`` an editable install would otherwise compile them from source in
every daemon and worker process the tests start, about 0.4 s of CPU each."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

BROWSER_FIXTURES = frozenset({"browser", "page"})
INSTALL_CHROMIUM = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]


def pytest_sessionstart(session: pytest.Session) -> None:
    import compileall

    root = Path(__file__).resolve().parent.parent
    for tree in (root / "src" / "apomesh", root / "plugins"):
        # Best effort: a read-only checkout runs as before, each process compiling what it needs.
        compileall.compile_dir(tree, quiet=2)


def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    if any(BROWSER_FIXTURES & set(getattr(item, "fixturenames", ())) for item in items):
        provide_chromium()


def provide_chromium() -> None:
    """Make sure the browser the console tests launch is there (see the module docstring)."""
    from tests.browser import CHROMIUM

    if Path(CHROMIUM).exists():
        return
    command = " ".join(INSTALL_CHROMIUM)
    if os.geteuid() != 0:
        pytest.exit(
            f"the console tests need Debian's chromium at {CHROMIUM}, which is missing;"
            f" install it with:  sudo {command}",
            returncode=4,
        )
    if shutil.which("apt-get") is None:
        pytest.exit(f"{CHROMIUM} is missing and there is no apt-get to install it", returncode=4)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"\n{CHROMIUM} is missing: installing Debian's chromium ({command}) ...", flush=True)
    installed = subprocess.run(INSTALL_CHROMIUM, env=env, capture_output=True, text=True)
    if installed.returncode != 0:
        # A fresh machine may have no package lists yet: read them, then try once more.
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
        installed = subprocess.run(INSTALL_CHROMIUM, env=env, capture_output=True, text=True)
    if installed.returncode != 0 or not Path(CHROMIUM).exists():
        pytest.exit(
            f"`{command}` did not provide {CHROMIUM} (exit {installed.returncode}):"
            f" {installed.stderr.strip()[-2000:]}",
            returncode=4,
        )


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # nats-py is asyncio-only, so every async test runs on asyncio. Module-scoped, so that an
    # async fixture may be shared by a module (the browser).
    return "asyncio"


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    """One headless Chromium for the test module; each test gets a context of its own (``page``)."""
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
