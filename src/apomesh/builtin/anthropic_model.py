"""The ``anthropic`` model provider: the Anthropic Messages API (``POST /v1/messages``), with tool
use and streaming.

``[model]`` keys: ``model`` (required), and in ``options``: ``credential`` (one of the worker's
``[providers.anthropic.credentials.<name>]``, default ``default``: ``https://api.anthropic.com/v1``
with the key in ``ANTHROPIC_API_KEY``), ``timeout`` in seconds (default 60), ``max_tokens`` (the
API requires one; default 4096), ``stream`` (``true``: the answer streams and its pieces reach the
session's live readers as it is written), and the request parameters it declares
(``OPTIONS``, its ``ModelProvider.options``: ``temperature``, ``top_p``, ``top_k``,
``stop_sequences`` ...), sent in the request body unchanged; any other key is refused at submit.
Endpoints and keys are the worker's configuration, never the definition's, exactly as for the
``openai`` provider (whose credential checks this one shares): the key goes in ``x-api-key`` to
its own credential's ``base_url`` only, redirects are not followed.

Mapping: the agent's instructions (and for ``purpose="plan"`` the planning instructions) become
``system``; tools become ``{name, description, input_schema}`` with the same reversible name
mapping as ``openai`` (``fs.read`` <-> ``fs__read``); an assistant turn's tool calls become
``tool_use`` blocks with positional ids and the tool messages after it one user message of
``tool_result`` blocks answering them in order (an unanswered call is answered with a note, as the
API requires). Consecutive messages of one role are merged into one. ``text`` blocks of the answer
are its text; ``tool_use`` blocks its tool calls. Usage: ``input_tokens`` (plus cache reads and
writes) is ``prompt_tokens``, ``output_tokens`` is ``completion_tokens``: the same usage fields
as ``openai``'s, so the runtime counts them alike. Errors are built as ``openai``'s are
(``refusal``: the status, the API's short error type such as ``overloaded_error`` and its own
message, scrubbed; ``retry_after`` from ``retry-after``); 429, 5xx and 529 (overloaded) are
retryable, and the runtime, not the provider, tries again. Every model of the provider shares its
pooled client (``AnthropicProvider`` is an ``OpenAIProvider``: the pool, ``aclose``, the
credential checks).

Streaming reads the API's event stream: ``message_start`` (input usage), ``content_block_start``
/ ``content_block_delta`` (``text_delta``, ``input_json_delta``) / ``content_block_stop``,
``message_delta`` (stop reason, output usage), ``message_stop``; ``ping``, ``content_block_stop``
and blocks of other kinds (thinking) are skipped, an ``error`` event is a ``ModelError``, and a stream that ends
before ``message_stop`` is a retryable one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

import msgspec

from apomesh.builtin.openai_model import (
    NO_RESULT,
    PLAN_INSTRUCTIONS,
    Credential,
    OpenAIProvider,
    api_tool_name,
    event_source,
    http_errors,
    model_response,
    read_to_end,
    refusal,
    stream_error,
    tool_name_table,
)
from apomesh.core.definition import ModelSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import (
    ModelDelta,
    ModelError,
    ModelRequest,
    ModelResponse,
    emit_delta,
)

PROVIDER_NAME = "anthropic"
DEFAULT_BASE_URL = "https://api.anthropic.com/v1"
DEFAULT_API_KEY_ENV = "ANTHROPIC_API_KEY"
API_VERSION = "2023-06-01"
"""The ``anthropic-version`` header: the Messages API version this provider speaks."""
DEFAULT_MAX_TOKENS = 4096
OPTIONS: dict[str, str] = {
    "credential": "the worker's configured credential (endpoint and key) to call, default `default`",
    "timeout": "seconds one call may take (between two pieces of a stream), default 60",
    "stream": "true: stream the answer, its pieces shown live on the session's event stream",
    "max_tokens": f"the most tokens one answer may have, default {DEFAULT_MAX_TOKENS}",
    "temperature": "sampling temperature, sent as is",
    "top_p": "nucleus sampling, sent as is",
    "top_k": "top-k sampling, sent as is",
    "stop_sequences": "stop sequences, sent as is",
    "tool_choice": 'sent as is (`{type = "auto"}`, `{type = "any"}`, a tool)',
    "metadata": 'sent as is (`{user_id = "..."}`)',
    "model": "the model, when given in `options` rather than beside `provider`",
    "base_url": "refused: endpoints are the worker's `[providers.anthropic.credentials.<name>]`",
    "api_key_env": "refused: keys are the worker's `[providers.anthropic.credentials.<name>]`",
}
"""Every ``[model]`` option the provider takes."""


def to_api_messages(request: ModelRequest) -> list[dict[str, Any]]:
    """The request's conversation as Messages API messages (content blocks, roles merged)."""
    messages: list[dict[str, Any]] = []
    pending: list[str] = []
    counter = 0

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": blocks})

    def answer_unanswered() -> None:
        add("user", [_tool_result(id_, NO_RESULT) for id_ in pending])
        pending.clear()

    for message in request.messages:
        if message.role != "tool":
            answer_unanswered()
        if message.role in ("system", "user"):
            add("user", _text(message.content))
        elif message.role == "assistant":
            blocks = _text(message.content)
            for call in message.tool_calls:
                counter += 1
                pending.append(f"toolu_{counter}")
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": f"toolu_{counter}",
                        "name": api_tool_name(call.tool),
                        "input": call.args,
                    }
                )
            add("assistant", blocks)
        elif pending:
            add("user", [_tool_result(pending.pop(0), message.content)])
        else:
            label = message.name or "a tool"
            add("user", _text(f"[result of {label}]\n{message.content}"))
    answer_unanswered()
    return messages


def _text(content: str) -> list[dict[str, Any]]:
    # The API refuses an empty text block.
    return [{"type": "text", "text": content}] if content else []


def _tool_result(tool_use_id: str, content: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content or NO_RESULT}


def to_api_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ModelRequest.tools`` entries as Messages API tools."""
    return [
        {
            "name": api_tool_name(str(tool["name"])),
            "description": str(tool.get("description", "")),
            "input_schema": tool.get("parameters") or {"type": "object", "properties": {}},
        }
        for tool in tools
    ]


def usage_counts(usage: Any) -> dict[str, int]:
    """A Messages API ``usage`` object as ``prompt_tokens`` / ``completion_tokens``."""
    usage = usage if isinstance(usage, dict) else {}

    def count(key: str) -> int:
        value = usage.get(key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return int(value) if ok else 0

    prompt = (
        count("input_tokens")
        + count("cache_creation_input_tokens")
        + count("cache_read_input_tokens")
    )
    return {"prompt_tokens": prompt, "completion_tokens": count("output_tokens")}


class AnthropicModel:
    """One configured Messages API model; its calls go through ``client`` (the provider's pooled
    one, shared with every model of the provider)."""

    def __init__(
        self,
        *,
        model: str,
        base_url: str,
        api_key: str | None,
        timeout: float,
        passthrough: dict[str, Any],
        client: Callable[[], httpx.AsyncClient],
        stream: bool = False,
    ) -> None:
        self.model = model
        self.url = base_url.rstrip("/") + "/messages"
        self.api_key = api_key
        self.timeout = timeout
        self.passthrough = passthrough
        self._client = client
        self.stream = stream

    def request_body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS, **self.passthrough}
        body["model"] = self.model
        system = request.instructions
        if request.purpose == "plan":
            system = f"{system}\n\n{PLAN_INSTRUCTIONS}" if system else PLAN_INSTRUCTIONS
        if system:
            body["system"] = system
        body["messages"] = to_api_messages(request)
        if request.tools:
            body["tools"] = to_api_tools(request.tools)
        if self.stream:
            body["stream"] = True
        return body

    def headers(self) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if self.api_key:
            headers["x-api-key"] = self.api_key
        return headers

    async def respond(self, request: ModelRequest) -> ModelResponse:
        names = tool_name_table(request.tools)
        body = self.request_body(request)
        if self.stream:
            return await self._respond_streaming(request, names, body)
        with http_errors(PROVIDER_NAME, self.url, self.timeout):
            # Never follow a redirect: the key goes to this endpoint and nowhere else.
            reply = await self._client().post(
                self.url,
                json=body,
                headers=self.headers(),
                timeout=self.timeout,
                follow_redirects=False,
            )
        if reply.status_code >= 300:
            raise refusal(reply, PROVIDER_NAME, secret=self.api_key)
        try:
            data = reply.json()
            blocks = data["content"]
            if not isinstance(blocks, list):
                raise TypeError("content is not a list")
            message = MessageStream(names, secret=self.api_key)
            for index, block in enumerate(blocks):
                message.start_block(index, block)
            message.usage.update(data.get("usage") or {})
            message.stopped = True
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(
                f"unexpected response shape ({type(exc).__name__}: {exc})", provider=PROVIDER_NAME
            ) from None
        return message.response(request)

    async def _respond_streaming(
        self, request: ModelRequest, names: dict[str, str], body: dict[str, Any]
    ) -> ModelResponse:
        message = MessageStream(names, secret=self.api_key)
        await emit_delta(ModelDelta("start"))
        with http_errors(PROVIDER_NAME, self.url, self.timeout):
            async with self._client().stream(
                "POST",
                self.url,
                json=body,
                headers=self.headers(),
                timeout=self.timeout,
                follow_redirects=False,
            ) as reply:
                if reply.status_code >= 300:
                    await reply.aread()
                    raise refusal(reply, PROVIDER_NAME, secret=self.api_key)
                events = event_source(reply)
                async for event in events:
                    for delta in message.feed(event.event, event.data):
                        await emit_delta(delta)
                    if message.stopped:
                        break
                await read_to_end(events)
        return message.response(request)


class MessageStream(msgspec.Struct):
    """One Messages API answer being assembled: from its stream's events (``feed``) or, for a
    whole response, from its content blocks (``start_block``)."""

    names: dict[str, str]
    secret: str | None = None
    text: list[str] = msgspec.field(default_factory=list)
    calls: list[dict[str, Any]] = msgspec.field(default_factory=list)
    blocks: dict[int, dict[str, Any]] = msgspec.field(default_factory=dict)
    usage: dict[str, Any] = msgspec.field(default_factory=dict)
    stopped: bool = False

    def feed(self, event: str, data: str) -> list[ModelDelta]:
        """Take one event of the stream; the deltas it adds."""
        if event == "ping":
            return []
        try:
            payload = json.loads(data)
        except ValueError:
            raise ModelError(
                f"the event stream carried a {event!r} event that is not JSON",
                provider=PROVIDER_NAME,
            ) from None
        if not isinstance(payload, dict):
            raise ModelError(
                "the event stream carried an event that is not an object", provider=PROVIDER_NAME
            )
        kind = payload.get("type", event)
        if kind == "error":
            raise stream_error(payload.get("error"), PROVIDER_NAME, self.secret)
        if kind == "message_start":
            start = payload.get("message")
            if isinstance(start, dict) and isinstance(start.get("usage"), dict):
                self.usage.update(start["usage"])
        elif kind == "content_block_start":
            return self.start_block(payload.get("index"), payload.get("content_block"))
        elif kind == "content_block_delta":
            return self._delta(payload.get("index"), payload.get("delta"))
        elif kind == "message_delta":
            if isinstance(payload.get("usage"), dict):
                self.usage.update(payload["usage"])
        elif kind == "message_stop":
            self.stopped = True
        return []

    def start_block(self, index: Any, block: Any) -> list[ModelDelta]:
        """A content block begins (a whole response's blocks are begun complete)."""
        if not isinstance(block, dict) or not isinstance(index, int):
            raise ModelError("a content block without an index or body", provider=PROVIDER_NAME)
        kind = block.get("type")
        if kind == "text":
            text = str(block.get("text") or "")
            self.blocks[index] = {"type": "text"}
            return self._text(text)
        if kind == "tool_use":
            api_name = str(block.get("name") or "")
            number = len(self.calls)
            call = {"name": api_name, "input": block.get("input"), "json": "", "number": number}
            self.calls.append(call)
            self.blocks[index] = {"type": "tool_use", "call": call}
            tool = self.names.get(api_name, api_name.replace("__", "."))
            return [ModelDelta("tool_call", call=number, tool=tool)]
        self.blocks[index] = {"type": "other"}
        return []

    def _text(self, text: str) -> list[ModelDelta]:
        if not text:
            return []
        self.text.append(text)
        return [ModelDelta("text", text=text)]

    def _delta(self, index: Any, delta: Any) -> list[ModelDelta]:
        block = self.blocks.get(index) if isinstance(index, int) else None
        if block is None or not isinstance(delta, dict):
            raise ModelError("a delta for a content block that never began", provider=PROVIDER_NAME)
        if block["type"] == "text" and delta.get("type") == "text_delta":
            return self._text(str(delta.get("text") or ""))
        if block["type"] == "tool_use" and delta.get("type") == "input_json_delta":
            fragment = str(delta.get("partial_json") or "")
            call = block["call"]
            call["json"] += fragment
            return (
                [ModelDelta("tool_call", call=call["number"], arguments=fragment)]
                if fragment
                else []
            )
        return []

    def response(self, request: ModelRequest) -> ModelResponse:
        """The assembled answer; a ``ModelError`` when its stream ended before ``message_stop``."""
        if not self.stopped:
            raise ModelError(
                "the event stream ended before the answer was complete",
                provider=PROVIDER_NAME,
                retryable=True,
            )
        raw_calls = [
            {"function": {"name": call["name"], "arguments": call["json"] or call["input"] or {}}}
            for call in self.calls
        ]
        return model_response(
            request, self.names, "".join(self.text), raw_calls, usage_counts(self.usage)
        )


class AnthropicProvider(OpenAIProvider):
    """The ``anthropic`` provider: named credentials exactly as ``openai`` has them (checked the
    same way), the same pooled client and ``create`` (building an ``AnthropicModel``), calling
    the Messages API."""

    name: str = PROVIDER_NAME
    options: Mapping[str, str] = OPTIONS
    model_class = AnthropicModel

    def check(self, spec: ModelSpec, where: str = "[model]") -> Credential:
        credential = super().check(spec, where)
        max_tokens = dict(spec.options).get("max_tokens", DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise DefinitionError(
                "`max_tokens` must be a positive whole number", where=f"{where}.max_tokens"
            )
        return credential
