"""The ``openai`` model provider: any OpenAI-compatible chat-completions endpoint, with tool calling.

``[model]`` keys: ``model`` (required), and in ``options``: ``credential`` (the name of one of the
worker's configured credentials, default ``default``), ``timeout`` in seconds (default 60). Every
other option (``temperature``, ``top_p``, ``max_tokens``, ``seed`` ...) is passed through in the
request body unchanged.

Where a call goes and which key it carries is the worker's choice, never the definition's: the
provider is built with named ``Credential`` objects (``[providers.openai.credentials.<name>]`` in the
worker's config: an endpoint ``base_url`` and the environment variable ``api_key_env`` holding its
key), and a definition can only name one. A definition giving ``base_url`` or ``api_key_env``
itself, or naming a credential the worker does not have, is refused with a ``DefinitionError``
naming the key (``check`` is what the daemon runs when a session is created, and ``create`` runs it
again on the worker). The key goes only to its credential's own ``base_url``; redirects are not
followed; no ``Authorization`` header is sent when the variable is unset (local servers).

Mapping: the agent's instructions become the system message; tool names are mapped to the API's
allowed characters reversibly (``fs.read`` <-> ``fs__read``); tool-result messages answer the
preceding assistant message's calls in order (ids are assigned here, positionally, because the
conversation stores calls without ids). For ``purpose="plan"`` the system message asks for a JSON
array of sub-tasks, and an answer that parses as one becomes ``plan``; any other answer without
tool calls is ``final``. ``usage.total_tokens`` is reported as ``tokens``. HTTP errors and an
unreachable endpoint raise ``ModelError`` with the status and, at most, the API's short error code
(``rate_limit_exceeded``): the body of an error answer is never copied into the message, which ends
up on the session's log.

With ``stream = true`` the call asks for an event stream (and the usage in its last chunk,
``stream_options.include_usage``): ``respond_streaming`` hands every piece of text and of a tool
call to ``emit_delta`` as it arrives and assembles the same ``ModelResponse`` (``ChatStream``,
which reads the chunk shapes of OpenAI, vLLM, Ollama and llama.cpp server alike).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx_sse

from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import (
    Message,
    Model,
    ModelDelta,
    ModelError,
    ModelRequest,
    ModelResponse,
    emit_delta,
)

PROVIDER_NAME = "openai"
DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_CREDENTIAL = "default"
DEFAULT_TIMEOUT = 60.0
OWN_OPTIONS = frozenset({"credential", "timeout", "model", "stream"})
WORKER_ONLY_OPTIONS = ("base_url", "api_key_env")
"""Options a definition may not give: they are the worker's configured credentials."""
RESERVED_ENV_PREFIX = "APOMESH_"
"""apomesh's own secrets (API and NATS credentials) live in these variables: never a model key."""

_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Credential:
    """One endpoint a worker may call and the environment variable holding its key."""

    base_url: str
    api_key_env: str = ""


def check_credential(name: str, credential: Credential, provider: str = PROVIDER_NAME) -> None:
    """Refuse a credential that is not an http(s) endpoint or whose key is apomesh's own secret."""
    where = f"[providers.{provider}.credentials.{name}]"
    if not credential.base_url.startswith(("http://", "https://")):
        raise DefinitionError(
            f"`base_url` {credential.base_url!r} is not an http(s) URL", where=where
        )
    if credential.api_key_env.upper().startswith(RESERVED_ENV_PREFIX):
        raise DefinitionError(
            f"`api_key_env` {credential.api_key_env!r} is one of apomesh's own variables"
            f" ({RESERVED_ENV_PREFIX}*), never a model key",
            where=where,
        )


PLAN_INSTRUCTIONS = (
    "Plan the work before doing it. Answer with only a JSON array of strings, one "
    'self-contained sub-task per item (for example ["first sub-task", "second sub-task"]), '
    "and nothing else. If the goal needs no sub-tasks, answer it directly instead."
)

NO_RESULT = "(no result was recorded for this call)"

_DISALLOWED = re.compile(r"[^A-Za-z0-9_-]")
_FENCE = re.compile(r"^```[A-Za-z]*\s*|\s*```$")


def api_tool_name(name: str) -> str:
    """``name`` in the API's function-name charset: dots become ``__``, other characters ``_``."""
    return _DISALLOWED.sub("_", name.replace(".", "__"))[:64]


def tool_name_table(tools: list[dict[str, Any]]) -> dict[str, str]:
    """API name -> tool name for the tools of one request; refuses two tools sharing an API name."""
    table: dict[str, str] = {}
    for tool in tools:
        name = str(tool["name"])
        mapped = api_tool_name(name)
        if mapped in table and table[mapped] != name:
            raise DefinitionError(
                f"tools {table[mapped]!r} and {name!r} map to the same API name {mapped!r}",
                where="openai model",
            )
        table[mapped] = name
    return table


def parse_plan(content: str) -> list[str] | None:
    """The sub-tasks of a planning answer (a JSON array of strings), or None if it is not one."""
    text = _FENCE.sub("", content.strip())
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end <= start:
        return None
    try:
        items = json.loads(text[start : end + 1])
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    if not all(isinstance(item, str) and item.strip() for item in items):
        return None
    return [item.strip() for item in items]


def to_api_messages(request: ModelRequest) -> list[dict[str, Any]]:
    """The request's conversation as chat-completions messages."""
    system = request.instructions
    if request.purpose == "plan":
        system = f"{system}\n\n{PLAN_INSTRUCTIONS}" if system else PLAN_INSTRUCTIONS
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    pending: list[str] = []
    counter = 0

    def answer_unanswered() -> None:
        # The API refuses an assistant tool call that no tool message answers.
        messages.extend(
            {"role": "tool", "tool_call_id": id_, "content": NO_RESULT} for id_ in pending
        )
        pending.clear()

    for message in request.messages:
        if message.role != "tool":
            answer_unanswered()
        if message.role in ("system", "user"):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant_message(message, counter))
            for _ in message.tool_calls:
                counter += 1
                pending.append(f"call_{counter}")
        elif pending:
            messages.append(
                {"role": "tool", "tool_call_id": pending.pop(0), "content": message.content}
            )
        else:
            label = message.name or "a tool"
            messages.append({"role": "user", "content": f"[result of {label}]\n{message.content}"})
    answer_unanswered()
    return messages


def _assistant_message(message: Message, counter: int) -> dict[str, Any]:
    if not message.tool_calls:
        return {"role": "assistant", "content": message.content}
    calls = [
        {
            "id": f"call_{counter + i + 1}",
            "type": "function",
            "function": {
                "name": api_tool_name(call.tool),
                "arguments": json.dumps(call.args, sort_keys=True),
            },
        }
        for i, call in enumerate(message.tool_calls)
    ]
    return {"role": "assistant", "content": message.content or None, "tool_calls": calls}


def to_api_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ModelRequest.tools`` entries (see ``describe_tool``) as chat-completions functions."""
    return [
        {
            "type": "function",
            "function": {
                "name": api_tool_name(str(tool["name"])),
                "description": str(tool.get("description", "")),
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for tool in tools
    ]


class OpenAIModel:
    """One configured chat-completions model."""

    def __init__(
        self,
        *,
        model: str,
        base_url: str,
        api_key: str | None,
        timeout: float,
        passthrough: dict[str, Any],
        stream: bool = False,
    ) -> None:
        self.model = model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.timeout = timeout
        self.passthrough = passthrough
        self.stream = stream

    def request_body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {**self.passthrough, "model": self.model}
        body["messages"] = to_api_messages(request)
        if request.tools:
            body["tools"] = to_api_tools(request.tools)
        return body

    async def respond(self, request: ModelRequest) -> ModelResponse:
        names = tool_name_table(request.tools)
        body = self.request_body(request)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.stream:
            return await respond_streaming(self, request, names, body, headers)
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                # Never follow a redirect: the key goes to this endpoint and nowhere else.
                reply = await client.post(
                    self.url, json=body, headers=headers, follow_redirects=False
                )
        except httpx.TimeoutException:
            raise ModelError(
                f"no answer from {self.url} within {self.timeout:g} s",
                provider=PROVIDER_NAME,
                retryable=True,
            ) from None
        except httpx.HTTPError as exc:
            raise ModelError(
                f"cannot reach {self.url}: {type(exc).__name__}: {exc}",
                provider=PROVIDER_NAME,
                retryable=True,
            ) from None
        if reply.status_code >= 300:
            raise ModelError(
                _error_message(reply), provider=PROVIDER_NAME, status=reply.status_code
            )
        try:
            data = reply.json()
            message = data["choices"][0]["message"]
            content = message.get("content") or ""
            raw_calls = message.get("tool_calls") or []
            usage = data.get("usage") or {}
            tokens = int(usage.get("total_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ModelError(
                f"unexpected response shape ({type(exc).__name__}: {exc})", provider=PROVIDER_NAME
            ) from None
        memory = dict(request.memory)
        if raw_calls:
            calls = [_tool_call(raw, names) for raw in raw_calls]
            return ModelResponse(text=content, tool_calls=calls, tokens=tokens, memory=memory)
        if request.purpose == "plan":
            plan = parse_plan(content)
            if plan is not None:
                return ModelResponse(text=content, plan=plan, tokens=tokens, memory=memory)
        return ModelResponse(text=content, final=content, tokens=tokens, memory=memory)


def _tool_call(raw: Any, names: dict[str, str]) -> ToolCallSpec:
    try:
        function = raw["function"]
        api_name = str(function["name"])
        arguments = function.get("arguments") or "{}"
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(
            f"the model returned a malformed tool call ({type(exc).__name__}: {exc})",
            provider=PROVIDER_NAME,
        ) from None
    if not isinstance(args, dict):
        raise ModelError(
            f"the model called {api_name!r} with arguments that are not a JSON object",
            provider=PROVIDER_NAME,
        )
    return ToolCallSpec(tool=names.get(api_name, api_name.replace("__", ".")), args=args)


def _error_message(reply: httpx.Response) -> str:
    """The status and, when the API gives one, its short error code: never the body, which a
    hostile or confused endpoint could fill with anything (the message lands on the log)."""
    code = None
    try:
        data = reply.json()
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        for key in ("code", "type"):
            value = error.get(key)
            if isinstance(value, str) and _ERROR_CODE.match(value):
                code = value
                break
    text = f"the endpoint answered {reply.status_code}"
    return f"{text} ({code})" if code else text


class OpenAIProvider:
    """The ``openai`` provider: ``credentials`` are the endpoints this process may call, by name
    (none until ``use_credentials`` is called); ``environ`` (default ``os.environ``) is where their
    keys are read."""

    name: str = PROVIDER_NAME

    def __init__(
        self,
        credentials: Mapping[str, Credential] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._environ = environ
        self.credentials: dict[str, Credential] = {}
        self.use_credentials(credentials or {})

    def use_credentials(self, credentials: Mapping[str, Credential]) -> None:
        """Replace the configured credentials (each is checked first)."""
        for name, credential in credentials.items():
            check_credential(name, credential, self.name)
        self.credentials = dict(credentials)

    def check(self, spec: ModelSpec, where: str = "[model]") -> Credential:
        """The credential ``spec`` names; a ``DefinitionError`` naming the key when the definition
        sets an endpoint or key itself, names an unknown credential or a bad option."""
        options = dict(spec.options)
        model = spec.model or options.get("model")
        if not isinstance(model, str) or not model:
            raise DefinitionError(f"the {self.name} provider needs `model`", where=where)
        for key in WORKER_ONLY_OPTIONS:
            if key in options:
                raise DefinitionError(
                    f"`{key}` is not set by a definition: the worker's config holds endpoints and"
                    f" keys ([providers.{self.name}.credentials.<name>]); name one with"
                    " `credential`",
                    where=f"{where}.{key}",
                )
        name = options.get("credential", DEFAULT_CREDENTIAL)
        if not isinstance(name, str) or name not in self.credentials:
            known = ", ".join(sorted(self.credentials)) or "none"
            raise DefinitionError(
                f"unknown credential {name!r}; configured: {known}", where=f"{where}.credential"
            )
        timeout = options.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise DefinitionError(
                "`timeout` must be a positive number of seconds", where=f"{where}.timeout"
            )
        check_stream_option(options, where)
        return self.credentials[name]

    def create(self, spec: ModelSpec) -> Model:
        credential = self.check(spec)
        options = dict(spec.options)
        environ = os.environ if self._environ is None else self._environ
        key = environ.get(credential.api_key_env) if credential.api_key_env else None
        return OpenAIModel(
            model=str(spec.model or options.get("model")),
            base_url=credential.base_url,
            api_key=key or None,
            timeout=float(options.get("timeout", DEFAULT_TIMEOUT)),
            passthrough={k: v for k, v in options.items() if k not in OWN_OPTIONS},
            stream=options.get("stream", False) is True,
        )


# --------------------------------------------------------------------------------------------
# Streaming: the chunks of a ``stream: true`` answer


def check_stream_option(options: Mapping[str, Any], where: str) -> None:
    """``stream``, when given, is ``true`` or ``false``."""
    if "stream" in options and not isinstance(options["stream"], bool):
        raise DefinitionError("`stream` must be true or false", where=f"{where}.stream")


@contextlib.contextmanager
def http_errors(provider: str, url: str, timeout: float) -> Iterator[None]:
    """Transport failures of a call to ``url`` as retryable ``ModelError``s."""
    try:
        yield
    except httpx.TimeoutException:
        raise ModelError(
            f"no answer from {url} within {timeout:g} s", provider=provider, retryable=True
        ) from None
    except httpx_sse.SSEError:
        raise ModelError(
            f"{url} did not answer with an event stream", provider=provider, retryable=False
        ) from None
    except httpx.HTTPError as exc:
        raise ModelError(
            f"cannot reach {url}: {type(exc).__name__}: {exc}", provider=provider, retryable=True
        ) from None


def stream_error(error: Any, provider: str) -> ModelError:
    """The ``ModelError`` for an error an endpoint sent inside an event stream (after its
    ``200``): its short code or type only, never its message; retryable when it names a server
    error, an overload or a rate limit."""
    status = None
    code = None
    if isinstance(error, dict):
        raw_status = error.get("code", error.get("status"))
        if isinstance(raw_status, int) and not isinstance(raw_status, bool):
            status = raw_status
        for key in ("code", "type"):
            value = error.get(key)
            if isinstance(value, str) and _ERROR_CODE.match(value):
                code = value
                break
    retryable = (status is not None and (status == 429 or status >= 500)) or (
        code is not None
        and any(
            word in code.lower() for word in ("overloaded", "rate_limit", "server", "api_error")
        )
    )
    text = "the endpoint sent an error in its event stream"
    return ModelError(
        f"{text} ({code})" if code else text, provider=provider, status=status, retryable=retryable
    )


@dataclass
class ChatStream:
    """One streamed chat completion being assembled from its chunks (``feed``, in order).

    Text arrives as ``delta.content`` pieces; a tool call as ``delta.tool_calls`` entries keyed by
    their ``index`` (its ``id`` and name on the first, the JSON ``arguments`` in fragments after,
    or whole in one entry as Ollama sends them); usage in the last chunk (``choices`` empty, or
    beside the ``finish_reason`` as llama.cpp server sends it). An ``error`` object in a chunk (vLLM,
    Ollama, llama.cpp server) is a ``ModelError``; a stream that stops before any
    ``finish_reason`` is one too (retryable: the answer was cut off)."""

    names: dict[str, str]
    content: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    def feed(self, data: str) -> list[ModelDelta]:
        """Take one chunk (an event's ``data``); the deltas it adds."""
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ModelError(
                "the event stream carried a chunk that is not JSON", provider=PROVIDER_NAME
            ) from None
        if not isinstance(chunk, dict):
            raise ModelError(
                "the event stream carried a chunk that is not an object", provider=PROVIDER_NAME
            )
        if "error" in chunk or chunk.get("object") == "error":
            raise stream_error(chunk.get("error", chunk), PROVIDER_NAME)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        deltas: list[ModelDelta] = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finished = True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                deltas += self._delta(delta)
        return deltas

    def _delta(self, delta: dict[str, Any]) -> list[ModelDelta]:
        out: list[ModelDelta] = []
        text = delta.get("content")
        if isinstance(text, str) and text:
            self.content.append(text)
            out.append(ModelDelta("text", text=text))
        for position, raw in enumerate(delta.get("tool_calls") or []):
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", position)
            if not isinstance(index, int):
                index = position
            call = self.calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            function: dict[str, Any] = (
                raw["function"] if isinstance(raw.get("function"), dict) else {}
            )
            first = not call["name"]
            if isinstance(raw.get("id"), str):
                call["id"] = raw["id"]
            if isinstance(function.get("name"), str):
                call["name"] += function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, dict):
                arguments = json.dumps(arguments)
            fragment = arguments if isinstance(arguments, str) else ""
            call["arguments"] += fragment
            if (first and call["name"]) or fragment:
                api_name = call["name"]
                out.append(
                    ModelDelta(
                        "tool_call",
                        call=sorted(self.calls).index(index),
                        tool=self.names.get(api_name, api_name.replace("__", ".")) if first else "",
                        arguments=fragment,
                    )
                )
        return out

    def result(self) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """The assembled text, tool calls (in the non-streaming ``message.tool_calls`` shape) and
        usage; a ``ModelError`` when the stream ended before the answer did."""
        if not self.finished:
            raise ModelError(
                "the event stream ended before the answer was complete",
                provider=PROVIDER_NAME,
                retryable=True,
            )
        calls = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"] or "{}"},
            }
            for _, call in sorted(self.calls.items())
        ]
        return "".join(self.content), calls, self.usage


async def respond_streaming(
    model: OpenAIModel,
    request: ModelRequest,
    names: dict[str, str],
    body: dict[str, Any],
    headers: dict[str, str],
) -> ModelResponse:
    """``model``'s call with ``stream: true``: each chunk's text and tool-call fragments go out
    as ``ModelDelta``s while the answer is assembled (``ChatStream``)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    stream = ChatStream(names)
    await emit_delta(ModelDelta("start"))
    with http_errors(PROVIDER_NAME, model.url, model.timeout):
        async with (
            httpx.AsyncClient(timeout=model.timeout) as client,
            client.stream(
                "POST", model.url, json=body, headers=headers, follow_redirects=False
            ) as reply,
        ):
            if reply.status_code >= 300:
                await reply.aread()
                raise ModelError(
                    _error_message(reply), provider=PROVIDER_NAME, status=reply.status_code
                )
            async for event in httpx_sse.EventSource(reply).aiter_sse():
                if event.data.strip() == "[DONE]":
                    break
                for delta in stream.feed(event.data):
                    await emit_delta(delta)
    content, raw_calls, usage = stream.result()
    return model_response(request, names, content, raw_calls, usage)


def model_response(
    request: ModelRequest,
    names: dict[str, str],
    content: str,
    raw_calls: list[Any],
    usage: Any,
) -> ModelResponse:
    """The ``ModelResponse`` of a completed answer (a whole response or an assembled stream):
    tool calls, else a plan (for ``purpose="plan"``) or a final answer; with its token usage."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    tokens = _count(usage.get("total_tokens")) or prompt + completion
    calls = [_tool_call(raw, names) for raw in raw_calls]
    plan = parse_plan(content) if not calls and request.purpose == "plan" else None
    return ModelResponse(
        text=content,
        tool_calls=calls,
        plan=plan,
        final=content if not calls and plan is None else None,
        tokens=tokens,
        prompt_tokens=prompt,
        completion_tokens=completion,
        memory=dict(request.memory),
    )


def _count(value: Any) -> int:
    """A token count from a usage object (absent, null or nonsense counts as 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return 0
    return int(value)
