"""A local HTTP server speaking the OpenAI chat-completions protocol, for tests.

``FakeOpenAIServer`` listens on a free 127.0.0.1 port in a background thread, answers
``POST /v1/chat/completions`` from a queue of canned replies (``reply`` / ``fail``) and records
every request it receives. Like the real API it refuses (400) a conversation in which a tool
message answers no pending assistant tool call, or a tool call is left unanswered, so a client
that gets the tool-call ids wrong fails here too.
"""

from __future__ import annotations

import json
import threading
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


@dataclass(frozen=True)
class CannedReply:
    status: int
    body: dict[str, Any]


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
        with self._lock:
            self._replies.append(CannedReply(200, body))

    def fail(self, status: int, message: str, *, kind: str = "server_error") -> None:
        """Queue an error reply in the API's error shape."""
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        with self._lock:
            self._replies.append(CannedReply(status, body))

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON"}})
                    return
                fake._record(RecordedRequest(self.path, dict(self.headers.items()), body))
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
                self._send(canned.status, canned.body)

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
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
