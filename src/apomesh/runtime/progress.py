"""How far a long task of the daemon has come, logged at most once every few seconds.

A daemon start over a large log reads it whole (the boot scan's pass) and may first purge
thousands of expired sessions (the retention sweep); ``ProgressLog`` is what ``apomesh serve``
says meanwhile, one line every ``PROGRESS_EVERY`` seconds, instead of nothing until the start is
done. A task shorter than that says nothing more than its usual closing line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

PROGRESS_EVERY = 2.0
"""Seconds between two progress lines of one task."""


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
