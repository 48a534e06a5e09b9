"""Calling any provider's model through the failures of a real API.

``call_model`` wraps ``Model.respond``: a ``ModelError`` that is ``retryable`` (a rate limit, a
server error, a timeout, an unreachable endpoint) is tried again after a delay, up to the agent's
``[model.retry] attempts``. The delay is the API's ``Retry-After`` when it named one
(``ModelError.retry_after``), honoured as given; otherwise a jittered exponential backoff
(``retry_delay``: half of ``initial_delay * 2**(n-1)``, capped at ``max_delay``, plus a random
part up to the other half, so many agents hit by one outage do not come back in step). The
agent's time budget bounds the waiting: a wait that would overrun ``max_seconds`` is not started.
Every failed attempt is handed to ``on_failure`` before the wait (the worker tells the daemon,
which logs ``ModelRetrying`` so the session shows what it waits for); a call that succeeds at
once costs nothing more than the call. A non-retryable error (400, 401, a malformed answer), or
the last attempt's, is raised as ``ModelGaveUp`` carrying the provider's message.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

import anyio
import msgspec

from apomesh.core.definition import ModelRetry
from apomesh.plugins.api import Model, ModelError, ModelRequest, ModelResponse

_JITTER = random.Random()
"""The backoff's jitter (one generator per process: seeding one per call reads the OS's entropy)."""


class FailedAttempt(msgspec.Struct, frozen=True):
    """Attempt ``attempt`` (1-based) failed with ``error`` after ``seconds``; the next one
    starts in ``retry_in`` seconds, or never (None: given up)."""

    attempt: int
    error: ModelError
    seconds: float
    retry_in: float | None


class ModelAnswer(msgspec.Struct, frozen=True):
    """A successful call: the answer, the seconds its last attempt took, how many attempts."""

    response: ModelResponse
    seconds: float
    attempts: int


class ModelGaveUp(Exception):
    """The model call failed for good; ``reason`` is the provider's message and why it was not
    tried again."""

    def __init__(self, reason: str, error: ModelError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def retry_delay(
    policy: ModelRetry, attempt: int, retry_after: float | None, rng: random.Random
) -> float:
    """Seconds to wait after failed attempt ``attempt``: ``retry_after`` when the API named one,
    else the jittered exponential backoff."""
    if retry_after is not None:
        return retry_after
    ceiling = min(policy.max_delay, policy.initial_delay * 2.0 ** (attempt - 1))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


async def call_model(
    model: Model,
    request: ModelRequest,
    policy: ModelRetry,
    *,
    time_left: Callable[[], float | None],
    on_failure: Callable[[FailedAttempt], Awaitable[None]],
    rng: random.Random | None = None,
) -> ModelAnswer:
    """``model.respond(request)``, tried again on retryable errors as the module says.
    ``time_left`` answers the seconds left in the agent's budget (None: unlimited)."""
    rng = rng or _JITTER
    attempt = 0
    while True:
        attempt += 1
        started = time.monotonic()
        try:
            response = await model.respond(request)
        except ModelError as error:
            seconds = time.monotonic() - started
            why = _why_not_again(policy, attempt, error, time_left())
            delay = retry_delay(policy, attempt, error.retry_after, rng)
            if why is None:
                left = time_left()
                if left is not None and delay >= left:
                    why = f"waiting {delay:.1f} s more would overrun the agent's max_seconds"
            retry_in = None if why is not None else delay
            await on_failure(FailedAttempt(attempt, error, seconds, retry_in))
            if why is not None:
                reason = f"{error.message} ({why})" if why else error.message
                raise ModelGaveUp(reason, error) from None
            await anyio.sleep(delay)
            continue
        return ModelAnswer(response, time.monotonic() - started, attempt)


def _why_not_again(
    policy: ModelRetry, attempt: int, error: ModelError, left: float | None
) -> str | None:
    if not error.retryable:
        return ""
    if attempt >= policy.attempts:
        return f"gave up after {attempt} attempts"
    if left is not None and left <= 0:
        return "the agent's max_seconds is spent"
    return None
