"""How soon a daemon writes its presence record again after a change (``rewrite_delay``): a burst
of changes is one write, a large record is written at most a tenth of the time, and the renewal
is never held back past a quarter of its interval."""

from __future__ import annotations

import pytest

from apomesh.runtime.presence import REWRITE_SHARE, rewrite_delay


@pytest.mark.parametrize(
    ("last_write", "interval", "delay"),
    [
        (0.0, 10.0, 0.05),  # the first write, or a small record: 50 ms gathers a burst
        (0.001, 10.0, 0.05),
        (0.02, 10.0, 0.02 * REWRITE_SHARE),  # a record listing many sessions
        (5.0, 10.0, 2.5),  # a very slow write still leaves the renewal on time
        (0.05, 0.4, 0.1),  # a short test interval bounds it too
    ],
)
def test_the_next_write_waits_in_proportion_to_the_last(
    last_write: float, interval: float, delay: float
) -> None:
    assert rewrite_delay(last_write, interval) == pytest.approx(delay)
