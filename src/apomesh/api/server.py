"""Serving the API for ``apomesh serve``: the app on uvicorn at ``[http] listen``, with bearer-token
auth on (loopback included, unless ``[http] auth = "off"``), the ``Host`` names of ``[http]``,
forwarded headers believed only from ``[http] trusted_proxies``, and TLS when a certificate is
given. ``serve_api`` is handed to the runtime's ``Node`` by the command line, so the runtime never
imports the API layer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

from apomesh.api.app import ApiServer, create_app
from apomesh.api.auth import AuthSettings
from apomesh.api.service import DaemonService
from apomesh.api.tokens import TokenStore
from apomesh.runtime.config import FIRST_TOKEN_FILE, Config

log = logging.getLogger("apomesh.api")


class HttpEndpoint(msgspec.Struct):
    url: str
    server: ApiServer
    task: asyncio.Task[Any]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 10.0)


def _auth_settings(config: Config) -> AuthSettings:
    """Auth as configured: off only when asked for; on, the tokens of the data dir plus
    ``[http] token``, or, on a first start without either, an operator token written to
    ``<data_dir>/http.token`` (its path is logged, never the token)."""
    http = config.http
    if not http.auth_required():
        return AuthSettings.off()
    data = config.daemon.data_path()
    store = TokenStore.in_dir(data)
    if http.token:
        store.add_static(http.token, "[http] token")
    elif store.ensure_first_token(data / FIRST_TOKEN_FILE):
        log.warning(
            "API auth is on and no token existed: an operator token was written to %s"
            " (manage tokens with `apomesh tokens create|list|revoke`)",
            data / FIRST_TOKEN_FILE,
        )
    return AuthSettings(enabled=True, token_store=store)


async def serve_api(service: DaemonService, config: Config) -> HttpEndpoint:
    """Start the HTTP API; answers once it listens."""
    http = config.http
    host, port = http.host_port()
    auth = _auth_settings(config)
    app = create_app(
        service,
        auth=auth,
        max_body_bytes=http.max_body_bytes,
        keepalive_seconds=http.keepalive_seconds,
        allowed_hosts=http.host_names(),
    )
    # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local process could then
    # pose as any address and escape failed-token rate limiting.
    options: dict[str, Any] = {
        # uvicorn's lines go through the process's own handler (text or JSON: [log] format).
        "log_config": None,
        "log_level": "warning",
        "proxy_headers": bool(http.trusted_proxies),
        "forwarded_allow_ips": list(http.trusted_proxies),
    }
    if http.tls_cert:
        options.update(ssl_certfile=http.tls_cert, ssl_keyfile=http.tls_key)
    server = ApiServer(app, host=host, port=port, **options)
    task = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait((task, listening), return_when=asyncio.FIRST_COMPLETED)
    if not server.listening.is_set():
        listening.cancel()
        task.result()
        raise RuntimeError(f"the HTTP API could not listen on {http.listen}")
    bound = port
    with contextlib.suppress(Exception):
        bound = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if http.tls_cert else "http"
    return HttpEndpoint(f"{scheme}://{host}:{bound}", server, task)
