"""API tokens: creation, listing, revocation and verification against a JSON file of hashes.

A token reads ``apm_<id>_<secret>``. The file (``tokens.json`` in the daemon's data dir, mode 0600)
keeps, per token, its id, a name, its role (``read`` or ``operator``), when it was made, when it
expires (never, unless made with an expiry) and the sha256 of its secret: the secret itself is
shown once, at creation, and stored nowhere. An expired token is refused like a revoked one. The id is
not secret; it lets an operator list and revoke tokens. Verification compares digests in constant
time. The file is re-read when it changes on disk (it is replaced, never rewritten in place), so
tokens made or revoked with the command line take effect in a running daemon. Every change holds
an exclusive ``flock`` on ``tokens.json.lock`` from reading the file to replacing it (a temporary
file, fsynced, renamed over it), so concurrent ``apomesh tokens`` runs and the daemon never lose
each other's changes.

Two more ways in, for a daemon's first start: ``add_static`` accepts a token given in the
configuration (``[http] token``, any text, kept only as a digest in memory) as an operator token,
and ``ensure_first_token`` makes an operator token when the store has none and writes it, mode
0600, to a file in the data dir, so a daemon that turns auth on never locks its operator out.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

Role = Literal["read", "operator"]
ROLES: tuple[Role, ...] = ("read", "operator")
TOKEN_PREFIX = "apm_"
TOKENS_FILE = "tokens.json"


class TokenInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One token as stored (and listed): never the secret, only its digest."""

    id: str
    name: str
    role: Role
    created_at: float
    secret_sha256: str
    expires_at: float | None = None

    @property
    def token_id(self) -> str:
        return self.id

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class _TokenFile(msgspec.Struct, kw_only=True):
    version: int = 1
    tokens: list[TokenInfo] = []


def role_allows(role: str, needed: str) -> bool:
    """Whether a token of ``role`` may do what needs ``needed`` (operator implies read)."""
    return role == needed or (role == "operator" and needed == "read")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def split_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, None otherwise."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    token_id, sep, secret = token[len(TOKEN_PREFIX) :].partition("_")
    if not sep or not token_id or not secret:
        return None
    return token_id, secret


class TokenStore:
    """Tokens kept hashed in one JSON file. Safe to share between threads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._tokens: dict[str, TokenInfo] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._static: list[TokenInfo] = []

    @classmethod
    def in_dir(cls, data_dir: str | os.PathLike[str]) -> TokenStore:
        """The store of a daemon's data dir (``<data>/tokens.json``)."""
        return cls(Path(data_dir) / TOKENS_FILE)

    def create(self, role: str, name: str, *, expires_in: float | None = None) -> tuple[str, str]:
        """Make a token, valid for ``expires_in`` seconds when given (else until revoked); returns
        (token_id, the full secret token) — the only time it is shown."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if expires_in is not None and expires_in <= 0:
            raise ValueError("a token's lifetime must be positive")
        checked: Role = "operator" if role == "operator" else "read"
        with self._changing():
            token_id = secrets.token_hex(6)
            while token_id in self._tokens:
                token_id = secrets.token_hex(6)
            secret = secrets.token_urlsafe(32)
            now = time.time()
            info = TokenInfo(
                id=token_id,
                name=name,
                role=checked,
                created_at=now,
                secret_sha256=_digest(secret),
                expires_at=now + expires_in if expires_in is not None else None,
            )
            self._tokens[token_id] = info
            self._save()
        return token_id, f"{TOKEN_PREFIX}{token_id}_{secret}"

    def list(self) -> list[TokenInfo]:
        with self._lock:
            self._load()
            return sorted(self._tokens.values(), key=lambda t: t.created_at)

    def revoke(self, token_id: str) -> bool:
        """Remove a token by id; False when there was none."""
        with self._changing():
            if self._tokens.pop(token_id, None) is None:
                return False
            self._save()
            return True

    def identify(self, token: str) -> TokenInfo | None:
        """The stored, unexpired token a presented one matches, or None."""
        info, _ = self.check(token)
        return info

    def check(self, token: str) -> tuple[TokenInfo | None, str]:
        """(the stored token a presented one matches, "") or (None, why it is refused:
        ``"unknown or revoked token"`` or ``"expired token"``)."""
        info = self._match(token)
        if info is None:
            return None, "unknown or revoked token"
        if info.expired(time.time()):
            return None, "expired token"
        return info, ""

    def add_static(self, token: str, name: str, role: str = "operator") -> None:
        """Accept ``token`` (any text, e.g. ``[http] token``) with ``role`` until the process
        ends; only its digest is kept."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        checked: Role = "operator" if role == "operator" else "read"
        info = TokenInfo(
            id=f"static-{len(self._static)}",
            name=name,
            role=checked,
            created_at=time.time(),
            secret_sha256=_digest(token),
        )
        with self._lock:
            self._static.append(info)

    def ensure_first_token(self, secret_file: str | os.PathLike[str]) -> bool:
        """When the store holds no token, make an operator token and write it to ``secret_file``
        (mode 0600; the only copy of the secret). True when one was made."""
        if self.list():
            return False
        _, token = self.create("operator", "first-start")
        path = Path(secret_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(token + "\n")
        return True

    def _match(self, token: str) -> TokenInfo | None:
        presented_digest = _digest(token)
        with self._lock:
            static = list(self._static)
        for configured in static:
            if hmac.compare_digest(configured.secret_sha256, presented_digest):
                return configured
        parts = split_token(token)
        with self._lock:
            self._load()
            info = self._tokens.get(parts[0]) if parts is not None else None
        # Compare even when the id is unknown so timing does not tell whether an id exists.
        expected = info.secret_sha256 if info is not None else _digest(secrets.token_hex(16))
        presented = _digest(parts[1] if parts is not None else token)
        if hmac.compare_digest(expected, presented) and info is not None:
            return info
        return None

    def verify(self, token: str) -> Role | None:
        """The role of a valid token, or None."""
        info = self.identify(token)
        return info.role if info is not None else None

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the thread lock and the file lock, with the tokens freshly read from disk."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_path = self.path.with_name(self.path.name + ".lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._load(force=True)
                yield
            finally:
                os.close(fd)  # releases the lock

    def _load(self, *, force: bool = False) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._tokens = {}
            self._stamp = None
            return
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp and not force:
            return
        data = msgspec.json.decode(self.path.read_bytes(), type=_TokenFile)
        self._tokens = {t.id: t for t in data.tokens}
        self._stamp = stamp

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = msgspec.json.encode(_TokenFile(tokens=list(self._tokens.values())))
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing temp file keeps its old mode otherwise
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash
        finally:
            os.close(directory)
        stat = self.path.stat()
        self._stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
