"""A local HTTP server speaking the OpenAI chat-completions protocol, for tests.

``FakeOpenAIServer`` listens on a free 127.0.0.1 port in a background thread, answers
``POST /v1/chat/completions`` from a queue of canned replies (``reply`` / ``fail`` / ``replay``
of a recorded answer from ``tests.fakes.openai_shapes``, each with optional headers and a delay
before it is sent, which a client with a shorter timeout sees as a timeout) and records every
request it receives. Like the real API it refuses (400) a conversation in which a tool message
answers no pending assistant tool call, or a tool call is left unanswered, so a client that gets
the tool-call ids wrong fails here too.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.local_http import LocalHTTPServer


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    client_port: int = 0
    """The client's source port: requests over one kept-alive connection share it."""


@dataclass(frozen=True)
class CannedReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class FakeOpenAIServer(LocalHTTPServer):
    """Start with ``with FakeOpenAIServer() as server:``; point clients at ``server.base_url``."""

    requests: list[RecordedRequest] = field(default_factory=list)
    _replies: deque[CannedReply] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _call_ids: int = 0

    # --- canned replies ----------------------------------------------------------------------

    def reply(
        self,
        content: str | None = None,
        *,
        tool_calls: list[tuple[str, dict[str, Any]]] | None = None,
        total_tokens: int = 0,
        delay: float = 0.0,
    ) -> None:
        """Queue a successful completion: text ``content`` and/or ``(function name, args)`` calls."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            calls = []
            for name, args in tool_calls:
                self._call_ids += 1
                calls.append(
                    {
                        "id": f"call_srv_{self._call_ids}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                )
            message["tool_calls"] = calls
        body = {
            "id": f"chatcmpl-{len(self._replies)}",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if tool_calls else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": total_tokens // 2,
                "completion_tokens": total_tokens - total_tokens // 2,
                "total_tokens": total_tokens,
            },
        }
        self.replay(body, delay=delay)

    def fail(
        self,
        status: int,
        message: str,
        *,
        kind: str = "server_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Queue an error reply in the API's error shape."""
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        self.replay(body, status=status, headers=headers)

    def replay(
        self,
        body: dict[str, Any],
        *,
        status: int = 200,
        headers: dict[str, str] | None = None,
        delay: float = 0.0,
    ) -> None:
        """Queue ``body`` as it is (a recorded answer), after ``delay`` seconds."""
        with self._lock:
            self._replies.append(CannedReply(status, body, dict(headers or {}), delay))

    def clear(self) -> None:
        """Forget the queued replies and the recorded requests."""
        with self._lock:
            self._replies.clear()
            self.requests.clear()

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real API server

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON"}})
                    return
                fake._record(
                    RecordedRequest(
                        self.path, dict(self.headers.items()), body, self.client_address[1]
                    )
                )
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                problem = conversation_problem(body)
                if problem is not None:
                    self._send(400, {"error": {"message": problem, "type": "invalid_request"}})
                    return
                canned = fake._next_reply()
                if canned is None:
                    self._send(500, {"error": {"message": "the fake has no canned reply left"}})
                    return
                if canned.delay:
                    time.sleep(canned.delay)
                with contextlib.suppress(OSError):  # a client that timed out has gone
                    self._send(canned.status, canned.body, canned.headers)

            def _send(
                self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.serve(Handler, 0)

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _next_reply(self) -> CannedReply | None:
        with self._lock:
            return self._replies.popleft() if self._replies else None


def conversation_problem(body: dict[str, Any]) -> str | None:
    """What the real API would refuse in this request body, or None."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    pending: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                return f"messages[{i}]: tool message answers no pending tool call ({call_id!r})"
            pending.remove(call_id)
            continue
        if pending:
            return f"messages[{i}]: tool calls {pending} were not answered"
        if role == "assistant":
            pending = [call["id"] for call in message.get("tool_calls") or []]
        elif role not in ("system", "user"):
            return f"messages[{i}]: unknown role {role!r}"
    if pending:
        return f"tool calls {pending} were not answered"
    for tool in body.get("tools") or []:
        name = tool.get("function", {}).get("name", "")
        if not name or not all(c.isalnum() or c in "_-" for c in name) or len(name) > 64:
            return f"invalid function name {name!r}"
    return None
