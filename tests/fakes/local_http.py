"""The background HTTP server the fake model APIs share: one ``ThreadingHTTPServer`` on a
127.0.0.1 port in a daemon thread, its ``/v1`` base URL, and start/stop as a context manager.
A fake subclasses ``LocalHTTPServer`` and passes its request handler class to ``serve``."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self


class _QuietServer(ThreadingHTTPServer):
    """A client dropping a kept-alive connection (a pooled client never closed, a stream cut on
    purpose) is ordinary for a server, not an error worth a traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class LocalHTTPServer:
    """A loopback HTTP server run in a thread; ``start`` is the subclass's, calling ``serve``."""

    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "the server is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def start(self) -> None:
        raise NotImplementedError

    def serve(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self._server = _QuietServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        # A short poll interval keeps ``stop`` (shutdown waits for one poll) quick.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = None
        self._thread = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
