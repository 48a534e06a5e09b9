"""The daemon's HTTP face: REST + server-sent events over a ``DaemonService``, bearer-token auth,
the OpenAPI document and the operator console's static assets. ``create_app`` builds the ASGI app;
the daemon serves it with uvicorn."""

from __future__ import annotations

from apomesh.api.app import create_app
from apomesh.api.auth import AuthSettings
from apomesh.api.service import DaemonService
from apomesh.api.tokens import TokenStore

__all__ = ["AuthSettings", "DaemonService", "TokenStore", "create_app"]
