"""The ``openai`` and ``anthropic`` providers against the replayed answers of OpenAI, vLLM, Ollama,
llama.cpp server and the Anthropic Messages API: a tool call and a text answer, streamed (the
deltas arrive in order and add up to the answer; usage from the last chunk) and, for Anthropic,
whole; errors inside a stream and before it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from tests.fakes.stream_server import FLAVOURS, LEAKED_KEY, ReplayServer

from apomesh.builtin.anthropic_model import AnthropicProvider
from apomesh.builtin.openai_model import Credential, OpenAIProvider
from apomesh.builtin.tools import BUILTIN_TOOLS
from apomesh.core.definition import ModelRetry, ModelSpec, ToolCallSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import (
    MODEL_DELTAS,
    Message,
    Model,
    ModelDelta,
    ModelError,
    ModelRequest,
    describe_tool,
)
from apomesh.runtime.model_calls import FailedAttempt, call_model

pytestmark = pytest.mark.anyio

TOOLS = [describe_tool(t) for t in BUILTIN_TOOLS if t.name in ("fs.read", "fs.write")]
ARGS = {"path": "note.txt", "content": "hello from the stream"}
TEXT = "Wrote note.txt for you."


@pytest.fixture(scope="module", params=FLAVOURS)
def server(request: pytest.FixtureRequest) -> Iterator[ReplayServer]:
    with ReplayServer(request.param) as replay:
        yield replay


def make_model(server: ReplayServer, **options: Any) -> Model:
    provider_type = AnthropicProvider if server.flavour == "anthropic" else OpenAIProvider
    provider = provider_type(
        credentials={"replay": Credential(base_url=server.base_url, api_key_env="TEST_KEY")},
        environ={"TEST_KEY": "sk-test"},
    )
    spec = ModelSpec(provider=provider.name, model="m", options={"credential": "replay", **options})
    return provider.create(spec)


def request(messages: list[Message]) -> ModelRequest:
    return ModelRequest(instructions="Keep notes.", messages=messages, tools=TOOLS, memory={})


async def respond_collecting(model: Model, req: ModelRequest) -> tuple[Any, list[ModelDelta]]:
    deltas: list[ModelDelta] = []

    async def sink(delta: ModelDelta) -> None:
        deltas.append(delta)

    token = MODEL_DELTAS.set(sink)
    try:
        return await model.respond(req), deltas
    finally:
        MODEL_DELTAS.reset(token)


async def test_a_streamed_tool_call_then_a_streamed_answer(server: ReplayServer) -> None:
    model = make_model(server, stream=True)
    server.tool_call("fs__write", ARGS, prompt_tokens=96, completion_tokens=22)
    server.text(TEXT, prompt_tokens=130, completion_tokens=9)
    user = Message(role="user", content="write a note")

    first, deltas = await respond_collecting(model, request([user]))

    assert first.tool_calls == [ToolCallSpec("fs.write", ARGS)]
    assert (first.prompt_tokens, first.completion_tokens, first.tokens) == (96, 22, 118)
    assert deltas[0] == ModelDelta("start")
    calls = [d for d in deltas if d.kind == "tool_call"]
    assert calls[0].tool == "fs.write" and {d.call for d in calls} == {0}
    assert json.loads("".join(d.arguments for d in calls)) == ARGS
    if server.flavour != "ollama":
        assert len(calls) > 2, "the arguments arrive in fragments"
    body = server.requests[-1].body
    assert body["stream"] is True
    if server.flavour != "anthropic":
        assert body["stream_options"] == {"include_usage": True}

    assistant = Message(role="assistant", tool_calls=first.tool_calls)
    result = Message(role="tool", content="ok", name="fs.write")
    second, deltas = await respond_collecting(model, request([user, assistant, result]))

    assert second.final == TEXT
    assert (second.prompt_tokens, second.completion_tokens, second.tokens) == (130, 9, 139)
    texts = [d.text for d in deltas if d.kind == "text"]
    assert len(texts) > 1 and "".join(texts) == TEXT
    assert all(d.kind != "tool_call" for d in deltas)


async def test_the_retry_layer_covers_streamed_calls(server: ReplayServer) -> None:
    """A refusal before the stream starts (a 429 with its Retry-After) or an error inside it,
    then a stream whose connection drops mid-way: both tried again, the third call answers."""
    model = make_model(server, stream=True)
    if server.flavour == "openai":
        server.refuse(429)
    else:
        server.stream_error()
    server.text(TEXT, prompt_tokens=500, completion_tokens=500, cut_after=3)
    server.tool_call("fs__write", ARGS, prompt_tokens=96, completion_tokens=22)
    failures: list[FailedAttempt] = []
    deltas: list[ModelDelta] = []

    async def failed(attempt: FailedAttempt) -> None:
        failures.append(attempt)

    async def sink(delta: ModelDelta) -> None:
        deltas.append(delta)

    token = MODEL_DELTAS.set(sink)
    try:
        answer = await call_model(
            model,
            request([Message(role="user", content="write a note")]),
            ModelRetry(attempts=3, initial_delay=0.01, max_delay=0.01),
            time_left=lambda: None,
            on_failure=failed,
        )
    finally:
        MODEL_DELTAS.reset(token)

    assert answer.attempts == 3
    assert answer.response.tool_calls == [ToolCallSpec("fs.write", ARGS)]
    # Only the answer that completed counts its tokens.
    assert (answer.response.prompt_tokens, answer.response.completion_tokens) == (96, 22)
    assert [f.error.retryable for f in failures] == [True, True]
    assert "broke before the answer was complete" in failures[1].error.message
    if server.flavour == "openai":
        assert (failures[0].error.status, failures[0].retry_in) == (429, 2.0)
    assert [d.kind for d in deltas].count("start") == 3, "each attempt starts its preview over"


async def test_an_error_inside_the_stream_is_a_short_typed_error(server: ReplayServer) -> None:
    model = make_model(server, stream=True)
    if server.flavour == "openai":
        server.refuse(429)
    else:
        server.stream_error()

    with pytest.raises(ModelError) as caught:
        await respond_collecting(model, request([Message(role="user", content="go")]))

    error = caught.value
    assert error.retryable, error
    assert LEAKED_KEY not in error.message, "a key in the message is scrubbed"
    expected = {
        "openai": "rate_limit_exceeded",
        "vllm": "InternalServerError",
        "ollama": "api_error",
        "llamacpp": "ended before the answer was complete",
        "anthropic": "overloaded_error",
    }[server.flavour]
    assert expected in error.message, error.message
    if server.flavour != "llamacpp":  # llama.cpp's error line is not an SSE field: only the cut
        assert "internal detail (upstream key ***)" in error.message, error.message
    if server.flavour == "openai":
        assert error.status == 429


@pytest.mark.parametrize("status", [429, 401])
async def test_anthropic_refusals_carry_status_type_and_retry_after(status: int) -> None:
    with ReplayServer("anthropic") as server:
        model = make_model(server)
        server.refuse(status)
        with pytest.raises(ModelError) as caught:
            await model.respond(request([Message(role="user", content="go")]))
    error = caught.value
    assert error.status == status
    assert error.retryable is (status == 429)
    assert error.retry_after == (2.0 if status == 429 else None)
    kind = "rate_limit_error" if status == 429 else "authentication_error"
    assert kind in error.message and LEAKED_KEY not in error.message
    assert "internal detail (upstream key ***)" in error.message, "the provider's message is kept"


async def test_anthropic_without_streaming_maps_tools_results_and_usage() -> None:
    with ReplayServer("anthropic") as server:
        model = make_model(server, temperature=0.1)
        server.tool_call("fs__write", ARGS, prompt_tokens=40, completion_tokens=12)
        server.text(TEXT, prompt_tokens=70, completion_tokens=5)
        user = Message(role="user", content="write a note")
        first = await model.respond(request([user]))
        assistant = Message(role="assistant", content="Writing.", tool_calls=first.tool_calls * 2)
        results = [Message(role="tool", content="ok", name="fs.write")]
        second = await model.respond(request([user, assistant, *results]))

    assert first.tool_calls == [ToolCallSpec("fs.write", ARGS)]
    assert (first.prompt_tokens, first.completion_tokens, first.tokens) == (40, 12, 52)
    assert second.final == TEXT
    body = server.requests[-1].body
    headers = {k.lower(): v for k, v in server.requests[-1].headers.items()}
    assert headers["x-api-key"] == "sk-test" and headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in headers
    assert body["system"] == "Keep notes." and body["max_tokens"] == 4096
    assert body["temperature"] == 0.1 and "stream" not in body
    assert [t["name"] for t in body["tools"]] == ["fs__read", "fs__write"]
    assert "input_schema" in body["tools"][0]
    # Both calls are answered in one user message: the second with a note (it has no result).
    answer = body["messages"][2]
    assert answer["role"] == "user"
    assert [b["tool_use_id"] for b in answer["content"]] == ["toolu_1", "toolu_2"]
    assert answer["content"][1]["content"].startswith("(no result")


@pytest.mark.parametrize("flavour", ["openai", "anthropic"])
def test_stream_must_be_a_boolean(flavour: str) -> None:
    provider = AnthropicProvider if flavour == "anthropic" else OpenAIProvider
    host = provider(credentials={"default": Credential(base_url="http://127.0.0.1:9/v1")})
    spec = ModelSpec(provider=host.name, model="m", options={"stream": "yes"})
    with pytest.raises(DefinitionError) as caught:
        host.check(spec)
    assert "[model].stream" in str(caught.value)


@pytest.mark.parametrize("flavour", ["openai", "anthropic"])
async def test_streamed_and_whole_calls_share_the_providers_pooled_connection(
    flavour: str,
) -> None:
    with ReplayServer(flavour) as server:
        provider_type = AnthropicProvider if flavour == "anthropic" else OpenAIProvider
        provider = provider_type(
            credentials={"replay": Credential(base_url=server.base_url)}, environ={}
        )
        models = [
            provider.create(
                ModelSpec(provider=provider.name, model=name, options={"credential": "replay"})
            )
            for name in ("a", "b")
        ]
        streaming = provider.create(
            ModelSpec(
                provider=provider.name, model="c", options={"credential": "replay", "stream": True}
            )
        )
        calls = [streaming, *models, streaming] if flavour == "anthropic" else [streaming] * 3
        for _ in calls:
            server.text(TEXT, prompt_tokens=5, completion_tokens=2)
        for model in calls:
            await model.respond(request([Message(role="user", content="go")]))
        await provider.aclose()
    # Kept alive: every call of the provider's models came over one connection.
    assert len(server.requests) == len(calls)
    assert len({r.client_port for r in server.requests}) == 1
