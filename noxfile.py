"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s bench``, ``nox -s chaos``."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole suite against real nats-server processes, LMDB and a headless browser."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, mypy --strict over src, and the import-linter layering contracts."""
    session.install("-e", ".[dev]")
    session.run("ruff", "check", "src", "tests", "bench")
    session.run("ruff", "format", "--check", "src")
    session.run("mypy", "src/apomesh")
    session.run("lint-imports")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Every benchmark, printing its figures (nothing is asserted)."""
    session.install("-e", ".[test]")
    session.run("python", "bench/run_all.py", *session.posargs)


@nox.session(python="3.11")
def chaos(session: nox.Session) -> None:
    """The long chaos run on a model that never repeats itself: at least 300 SIGKILLs of workers,
    daemons and nats-servers, concurrent operator actions, and a summary (``-- --kills N``,
    ``-- --seconds S``)."""
    session.install("-e", ".[test]")
    session.run("python", "bench/chaos.py", *(session.posargs or ["--kills", "300"]))
