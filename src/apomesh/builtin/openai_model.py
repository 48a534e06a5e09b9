"""The ``openai`` model provider: any OpenAI-compatible chat-completions endpoint, with tool calling.

``[model]`` keys: ``model`` (required), and the options the provider declares (``OPTIONS``, its
``ModelProvider.options``: any other key is refused at submit): ``credential`` (the name of one
of the worker's configured credentials, default ``default``), ``timeout`` in seconds (default
60), ``extra_body`` (a table merged into the request body, for a server's own parameters), and
the request parameters sent as given (``temperature``, ``top_p``, ``max_tokens``, ``seed`` ...).

Where a call goes and which key it carries is the worker's choice, never the definition's: the
provider is built with named ``Credential`` objects (``[providers.openai.credentials.<name>]`` in the
worker's config: an endpoint ``base_url`` and the environment variable ``api_key_env`` holding its
key), and a definition can only name one. A definition giving ``base_url`` or ``api_key_env``
itself, or naming a credential the worker does not have, is refused with a ``DefinitionError``
naming the key (``check`` is what the daemon runs when a session is created, and ``create`` runs it
again on the worker). The key goes only to its credential's own ``base_url``; redirects are not
followed; no ``Authorization`` header is sent when the variable is unset (local servers). Every
model of one provider shares one pooled ``httpx.AsyncClient`` (kept-alive connections), closed by
``aclose`` when the worker stops.

Mapping: the agent's instructions become the system message; tool names are mapped to the API's
allowed characters reversibly (``fs.read`` <-> ``fs__read``); tool-result messages answer the
preceding assistant message's calls in order (ids are assigned here, positionally, because the
conversation stores calls without ids). For ``purpose="plan"`` the system message asks for a JSON
array of sub-tasks, and an answer that parses as one becomes ``plan``; any other answer without
tool calls is ``final``. ``usage`` gives ``prompt_tokens``, ``completion_tokens`` and ``tokens``
(``total_tokens``, else their sum). Answers are read as OpenAI, vLLM, Ollama and llama.cpp server
write them (``content`` null, ``""`` or text parts; arguments as a JSON string or an object).
HTTP errors and an unreachable endpoint raise ``ModelError`` (retryable for 429, 5xx, timeouts and
connection errors; ``retry_after`` from ``Retry-After``) with the status, the API's short error
code (``rate_limit_exceeded``) and its own message, made fit for the log by ``scrub`` (one short
printable line, anything shaped like a key replaced): the runtime, not the provider, tries again.

With ``stream = true`` the call asks for an event stream (and the usage in its last chunk,
``stream_options.include_usage``) on the same pooled client: ``respond_streaming`` hands every
piece of text and of a tool call to ``emit_delta`` as it arrives and assembles the same
``ModelResponse`` (``ChatStream``, which reads the chunk shapes of OpenAI, vLLM, Ollama and
llama.cpp server alike; ``model_response`` builds the answer of both paths). A refusal before the
stream starts is the same ``ModelError`` as without streaming; an error inside the stream
(``stream_error``) and a stream cut off before its end are ``ModelError``s too, the latter
retryable, so the runtime's retries cover streamed calls alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

import msgspec

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
"""Options the provider reads itself (both providers): never sent in the request body."""
OPTIONS: dict[str, str] = {
    "credential": "the worker's configured credential (endpoint and key) to call, default `default`",
    "timeout": "seconds one call may take before it is abandoned (and tried again), default 60",
    "stream": "true: stream the answer, its pieces shown live on the session's event stream",
    "temperature": "sampling temperature, sent as is",
    "top_p": "nucleus sampling, sent as is",
    "max_tokens": "the most tokens one answer may have, sent as is",
    "max_completion_tokens": "the newer name of `max_tokens`, sent as is",
    "seed": "a sampling seed, sent as is",
    "stop": "stop sequences, sent as is",
    "presence_penalty": "sent as is",
    "frequency_penalty": "sent as is",
    "logit_bias": "sent as is",
    "response_format": 'sent as is (e.g. {type = "json_object"})',
    "tool_choice": "sent as is (`auto`, `required`, `none` or a function)",
    "parallel_tool_calls": "sent as is",
    "reasoning_effort": "sent as is (reasoning models)",
    "user": "sent as is",
    "extra_body": "a table merged into the request body: a server's own parameters (vLLM's"
    " `top_k`, Ollama's `options`, ...)",
    "model": "the model, when given in `options` rather than beside `provider`",
    "base_url": "refused: endpoints are the worker's `[providers.openai.credentials.<name>]`",
    "api_key_env": "refused: keys are the worker's `[providers.openai.credentials.<name>]`",
}
"""Every ``[model]`` option the provider takes (``ModelProvider.options``)."""
RESERVED_BODY_KEYS = frozenset({"model", "messages", "tools", "stream"})
"""Body keys apomesh sets itself, which ``extra_body`` may not replace."""
POOL_LIMITS = {"max_connections": 64, "max_keepalive_connections": 16}
WORKER_ONLY_OPTIONS = ("base_url", "api_key_env")
"""Options a definition may not give: they are the worker's configured credentials."""
RESERVED_ENV_PREFIX = "APOMESH_"
"""apomesh's own secrets (API and NATS credentials) live in these variables: never a model key."""

_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Credential(msgspec.Struct, frozen=True):
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
    """One configured chat-completions model; its calls go through ``client`` (the provider's
    pooled one, when given)."""

    def __init__(
        self,
        *,
        model: str,
        base_url: str,
        api_key: str | None,
        timeout: float,
        passthrough: dict[str, Any],
        client: Callable[[], httpx.AsyncClient] | None = None,
        stream: bool = False,
    ) -> None:
        self.model = model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.timeout = timeout
        self.passthrough = passthrough
        self._client = client or _ClientPool().client
        self.stream = stream

    def request_body(self, request: ModelRequest) -> dict[str, Any]:
        extra = self.passthrough.get("extra_body") or {}
        body: dict[str, Any] = {
            **{k: v for k, v in self.passthrough.items() if k != "extra_body"},
            **extra,
            "model": self.model,
        }
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
        with http_errors(PROVIDER_NAME, self.url, self.timeout):
            # Never follow a redirect: the key goes to this endpoint and nowhere else.
            reply = await self._client().post(
                self.url, json=body, headers=headers, timeout=self.timeout, follow_redirects=False
            )
        if reply.status_code >= 300:
            raise refusal(reply, PROVIDER_NAME, secret=self.api_key)
        return parse_completion(reply, request, names, secret=self.api_key)


def parse_completion(
    reply: httpx.Response, request: ModelRequest, names: dict[str, str], secret: str | None = None
) -> ModelResponse:
    """The ``ModelResponse`` of a successful (non-streaming) chat completion."""
    try:
        data = reply.json()
    except ValueError:
        raise ModelError("the answer is not JSON", provider=PROVIDER_NAME) from None
    if isinstance(data, dict) and "choices" not in data and "error" in data:
        # Some servers answer an error with status 200.
        raise ModelError(error_message(reply, secret=secret), provider=PROVIDER_NAME)
    try:
        message = data["choices"][0]["message"]
        content = _text(message.get("content"))
        raw_calls = message.get("tool_calls") or []
        usage = data.get("usage")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ModelError(
            f"unexpected response shape ({type(exc).__name__}: {exc})", provider=PROVIDER_NAME
        ) from None
    return model_response(request, names, content, raw_calls, usage)


def _text(content: Any) -> str:
    """A message's content: a string, null (a tool-call turn), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise TypeError(f"content is a {type(content).__name__}")


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


MAX_ERROR_MESSAGE = 300
"""The longest provider message kept in a ``ModelError`` (it lands on the session's log)."""

_KEY_LIKE = re.compile(
    r"(sk-[A-Za-z0-9_*.-]{3,}|(?:Bearer|Basic)\s+\S+|[A-Za-z0-9_-]{32,}|key[-_][A-Za-z0-9_-]{8,})",
    re.IGNORECASE,
)
# What is not printable: control characters and whatever lies past the Basic Multilingual Plane
# (spelled as those ranges: the negated class compiles in 2 ms, at every daemon start).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\U00010000-\U0010ffff]+")


def scrub(text: str, secret: str | None = None) -> str:
    """``text`` made fit for the log: one line of printable characters, the call's own key and
    anything shaped like a key or a bearer token replaced by ``***``, at most
    ``MAX_ERROR_MESSAGE`` characters."""
    if secret:
        text = text.replace(secret, "***")
    text = _KEY_LIKE.sub("***", text)
    text = " ".join(_UNPRINTABLE.sub(" ", text).split())
    if len(text) > MAX_ERROR_MESSAGE:
        text = text[: MAX_ERROR_MESSAGE - 3].rstrip() + "..."
    return text


def error_message(reply: httpx.Response, secret: str | None = None) -> str:
    """The status, the API's short error code when it gives one (``rate_limit_exceeded``) and
    its own message, scrubbed (``scrub``). Understands the error shapes of OpenAI, vLLM,
    Ollama and llama.cpp server: ``{"error": {"message", "type", "code"}}``, ``{"error": "..."}``
    and ``{"object": "error", "message", "type"}``."""
    try:
        data = reply.json()
    except ValueError:
        data = None
    error: Any = data.get("error", data) if isinstance(data, dict) else None
    code = message = None
    if isinstance(error, str):
        message = error
    elif isinstance(error, dict):
        for key in ("code", "type"):
            value = error.get(key)
            if isinstance(value, str) and _ERROR_CODE.match(value):
                code = value
                break
        if isinstance(error.get("message"), str):
            message = error["message"]
    text = f"the endpoint answered {reply.status_code}" + (f" ({code})" if code else "")
    message = scrub(message, secret) if message else ""
    return f"{text}: {message}" if message else text


def retry_after(headers: httpx.Headers) -> float | None:
    """The delay in seconds an answer asks for before the next call: ``retry-after-ms``, or
    ``Retry-After`` as seconds or an HTTP date; None when it names none."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def refusal(reply: httpx.Response, provider: str, secret: str | None = None) -> ModelError:
    """The ``ModelError`` of an answer with an error status (read in full): its status, its
    scrubbed message (``error_message``) and the delay it asks for (``retry_after``)."""
    return ModelError(
        error_message(reply, secret=secret),
        provider=provider,
        status=reply.status_code,
        retry_after=retry_after(reply.headers),
    )


class _ClientPool:
    """One ``httpx.AsyncClient`` (a pool of kept-alive connections) for every model of a
    provider in this process, made on first use and made again on another event loop (a client
    belongs to the loop it first ran on)."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> httpx.AsyncClient:
        import httpx  # imported on first use: it is a fifth of a second of every process's start

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._client.is_closed:
            self._client = httpx.AsyncClient(
                follow_redirects=False, timeout=DEFAULT_TIMEOUT, limits=httpx.Limits(**POOL_LIMITS)
            )
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()


class OpenAIProvider:
    """The ``openai`` provider: ``credentials`` are the endpoints this process may call, by name
    (none until ``use_credentials`` is called); ``environ`` (default ``os.environ``) is where their
    keys are read."""

    name: str = PROVIDER_NAME
    options: Mapping[str, str] = OPTIONS
    model_class: Callable[..., Model] = OpenAIModel
    """What ``create`` builds (``anthropic`` builds its own model the same way)."""

    def __init__(
        self,
        credentials: Mapping[str, Credential] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._environ = environ
        self._pool = _ClientPool()
        self.credentials: dict[str, Credential] = {}
        self.use_credentials(credentials or {})

    async def aclose(self) -> None:
        """Close the pooled HTTP client (a worker does at shutdown)."""
        await self._pool.aclose()

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
        extra = options.get("extra_body", {})
        if not isinstance(extra, dict):
            raise DefinitionError("`extra_body` must be a table", where=f"{where}.extra_body")
        for key in sorted(set(extra) & RESERVED_BODY_KEYS):
            raise DefinitionError(
                f"`{key}` is set by apomesh, not by `extra_body`", where=f"{where}.extra_body.{key}"
            )
        check_stream_option(options, where)
        return self.credentials[name]

    def create(self, spec: ModelSpec) -> Model:
        credential = self.check(spec)
        options = dict(spec.options)
        environ = os.environ if self._environ is None else self._environ
        key = environ.get(credential.api_key_env) if credential.api_key_env else None
        return self.model_class(
            model=str(spec.model or options.get("model")),
            base_url=credential.base_url,
            api_key=key or None,
            timeout=float(options.get("timeout", DEFAULT_TIMEOUT)),
            passthrough={k: v for k, v in options.items() if k not in OWN_OPTIONS},
            client=self._pool.client,
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
    """Transport failures of a call to ``url`` as retryable ``ModelError``s: a timeout, a
    connection that broke mid-answer (a stream cut off), an endpoint that cannot be reached."""
    import httpx
    import httpx_sse

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
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        raise ModelError(
            f"the connection to {url} broke before the answer was complete:"
            f" {type(exc).__name__}: {exc}",
            provider=provider,
            retryable=True,
        ) from None
    except httpx.HTTPError as exc:
        raise ModelError(
            f"cannot reach {url}: {type(exc).__name__}: {exc}", provider=provider, retryable=True
        ) from None


def event_source(reply: httpx.Response) -> AsyncIterator[Any]:
    """The server-sent events of a streamed answer."""
    import httpx_sse

    return httpx_sse.EventSource(reply).aiter_sse()


DRAIN_SECONDS = 1.0
"""How long a finished stream's remaining bytes (its last, empty chunk) are waited for."""


async def read_to_end(events: AsyncIterator[Any]) -> None:
    """Read what follows the end of an answer in its stream, so that its kept-alive connection
    goes back to the pool (a response left half-read closes it); a server that keeps the
    stream open past ``DRAIN_SECONDS`` or breaks it now costs only that connection."""
    import httpx

    with contextlib.suppress(httpx.HTTPError, TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            async for _ in events:
                pass


def stream_error(error: Any, provider: str, secret: str | None = None) -> ModelError:
    """The ``ModelError`` for an error an endpoint sent inside an event stream (after its
    ``200``): its short code or type and its own message, scrubbed (``scrub``) as a refusal's
    is; retryable when it names a server error, an overload or a rate limit."""
    status = None
    code = None
    message = ""
    if isinstance(error, dict):
        raw_status = error.get("code", error.get("status"))
        if isinstance(raw_status, int) and not isinstance(raw_status, bool):
            status = raw_status
        for key in ("code", "type"):
            value = error.get(key)
            if isinstance(value, str) and _ERROR_CODE.match(value):
                code = value
                break
        if isinstance(error.get("message"), str):
            message = scrub(error["message"], secret)
    elif isinstance(error, str):
        message = scrub(error, secret)
    retryable = (status is not None and (status == 429 or status >= 500)) or (
        code is not None
        and any(
            word in code.lower() for word in ("overloaded", "rate_limit", "server", "api_error")
        )
    )
    text = "the endpoint sent an error in its event stream" + (f" ({code})" if code else "")
    return ModelError(
        f"{text}: {message}" if message else text,
        provider=provider,
        status=status,
        retryable=retryable,
    )


class ChatStream(msgspec.Struct):
    """One streamed chat completion being assembled from its chunks (``feed``, in order).

    Text arrives as ``delta.content`` pieces; a tool call as ``delta.tool_calls`` entries keyed by
    their ``index`` (its ``id`` and name on the first, the JSON ``arguments`` in fragments after,
    or whole in one entry as Ollama sends them); usage in the last chunk (``choices`` empty, or
    beside the ``finish_reason`` as llama.cpp server sends it). An ``error`` object in a chunk (vLLM,
    Ollama, llama.cpp server) is a ``ModelError``; a stream that stops before any
    ``finish_reason`` is one too (retryable: the answer was cut off)."""

    names: dict[str, str]
    secret: str | None = None
    content: list[str] = msgspec.field(default_factory=list)
    calls: dict[int, dict[str, str]] = msgspec.field(default_factory=dict)
    usage: dict[str, Any] = msgspec.field(default_factory=dict)
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
            raise stream_error(chunk.get("error", chunk), PROVIDER_NAME, self.secret)
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
    stream = ChatStream(names, secret=model.api_key)
    await emit_delta(ModelDelta("start"))
    with http_errors(PROVIDER_NAME, model.url, model.timeout):
        async with model._client().stream(
            "POST",
            model.url,
            json=body,
            headers=headers,
            timeout=model.timeout,
            follow_redirects=False,
        ) as reply:
            if reply.status_code >= 300:
                await reply.aread()
                raise refusal(reply, PROVIDER_NAME, secret=model.api_key)
            events = event_source(reply)
            async for event in events:
                if event.data.strip() == "[DONE]":
                    break
                for delta in stream.feed(event.data):
                    await emit_delta(delta)
            await read_to_end(events)
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
