"""The ``openai`` provider against a local server speaking the chat-completions protocol."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from tests.fakes.openai_server import FakeOpenAIServer

from apomesh.builtin.openai_model import PLAN_INSTRUCTIONS, Credential, OpenAIProvider
from apomesh.builtin.tools import BUILTIN_TOOLS
from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.core.errors import ApomeshError, DefinitionError
from apomesh.plugins.api import Message, Model, ModelError, ModelRequest, describe_tool

pytestmark = pytest.mark.anyio

TOOLS = [describe_tool(t) for t in BUILTIN_TOOLS if t.name in ("fs.read", "fs.append")]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def make_model(base_url: str, **options: Any) -> Model:
    # The worker's configuration names the endpoint and its key; the definition names the credential.
    provider = OpenAIProvider(
        credentials={"test": Credential(base_url=base_url, api_key_env="TEST_KEY")},
        environ={"TEST_KEY": "sk-test"},
    )
    spec = ModelSpec(provider="openai", model="gpt-test", options={"credential": "test", **options})
    return provider.create(spec)


def request(messages: list[Message], purpose: str = "act") -> ModelRequest:
    return ModelRequest(
        instructions="You keep a log.",
        messages=messages,
        tools=TOOLS,
        memory={"kept": 1},
        purpose=purpose,
    )


async def test_tool_call_round_trip_then_final_answer(server: FakeOpenAIServer) -> None:
    model = make_model(server.base_url, temperature=0.2)
    server.reply(tool_calls=[("fs__append", {"path": "log.txt", "line": "hello"})], total_tokens=30)
    server.reply("logged it", total_tokens=12)

    user = Message(role="user", content="log hello")
    first = await model.respond(request([user]))

    assert first.tool_calls == [ToolCallSpec("fs.append", {"path": "log.txt", "line": "hello"})]
    assert first.final is None
    assert first.tokens == 30
    assert first.memory == {"kept": 1}

    sent = server.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["Authorization"] == "Bearer sk-test"
    assert sent.body["model"] == "gpt-test"
    assert sent.body["temperature"] == 0.2
    assert sent.body["messages"][0] == {"role": "system", "content": "You keep a log."}
    assert {t["function"]["name"] for t in sent.body["tools"]} == {"fs__read", "fs__append"}

    conversation = [
        user,
        Message(role="assistant", tool_calls=first.tool_calls),
        Message(role="tool", content="appended 1 line to log.txt", name="fs.append"),
    ]
    second = await model.respond(request(conversation))

    assert second.final == "logged it"
    assert second.tool_calls == []
    assert second.tokens == 12
    messages = server.requests[1].body["messages"]
    call = messages[2]["tool_calls"][0]
    assert call["function"]["name"] == "fs__append"
    assert messages[3] == {
        "role": "tool",
        "tool_call_id": call["id"],
        "content": "appended 1 line to log.txt",
    }


async def test_an_unanswered_tool_call_is_closed_so_the_api_accepts_the_conversation(
    server: FakeOpenAIServer,
) -> None:
    model = make_model(server.base_url)
    server.reply("ok")
    conversation = [
        Message(role="user", content="go"),
        Message(
            role="assistant",
            tool_calls=[
                ToolCallSpec("fs.read", {"path": "a"}),
                ToolCallSpec("fs.read", {"path": "b"}),
            ],
        ),
        Message(role="tool", content="A"),
        Message(role="user", content="and now?"),
    ]
    answer = await model.respond(request(conversation))
    assert answer.final == "ok"
    roles = [m["role"] for m in server.requests[0].body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]


async def test_planning_answer_becomes_a_plan(server: FakeOpenAIServer) -> None:
    model = make_model(server.base_url)
    server.reply('```json\n["write the intro", "write the summary"]\n```', total_tokens=5)

    answer = await model.respond(request([Message(role="user", content="a report")], "plan"))

    assert answer.plan == ["write the intro", "write the summary"]
    assert answer.final is None
    assert PLAN_INSTRUCTIONS in server.requests[0].body["messages"][0]["content"]


async def test_a_planning_answer_that_is_not_a_list_is_a_final_answer(
    server: FakeOpenAIServer,
) -> None:
    model = make_model(server.base_url)
    server.reply("Nothing to split: the answer is 42.")
    answer = await model.respond(request([Message(role="user", content="q")], "plan"))
    assert answer.plan is None
    assert answer.final == "Nothing to split: the answer is 42."


async def test_http_500_is_a_typed_retryable_error(server: FakeOpenAIServer) -> None:
    model = make_model(server.base_url)
    server.fail(500, "the model is overloaded")

    with pytest.raises(ModelError) as caught:
        await model.respond(request([Message(role="user", content="hi")]))

    assert isinstance(caught.value, ApomeshError)
    assert caught.value.status == 500
    assert caught.value.retryable
    assert "500" in caught.value.message and "server_error" in caught.value.message
    # The provider's own message is kept: it says what went wrong.
    assert caught.value.message.endswith("the model is overloaded")


async def test_the_provider_message_is_kept_short_and_scrubbed_of_keys(
    server: FakeOpenAIServer,
) -> None:
    model = make_model(server.base_url)
    leaky = (
        "Incorrect API key provided: sk-test. You passed sk-proj-abcdefgh1234****WXYZ and"
        " header Bearer abc.def.ghi\x1b[31m" + " and more" * 100
    )
    server.fail(401, leaky, kind="invalid_request_error")
    with pytest.raises(ModelError) as caught:
        await model.respond(request([Message(role="user", content="hi")]))
    message = caught.value.message
    assert "Incorrect API key provided" in message
    for secret in ("sk-test", "sk-proj", "abcdefgh1234", "abc.def.ghi", "\x1b"):
        assert secret not in message
    assert len(message) < 400


async def test_http_401_is_not_retryable(server: FakeOpenAIServer) -> None:
    model = make_model(server.base_url)
    server.fail(401, "Incorrect API key provided", kind="invalid_request_error")
    with pytest.raises(ModelError) as caught:
        await model.respond(request([Message(role="user", content="hi")]))
    assert caught.value.status == 401
    assert not caught.value.retryable


async def test_an_unreachable_endpoint_is_a_retryable_error_without_status() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = make_model(f"http://127.0.0.1:{port}/v1")
    with pytest.raises(ModelError) as caught:
        await model.respond(request([Message(role="user", content="hi")]))
    assert caught.value.status is None
    assert caught.value.retryable


async def test_no_authorization_header_without_a_key(server: FakeOpenAIServer) -> None:
    provider = OpenAIProvider(
        credentials={"default": Credential(base_url=server.base_url)}, environ={}
    )
    model = provider.create(ModelSpec(provider="openai", model="local"))
    server.reply("hi")
    await model.respond(request([Message(role="user", content="hi")]))
    assert "Authorization" not in server.requests[0].headers


def test_a_definition_cannot_choose_the_endpoint_or_the_key(server: FakeOpenAIServer) -> None:
    provider = OpenAIProvider(
        credentials={"test": Credential(base_url=server.base_url, api_key_env="TEST_KEY")},
        environ={"TEST_KEY": "sk-test", "APOMESH_HTTP_TOKEN": "secret"},
    )
    for options, key in (
        ({"base_url": server.base_url}, "base_url"),
        ({"credential": "test", "api_key_env": "APOMESH_HTTP_TOKEN"}, "api_key_env"),
        ({"credential": "elsewhere"}, "credential"),
        ({}, "credential"),  # no "default" credential is configured here
    ):
        with pytest.raises(DefinitionError) as caught:
            provider.create(ModelSpec(provider="openai", model="m", options=options))
        assert caught.value.where == f"[model].{key}"
    assert server.requests == []


def test_a_credential_may_not_carry_an_apomesh_secret() -> None:
    with pytest.raises(DefinitionError) as caught:
        OpenAIProvider(
            credentials={
                "x": Credential(base_url="http://127.0.0.1:1/v1", api_key_env="APOMESH_HTTP_TOKEN")
            }
        )
    assert "APOMESH_HTTP_TOKEN" in caught.value.message


async def test_a_redirect_is_not_followed_with_the_key() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    with FakeOpenAIServer() as capture:
        target = capture.base_url

        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.send_response(307)
                self.send_header("Location", f"{target}/chat/completions")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        redirector = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
        thread = threading.Thread(target=redirector.serve_forever, daemon=True)
        thread.start()
        try:
            model = make_model(f"http://127.0.0.1:{redirector.server_address[1]}/v1")
            capture.reply("should never be asked")
            with pytest.raises(ModelError) as caught:
                await model.respond(request([Message(role="user", content="hi")]))
            assert caught.value.status == 307
        finally:
            redirector.shutdown()
            redirector.server_close()
        assert capture.requests == []


def test_retry_after_is_read_as_seconds_milliseconds_or_a_date() -> None:
    import email.utils
    import time

    import httpx

    from apomesh.builtin.openai_model import retry_after

    assert retry_after(httpx.Headers({"retry-after": "2"})) == 2.0
    assert retry_after(httpx.Headers({"retry-after": "0.5"})) == 0.5
    assert retry_after(httpx.Headers({"retry-after-ms": "1500", "retry-after": "9"})) == 1.5
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= (retry_after(httpx.Headers({"retry-after": later})) or 0) <= 31
    assert retry_after(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_after(httpx.Headers({})) is None
