"""The ``apomesh`` command's entry (``apomesh.__main__``, also ``python -m apomesh``): the command
line's modules are imported with the garbage collector off and kept out of its walks, and the
installed ``apomesh`` script runs that entry."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

PROBE = """
import gc, sys
during_import = []
gc.callbacks.append(
    lambda phase, info: phase == "start" and during_import.append("apomesh.cli" not in sys.modules)
)
from apomesh.__main__ import main
sys.argv = ["apomesh", "--version"]
code = main()
assert code == 0, code
assert "apomesh.cli" in sys.modules
assert not any(during_import), "a collection ran while the command line was imported"
assert gc.isenabled() and gc.get_freeze_count() > 10_000, gc.get_freeze_count()
"""


def test_the_command_line_is_imported_without_collections() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("apomesh "), done.stdout


def test_the_installed_script_and_python_m_run_the_same_entry() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["apomesh"] == "apomesh.__main__:main"
    done = subprocess.run(
        [sys.executable, "-m", "apomesh", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("apomesh ")
