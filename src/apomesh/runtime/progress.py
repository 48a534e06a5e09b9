"""How far a long task of the daemon has come, and how many wait for one thing, each said at
most once every few seconds.

A daemon start over a large log reads it whole (the boot scan's pass) and may first purge
thousands of expired sessions (the retention sweep); ``ProgressLog`` is what ``apomesh serve``
says meanwhile, one line every ``PROGRESS_EVERY`` seconds, instead of nothing until the start is
done. A task shorter than that says nothing more than its usual closing line. Thousands of
sessions resumed at once can wait together for one thing (room on a worker, the log while NATS
does not answer): ``Waiting`` counts them, and their warning is one line every
``WAITING_EVERY`` seconds for all of them instead of a line each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

PROGRESS_EVERY = 2.0
"""Seconds between two progress lines of one task."""

WAITING_EVERY = 10.0
"""Seconds between two warnings that some wait for one thing (``Waiting``)."""


class ProgressLog:
    """Called with how much of a task is done; logs ``<what>: <done> of <total> <unit> (<n>%)``
    at info once ``every`` seconds have passed since the task began or since its last line."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        unit: str,
        *,
        every: float = PROGRESS_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.unit = unit
        self.every = every
        self._clock = clock
        self._due = clock() + every
        self._said: int | None = None  # the ``done`` of the last line logged

    def __call__(self, done: int, total: int) -> None:
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self.every
        self._say(done, total)

    def finish(self, total: int) -> None:
        """The task is done: its last line, ``total`` of ``total``, if it said anything before
        and not that already (a short task's own closing line is enough)."""
        if self._said is not None and self._said != total:
            self._say(total, total)

    def _say(self, done: int, total: int) -> None:
        self._said = done
        share = 100 * done // total if total > 0 else 100
        self.logger.info(
            "%s: %s of %s %s (%d%%)", self.what, f"{done:,}", f"{total:,}", self.unit, share
        )


class Waiting:
    """How many wait for one thing now (``count``, kept by ``enter`` and ``leave``), and when
    their one warning is due (``due``: at most once every ``every`` seconds)."""

    def __init__(
        self, *, every: float = WAITING_EVERY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.count = 0
        self.every = every
        self._clock = clock
        self._said_at: float | None = None

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1

    def due(self) -> bool:
        """True when the warning may be said now (it is then taken as said)."""
        now = self._clock()
        if self._said_at is not None and now - self._said_at < self.every:
            return False
        self._said_at = now
        return True

    def others(self, counted: bool) -> str:
        """`` (with N others)`` for a warning of one waiter (``counted``: among ``count``), or
        nothing when it waits alone."""
        others = self.count - counted
        return f" (with {others:,} others)" if others > 0 else ""
