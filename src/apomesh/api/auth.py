"""Bearer-token authentication for the HTTP API: settings, role checks and failure rate limiting.

Two roles exist: ``read`` (every GET) and ``operator`` (also every write: starting, resuming and
cancelling sessions, answering pauses, catalog writes); operator implies read. A request that needs
a role and presents no valid token gets 401; a valid token of too small a role gets 403. Failed
attempts are logged with the client address and the reason, never the token, and counted per
client address: past ``max_failures`` in ``failure_window`` seconds a failing request from that
address gets 429 until its failures age out, while a valid token from it still works. The client
address is the peer's, unless the peer is one of ``[http] trusted_proxies`` (then uvicorn takes it
from ``X-Forwarded-For``). ``/healthz``, the console's static files and ``/openapi.json`` stay open.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec

from apomesh.api.tokens import Role, TokenStore, role_allows

log = logging.getLogger("apomesh.api.auth")

ANONYMOUS_OPERATOR = "operator"
"""Who acts when auth is off: the default ``by`` of operator actions."""


class AuthSettings(msgspec.Struct, frozen=True):
    """Whether the API asks for tokens, where they are kept, and how failures are limited."""

    enabled: bool
    token_store: TokenStore | None = None
    max_failures: int = 10
    failure_window: float = 60.0

    def __post_init__(self) -> None:
        if self.enabled and self.token_store is None:
            raise ValueError("auth is enabled but no token store is configured")

    @classmethod
    def off(cls) -> AuthSettings:
        return cls(enabled=False)


class Identity(msgspec.Struct, frozen=True):
    """Who a request acts as: a token's name and role (``operator`` when auth is off)."""

    name: str
    role: Role


class AuthFailure(Exception):
    """A request that may not proceed; the API answers ``status`` with ``{"error": code}``."""

    def __init__(
        self, status: int, code: str, message: str, *, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class Authenticator(msgspec.Struct):
    """Checks requests against the settings and keeps the per-address failure counts."""

    settings: AuthSettings
    clock: Callable[[], float] = time.monotonic
    _failures: dict[str, deque[float]] = msgspec.field(default_factory=dict)

    def check(self, client: str, authorization: str | None, needed: Role) -> Identity:
        """The identity a request acts as, or ``AuthFailure`` (401, 403 or 429)."""
        if not self.settings.enabled or self.settings.token_store is None:
            return Identity(ANONYMOUS_OPERATOR, "operator")
        token = _bearer(authorization)
        info, reason = (
            self.settings.token_store.check(token) if token else (None, "no bearer token")
        )
        if info is None:
            # Only failures are limited: a valid token works from an address others flood.
            now = self.clock()
            recent = self._recent_failures(client, now)
            if len(recent) >= self.settings.max_failures:
                retry = max(1, int(recent[0] + self.settings.failure_window - now) + 1)
                raise AuthFailure(
                    429, "too_many_requests", "too many failed authentications", retry_after=retry
                )
            recent.append(now)
            log.warning("authentication failed from %s: %s", client, reason)
            raise AuthFailure(401, "unauthorized", "a valid bearer token is required")
        if not role_allows(info.role, needed):
            log.warning(
                "token %s (%s) from %s lacks the %s role", info.id, info.name, client, needed
            )
            raise AuthFailure(403, "forbidden", f"this needs a token with the {needed} role")
        return Identity(info.name, info.role)

    def still_valid(self, authorization: str | None, needed: Role) -> bool:
        """Whether the credentials a request was let in with still hold (for long-lived
        streams: a token revoked or expired since ends them). Never counts as a failure."""
        if not self.settings.enabled or self.settings.token_store is None:
            return True
        token = _bearer(authorization)
        info = self.settings.token_store.identify(token) if token else None
        return info is not None and role_allows(info.role, needed)

    def _recent_failures(self, client: str, now: float) -> deque[float]:
        horizon = now - self.settings.failure_window
        if len(self._failures) > 10_000:
            # Many distinct addresses: forget the ones whose failures all aged out.
            for address in [a for a, q in self._failures.items() if not q or q[-1] < horizon]:
                del self._failures[address]
        recent = self._failures.setdefault(client, deque())
        while recent and recent[0] < horizon:
            recent.popleft()
        return recent


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
