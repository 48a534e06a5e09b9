"""The ``openai`` provider against the recorded non-streaming answers of OpenAI, vLLM, Ollama and
llama.cpp server (``tests.fakes.openai_shapes``), replayed over HTTP by the local fake server:
tool calls, text answers, token usage and each server's error shapes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.fakes.openai_server import FakeOpenAIServer
from tests.fakes.openai_shapes import FINAL_TEXT, SERVERS, WRITE_ARGS, ErrorShape, ServerShapes

from apomesh.builtin.openai_model import Credential, OpenAIProvider
from apomesh.builtin.tools import BUILTIN_TOOLS
from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.plugins.api import Message, ModelError, ModelRequest, describe_tool

KEY = "sk-proj-a-real-looking-key-0123456789"
TOOLS = [describe_tool(t) for t in BUILTIN_TOOLS if t.name == "fs.write"]
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def provider(server: FakeOpenAIServer) -> OpenAIProvider:
    server.clear()
    return OpenAIProvider(
        credentials={"default": Credential(base_url=server.base_url, api_key_env="KEY")},
        environ={"KEY": KEY},
    )


def ask(purpose: str = "act") -> ModelRequest:
    return ModelRequest(
        instructions="Write notes.",
        messages=[Message(role="user", content="write hello to notes.txt")],
        tools=TOOLS,
        memory={},
        purpose=purpose,
    )


@pytest.mark.parametrize("shapes", SERVERS, ids=lambda s: s.name)
async def test_a_recorded_tool_call_then_answer(
    server: FakeOpenAIServer, provider: OpenAIProvider, shapes: ServerShapes
) -> None:
    model = provider.create(ModelSpec(provider="openai", model="m"))
    server.replay(shapes.tool_call)
    server.replay(shapes.final)

    turn = await model.respond(ask())
    assert turn.tool_calls == [ToolCallSpec("fs.write", WRITE_ARGS)]
    assert turn.final is None
    assert (turn.prompt_tokens, turn.completion_tokens) == shapes.usage
    assert turn.tokens == sum(shapes.usage)

    answered = [
        Message(role="user", content="write hello to notes.txt"),
        Message(role="assistant", tool_calls=list(turn.tool_calls)),
        Message(role="tool", content="wrote 5 bytes", name="fs.write"),
    ]
    final = await model.respond(
        ModelRequest(instructions="Write notes.", messages=answered, tools=TOOLS, memory={})
    )
    assert final.final == FINAL_TEXT and final.tool_calls == []
    # The fake refuses (400) a conversation whose tool messages answer no call: both got through.
    assert len(server.requests) == 2
    await provider.aclose()


ERRORS = [(s.name, kind, e) for s in SERVERS for kind, e in s.errors.items()]


@pytest.mark.parametrize(
    ("server_name", "kind", "error"), ERRORS, ids=[f"{n}-{k}" for n, k, _ in ERRORS]
)
async def test_a_recorded_error_is_typed_with_the_server_message_and_no_key(
    server: FakeOpenAIServer,
    provider: OpenAIProvider,
    server_name: str,
    kind: str,
    error: ErrorShape,
) -> None:
    model = provider.create(ModelSpec(provider="openai", model="m"))
    server.replay(error.body, status=error.status, headers=error.headers)
    with pytest.raises(ModelError) as caught:
        await model.respond(ask())
    failed = caught.value
    assert failed.status == error.status
    assert failed.retryable == (error.status == 429 or error.status >= 500)
    assert error.message in failed.message
    assert "sk-proj-*" not in failed.message and KEY not in failed.message
    if "retry-after" in error.headers:
        assert failed.retry_after == float(error.headers["retry-after"])
    await provider.aclose()


async def test_one_pooled_client_serves_every_model_of_the_provider(
    server: FakeOpenAIServer, provider: OpenAIProvider
) -> None:
    first = provider.create(ModelSpec(provider="openai", model="a"))
    second = provider.create(ModelSpec(provider="openai", model="b"))
    for _ in range(3):
        server.replay(SERVERS[0].final)
    for model in (first, second, first):
        await model.respond(ask())
    # Kept alive: the three calls came over one connection.
    assert len({r.client_port for r in server.requests}) == 1
    assert len(server.requests) == 3
    await provider.aclose()
