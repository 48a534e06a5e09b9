"""The debate plugin's tests run against the installed distribution: install it when missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from apomesh.testing import install_plugin_package


@pytest.fixture(scope="session", autouse=True)
def debate_distribution() -> str:
    """The distribution name, installed (editable) into this environment if it was not."""
    return install_plugin_package(Path(__file__).resolve().parents[1])
