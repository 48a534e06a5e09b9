"""The retry layer around any provider's ``Model.respond`` (``apomesh.runtime.model_calls``), on
an in-memory model that fails as told: which errors are tried again, how long it waits, and
what bounds the waiting."""

from __future__ import annotations

import random

import pytest

from apomesh.core.definition import ModelRetry
from apomesh.plugins.api import ModelError, ModelRequest, ModelResponse
from apomesh.runtime.model_calls import FailedAttempt, ModelGaveUp, call_model, retry_delay

pytestmark = pytest.mark.anyio

FAST = ModelRetry(attempts=4, initial_delay=0.001, max_delay=0.004)
REQUEST = ModelRequest(instructions="", messages=[], tools=[], memory={})


class FlakyModel:
    """Raises each queued error in turn, then answers."""

    def __init__(self, *errors: ModelError) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return ModelResponse(final="ok", prompt_tokens=3, completion_tokens=2)


def failure(status: int | None, retry_after: float | None = None) -> ModelError:
    return ModelError(
        f"answered {status}",
        provider="fake",
        status=status,
        retryable=None if status is not None else True,
        retry_after=retry_after,
    )


async def run(
    model: FlakyModel, policy: ModelRetry = FAST, time_left: float | None = None
) -> tuple[list[FailedAttempt], ModelResponse | ModelGaveUp]:
    seen: list[FailedAttempt] = []

    async def note(failed: FailedAttempt) -> None:
        seen.append(failed)

    try:
        answer = await call_model(
            model, REQUEST, policy, time_left=lambda: time_left, on_failure=note
        )
    except ModelGaveUp as gave_up:
        return seen, gave_up
    assert answer.attempts == len(seen) + 1
    return seen, answer.response


async def test_rate_limits_server_errors_and_timeouts_are_tried_again_until_an_answer() -> None:
    model = FlakyModel(failure(429, retry_after=0.01), failure(503), failure(None))
    seen, outcome = await run(model)
    assert isinstance(outcome, ModelResponse) and outcome.final == "ok"
    assert model.calls == 4
    assert [f.error.status for f in seen] == [429, 503, None]
    assert seen[0].retry_in == 0.01  # the API's Retry-After, as given
    assert all(f.retry_in is not None for f in seen)


@pytest.mark.parametrize("status", [400, 401, 403, 404])
async def test_a_client_error_is_not_tried_again(status: int) -> None:
    model = FlakyModel(failure(status))
    seen, outcome = await run(model)
    assert isinstance(outcome, ModelGaveUp)
    assert model.calls == 1
    assert [f.retry_in for f in seen] == [None]
    assert outcome.reason == f"model provider 'fake' (HTTP {status}): answered {status}"


async def test_attempts_bound_the_retries() -> None:
    model = FlakyModel(*[failure(503) for _ in range(10)])
    seen, outcome = await run(model)
    assert isinstance(outcome, ModelGaveUp)
    assert model.calls == FAST.attempts
    assert "gave up after 4 attempts" in outcome.reason
    assert seen[-1].retry_in is None


async def test_a_wait_that_would_overrun_max_seconds_is_not_started() -> None:
    model = FlakyModel(failure(429, retry_after=30.0))
    _, outcome = await run(model, time_left=5.0)
    assert isinstance(outcome, ModelGaveUp)
    assert model.calls == 1
    assert "max_seconds" in outcome.reason
    assert "HTTP 429" in outcome.reason


def test_the_backoff_doubles_with_jitter_up_to_its_ceiling() -> None:
    policy = ModelRetry(attempts=10, initial_delay=1.0, max_delay=8.0)
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (9, 8.0)]:
        delays = {retry_delay(policy, attempt, None, rng) for _ in range(50)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1  # jittered, so an outage's agents do not come back in step
    assert retry_delay(policy, 1, 12.5, rng) == 12.5
