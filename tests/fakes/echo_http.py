"""A loopback HTTP server that records every request it gets and answers with it, for the tests
of ``http.request``."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.local_http import LocalHTTPServer

from apomesh.builtin.tools import MAX_HTTP_BODY


class Recorder(LocalHTTPServer):
    """Answers every request with what it got (method, path, headers, body) as JSON; ``/big``
    with more than ``MAX_HTTP_BODY`` bytes, ``/missing`` with a 404."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def start(self) -> None:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen = {
                    "method": self.command,
                    "path": self.path,
                    "headers": dict(self.headers),
                    "body": self.rfile.read(length).decode(),
                }
                recorder.requests.append(seen)
                status = 404 if self.path == "/missing" else 200
                data = b"x" * (MAX_HTTP_BODY + 10) if self.path == "/big" else json.dumps(seen)
                payload = data if isinstance(data, bytes) else data.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.serve(Handler)

    @property
    def url(self) -> str:
        return self.base_url.removesuffix("/v1")
