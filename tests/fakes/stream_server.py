"""A local server replaying the streaming answers of real model servers, for tests.

``ReplayServer(flavour)`` listens on a free 127.0.0.1 port and answers like one of five servers,
byte for byte in the shape each one streams (the fields, their order and placement, where the
usage goes, how a tool call is cut up, how an error arrives after the ``200``):

- ``openai``: ``chat.completion.chunk`` events with ``"usage":null`` on every chunk when usage
  was asked for, the first tool-call entry carrying ``id``, name and empty ``arguments``, the
  arguments in fragments after, a ``finish_reason`` chunk with an empty delta, then a last chunk
  with ``"choices":[]`` and the usage (with its ``*_tokens_details``), then ``[DONE]``.
- ``vllm``: a first chunk with the role and empty content, a tool call's first entry with ``id``
  (``chatcmpl-tool-...``) and name but no ``arguments``, ``stop_reason`` beside
  ``finish_reason``, the usage in a last ``"choices":[]`` chunk; an error is a
  ``data: {"error": {"object": "error", ...}}`` event followed by ``[DONE]``.
- ``ollama``: the role and content on every chunk, ``system_fingerprint`` ``fp_ollama``, a tool
  call whole in one chunk (never in fragments), the usage in a last ``"choices":[]`` chunk; an
  error is a ``data: {"error": {...}}`` event.
- ``llamacpp`` (llama.cpp server): a first chunk with ``"content":null``, the usage and
  ``timings`` in the ``finish_reason`` chunk itself; an error is an ``error: {...}`` line, which
  is not an SSE field at all, and the stream then ends without ``[DONE]``.
- ``anthropic``: the Messages API's named events (``message_start`` with the input usage,
  ``content_block_start``/``ping``/``content_block_delta``/``content_block_stop``,
  ``message_delta`` with the stop reason and output usage, ``message_stop``); an error is an
  ``event: error`` with ``overloaded_error``. Without ``stream`` it answers the Messages JSON.

The shapes follow what these servers send (their documentation and captures of their streams);
ids, fingerprints and timestamps are fixed. Queue answers with ``text``, ``tool_call``,
``stream_error`` or ``refuse``; each request takes the next. ``hold_after=n`` makes an answer
stop after its first ``n`` events: the ``Hold`` returned is ``reached`` then, and the answer goes
on at its ``release()``, so a test can look at what a client saw while the model is still
writing. Every request is recorded; a request whose conversation the
real API would refuse (tool results answering no call) gets that API's 400.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Literal

from tests.fakes.local_http import LocalHTTPServer
from tests.fakes.openai_server import RecordedRequest, conversation_problem

Flavour = Literal["openai", "vllm", "ollama", "llamacpp", "anthropic"]
FLAVOURS: tuple[Flavour, ...] = ("openai", "vllm", "ollama", "llamacpp", "anthropic")
OPENAI_COMPATIBLE: tuple[Flavour, ...] = ("openai", "vllm", "ollama", "llamacpp")

HOLD_SECONDS = 30.0
"""The longest a held answer waits for ``release`` before it goes on anyway."""

LEAKED_KEY = "sk-ant-api03-0123456789abcdefghij"
"""A key-shaped string the replayed error messages carry: a provider must scrub it away."""
ERROR_DETAIL = f"internal detail (upstream key {LEAKED_KEY})"
"""The message of the replayed errors: its words are kept, its key is not."""


@dataclass
class Hold:
    """Where a queued answer stops until the test lets it go on."""

    after: int
    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.go.set()


@dataclass(frozen=True)
class Answer:
    """One queued answer: ``text``, or a tool call ``(api name, args)``, or an error."""

    text: str = ""
    call: tuple[str, dict[str, Any]] | None = None
    error: bool = False
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    hold: Hold | None = None
    cut_after: int | None = None


def pieces(text: str, size: int) -> list[str]:
    """``text`` cut in pieces of ``size`` characters, as a model writes tokens."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _data(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _event(name: str, payload: Any) -> bytes:
    return f"event: {name}\n".encode() + _data(payload)


DONE = b"data: [DONE]\n\n"


# --- the OpenAI-compatible servers ------------------------------------------------------------


def openai_events(answer: Answer, usage_asked: bool) -> list[bytes]:
    base = {
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion.chunk",
        "created": 1741569952,
        "model": "gpt-4o-mini-2024-07-18",
        "service_tier": "default",
        "system_fingerprint": "fp_06737a9306",
    }
    extra = {"usage": None} if usage_asked else {}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _data({**base, "choices": [choice], **extra})

    events: list[bytes] = []
    if answer.call is not None:
        name, args = answer.call
        first = {
            "index": 0,
            "id": "call_3NcUdCiMdjrZDsQd3Ehm9rWP",
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        events.append(
            chunk({"role": "assistant", "content": None, "tool_calls": [first], "refusal": None})
        )
        for piece in pieces(json.dumps(args, separators=(",", ":")), 5):
            events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        events.append(chunk({}, "tool_calls"))
    else:
        events.append(chunk({"role": "assistant", "content": "", "refusal": None}))
        events += [chunk({"content": piece}) for piece in pieces(answer.text, 4)]
        events.append(chunk({}, "stop"))
    if usage_asked:
        total = answer.prompt_tokens + answer.completion_tokens
        usage = {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }
        events.append(_data({**base, "choices": [], "usage": usage}))
    return [*events, DONE]


def vllm_events(answer: Answer, usage_asked: bool) -> list[bytes]:
    base = {
        "id": "chatcmpl-5f0b2b8a4e3c4c1f9e6d7a8b9c0d1e2f",
        "object": "chat.completion.chunk",
        "created": 1741570011,
        "model": "Qwen/Qwen2.5-7B-Instruct",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = None
        return _data({**base, "choices": [choice]})

    events = [chunk({"role": "assistant", "content": ""})]
    if answer.error:
        error = {
            "object": "error",
            "message": f"The engine has stopped: {ERROR_DETAIL}",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        return [*events, chunk({"content": "Wr"}), _data({"error": error}), DONE]
    if answer.call is not None:
        name, args = answer.call
        first = {
            "id": "chatcmpl-tool-3c0b4b0b0a0d4d8a9ce1e4a3c0a4f1b2",
            "type": "function",
            "index": 0,
            "function": {"name": name},
        }
        events.append(chunk({"tool_calls": [first]}))
        for piece in pieces(json.dumps(args), 7):
            events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        events.append(chunk({"content": ""}, "tool_calls"))
    else:
        events += [chunk({"content": piece}) for piece in pieces(answer.text, 3)]
        events.append(chunk({"content": ""}, "stop"))
    if usage_asked:
        usage = {
            "prompt_tokens": answer.prompt_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            "completion_tokens": answer.completion_tokens,
            "prompt_tokens_details": None,
        }
        events.append(_data({**base, "choices": [], "usage": usage}))
    return [*events, DONE]


def ollama_events(answer: Answer, usage_asked: bool) -> list[bytes]:
    base = {
        "id": "chatcmpl-838",
        "object": "chat.completion.chunk",
        "created": 1744438886,
        "model": "qwen2.5-coder:7b-instruct-q8_0",
        "system_fingerprint": "fp_ollama",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _data(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", **delta}, "finish_reason": finish}
                ],
            }
        )

    if answer.error:
        error = {
            "message": f"model runner has unexpectedly stopped: {ERROR_DETAIL}",
            "type": "api_error",
            "param": None,
            "code": None,
        }
        return [chunk({"content": "Wr"}), _data({"error": error})]
    events: list[bytes] = []
    if answer.call is not None:
        name, args = answer.call
        call = {
            "id": "call_hk81qg8b",
            "index": 0,
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":"))},
        }
        events.append(chunk({"content": "", "tool_calls": [call]}))
        events.append(chunk({"content": ""}, "tool_calls"))
    else:
        events += [chunk({"content": piece}) for piece in pieces(answer.text, 5)]
        events.append(chunk({"content": ""}, "stop"))
    if usage_asked:
        usage = {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        }
        events.append(_data({**base, "choices": [], "usage": usage}))
    return [*events, DONE]


def llamacpp_events(answer: Answer, usage_asked: bool) -> list[bytes]:
    tail = {
        "created": 1754524122,
        "id": "chatcmpl-yPk7z9nC22CofOlh100qQdHVEDMNYCb1",
        "model": "gpt-3.5-turbo",
        "system_fingerprint": "b6097-9515c613",
        "object": "chat.completion.chunk",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> bytes:
        choice = {"finish_reason": finish, "index": 0, "delta": delta}
        return _data({"choices": [choice], **tail, **more})

    events = [chunk({"role": "assistant", "content": None})]
    if answer.error:
        error = {"code": 500, "message": ERROR_DETAIL, "type": "server_error"}
        return [
            *events,
            chunk({"content": "Wr"}),
            b"error: " + json.dumps(error).encode() + b"\n\n",
        ]
    if answer.call is not None:
        name, args = answer.call
        first = {
            "index": 0,
            "id": "XlZxk1PqTqQ0bG1x7uJmQk3s8yW2eR4t",
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        events.append(chunk({"tool_calls": [first]}))
        for piece in pieces(json.dumps(args, separators=(",", ":")), 6):
            events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        finish = "tool_calls"
    else:
        events += [chunk({"content": piece}) for piece in pieces(answer.text, 4)]
        finish = "stop"
    usage = {
        "completion_tokens": answer.completion_tokens,
        "prompt_tokens": answer.prompt_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }
    timings = {
        "prompt_n": answer.prompt_tokens,
        "prompt_ms": 203.378,
        "prompt_per_token_ms": 0.187,
        "prompt_per_second": 5334.89,
        "predicted_n": answer.completion_tokens,
        "predicted_ms": 933.63,
        "predicted_per_token_ms": 3.78,
        "predicted_per_second": 264.56,
    }
    events.append(chunk({}, finish, usage=usage, timings=timings))
    return [*events, DONE]


# --- Anthropic --------------------------------------------------------------------------------

ANTHROPIC_MODEL = "claude-sonnet-4-5-20250929"


def anthropic_message(answer: Answer) -> dict[str, Any]:
    """The Messages API's JSON answer (no ``stream``)."""
    content: list[dict[str, Any]] = []
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    if answer.call is not None:
        name, args = answer.call
        content.append(
            {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": name, "input": args}
        )
    return {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": ANTHROPIC_MODEL,
        "content": content,
        "stop_reason": "tool_use" if answer.call is not None else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": answer.completion_tokens,
            "service_tier": "standard",
        },
    }


def anthropic_events(answer: Answer) -> list[bytes]:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_014p7gG3wDgGV9EUtLvnow3U",
            "type": "message",
            "role": "assistant",
            "model": ANTHROPIC_MODEL,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": answer.prompt_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 1,
                "service_tier": "standard",
            },
        },
    }
    events = [_event("message_start", start)]
    if answer.error:
        error = {
            "type": "error",
            "error": {"type": "overloaded_error", "message": f"Overloaded: {ERROR_DETAIL}"},
        }
        return [*events, _event("ping", {"type": "ping"}), _event("error", error)]
    index = 0
    if answer.text:
        block = {"type": "text", "text": ""}
        events.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        )
        events.append(_event("ping", {"type": "ping"}))
        for piece in pieces(answer.text, 4):
            delta = {"type": "text_delta", "text": piece}
            events.append(
                _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            )
        events.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        index = 1
    if answer.call is not None:
        name, args = answer.call
        block = {
            "type": "tool_use",
            "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
            "name": name,
            "input": {},
        }
        events.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        events.append(
            _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": ""},
                },
            )
        )
        for piece in pieces(json.dumps(args), 6):
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append(
                _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            )
        events.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    stop = {
        "type": "message_delta",
        "delta": {
            "stop_reason": "tool_use" if answer.call is not None else "end_turn",
            "stop_sequence": None,
        },
        "usage": {"output_tokens": answer.completion_tokens},
    }
    events.append(_event("message_delta", stop))
    events.append(_event("message_stop", {"type": "message_stop"}))
    return events


def anthropic_problem(body: dict[str, Any]) -> str | None:
    """What the Messages API would refuse in this request body, or None."""
    if not isinstance(body.get("model"), str) or not isinstance(body.get("max_tokens"), int):
        return "model: Field required / max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    pending: list[str] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        if i and messages[i - 1].get("role") == role:
            return f"messages.{i}: roles must alternate"
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if results != pending[: len(results)] or len(results) != len(pending):
            return f"messages.{i}: tool_use ids {pending} need tool_result blocks right after"
        if any(b.get("type") == "text" and not b.get("text") for b in blocks):
            return f"messages.{i}: text content blocks must be non-empty"
        pending = (
            [b["id"] for b in blocks if b.get("type") == "tool_use"] if role == "assistant" else []
        )
    if pending:
        return f"tool_use ids {pending} were not answered"
    return None


# --- the server -------------------------------------------------------------------------------


@dataclass
class ReplayServer(LocalHTTPServer):
    """``with ReplayServer("vllm") as server:``; point clients at ``server.base_url``."""

    flavour: Flavour = "openai"
    requests: list[RecordedRequest] = field(default_factory=list)
    _answers: deque[Answer] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    holds: list[Hold] = field(default_factory=list)

    # --- queued answers ------------------------------------------------------------------------

    def text(
        self,
        text: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        hold_after: int | None = None,
        cut_after: int | None = None,
    ) -> Hold | None:
        """Queue a text answer; ``cut_after=n`` closes the connection after its first ``n``
        events, as a dropped connection cuts a stream mid-way."""
        answer = Answer(
            text=text,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cut_after=cut_after,
        )
        return self._queue(answer, hold_after)

    def tool_call(
        self,
        name: str,
        args: dict[str, Any],
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        hold_after: int | None = None,
    ) -> Hold | None:
        """Queue one tool call ``name`` (the API's name) with ``args``."""
        answer = Answer(
            call=(name, args), prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )
        return self._queue(answer, hold_after)

    def stream_error(self) -> None:
        """This flavour's error inside a stream that began with ``200``."""
        self._queue(Answer(error=True))

    def refuse(self, status: int) -> None:
        """An HTTP error answer in the API's error shape, before any stream."""
        self._queue(Answer(status=status))

    def release(self) -> None:
        """Let every held answer go on (at teardown)."""
        for hold in self.holds:
            hold.release()

    def _queue(self, answer: Answer, hold_after: int | None = None) -> Hold | None:
        hold = Hold(hold_after) if hold_after is not None else None
        with self._lock:
            if hold is not None:
                self.holds.append(hold)
            self._answers.append(dataclasses.replace(answer, hold=hold))
        return hold

    def _next(self) -> Answer | None:
        with self._lock:
            return self._answers.popleft() if self._answers else None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        fake = self
        path = "/v1/messages" if self.flavour == "anthropic" else "/v1/chat/completions"

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._json(400, fake._error_body(400))
                    return
                with fake._lock:
                    fake.requests.append(
                        RecordedRequest(
                            self.path, dict(self.headers.items()), body, self.client_address[1]
                        )
                    )
                if self.path != path:
                    self._json(404, fake._error_body(404))
                    return
                if fake.flavour == "anthropic":
                    problem = anthropic_problem(body)
                else:
                    problem = conversation_problem(body)
                if problem is not None:
                    self._json(400, fake._error_body(400, problem))
                    return
                answer = fake._next()
                if answer is None:
                    self._json(500, fake._error_body(500, "the replay server has no answer left"))
                    return
                if answer.status != 200:
                    self._json(answer.status, fake._error_body(answer.status))
                    return
                if not body.get("stream"):
                    if fake.flavour != "anthropic":
                        self._json(500, fake._error_body(500, "streaming answers only"))
                        return
                    self._json(200, anthropic_message(answer))
                    return
                self._stream(fake._events(answer, body), answer.hold, answer.cut_after)

            def _stream(
                self, events: list[bytes], hold: Hold | None, cut_after: int | None = None
            ) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for number, event in enumerate(events):
                    if number == cut_after:
                        # The connection drops: no last chunk, the answer is cut off.
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    if hold is not None and number == hold.after:
                        self.wfile.flush()
                        hold.reached.set()
                        hold.go.wait(HOLD_SECONDS)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("retry-after", "2")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.serve(Handler, 0)

    def _events(self, answer: Answer, body: dict[str, Any]) -> list[bytes]:
        usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
        if self.flavour == "anthropic":
            return anthropic_events(answer)
        if self.flavour == "openai":
            if answer.error:
                # OpenAI itself answers an error before the stream: an error status.
                raise AssertionError("queue refuse() for openai: it has no in-stream errors here")
            return openai_events(answer, usage_asked)
        builder = {"vllm": vllm_events, "ollama": ollama_events, "llamacpp": llamacpp_events}
        return builder[self.flavour](answer, usage_asked)

    def _error_body(self, status: int, message: str = ERROR_DETAIL) -> dict[str, Any]:
        if self.flavour == "anthropic":
            kind = {
                400: "invalid_request_error",
                401: "authentication_error",
                404: "not_found_error",
                429: "rate_limit_error",
                529: "overloaded_error",
            }.get(status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": message}}
        code = {429: "rate_limit_exceeded", 401: "invalid_api_key"}.get(status)
        return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
