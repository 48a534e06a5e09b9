"""The built-in tools: workspace file tools, an HTTP client, asking a human, explicit checkpoints
and a sleep job.

File tools are confined to the ``ToolContext``'s workspace. A path is resolved the way
``openat2(RESOLVE_BENEATH)`` does it: one component at a time, each directory opened with
``O_NOFOLLOW`` relative to the file descriptor of the one before (``WorkspacePath``), a symlink met
on the way read with ``readlinkat`` and its target resolved by the same rules, so neither an
absolute path elsewhere, ``..`` past the root, a symlink pointing outside, nor a symlink swapped in
while a call runs can reach outside the workspace; the final open is ``O_NOFOLLOW`` too. Reading
and appending refuse what is not a regular file (a FIFO is opened ``O_NONBLOCK`` and refused
without blocking) and a file with other hard links (which could be a file outside). File I/O runs
in a worker thread (``anyio.to_thread.run_sync``) so a tool never blocks the event loop.
``fs.write`` rewrites a whole file and ``fs.append`` appends one line.

Both keep an effect ledger per target file under ``<workspace>/.apomesh/effects/`` (which no tool
may write) and change the file only under that ledger's ``flock`` (waited for at most
``LOCK_TIMEOUT``). Under the lock an effect (1) settles the ledger's pending entry, if a crash left
one (did its bytes land? the file says), (2) is refused when a newer dispatch (a higher epoch) of
the same agent has reached this file — so a frozen worker that wakes after its agent was resumed
elsewhere cannot land its stale write — (3) is answered from the ledger when its effect id
(``ctx.idempotency_key``) already happened, (4) records itself as pending (the file's size and the
digest of the bytes it adds), (5) changes the file, (6) records itself done. Their probes, asked
about an unknown outcome, take the same lock, settle the pending entry, raise the agent's epoch on
the file (fencing the older dispatch from then on) and answer from the ledger: the effect happened
(with its result) or did not (the call may run now); a lock not had in time cannot tell.

``http.request`` sends one HTTP request from the worker. A GET or HEAD is read-only (not
journaled); any other method is a side effect whose request carries the call's idempotency key
in its ``Idempotency-Key`` header, so a service that deduplicates by that header applies it once;
an unknown outcome is held for an operator. Redirects are not followed (a redirect is an answer
the model sees), proxies from the environment are not used, and the answer's body is cut at
``MAX_HTTP_BODY`` bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from apomesh.core.errors import OutcomeUnknown, ToolError
from apomesh.plugins.api import ProbeResult, Tool, ToolContext, ToolProbe

log = logging.getLogger("apomesh.tools")

MAX_READ_BYTES = 1 << 20
"""``fs.read`` refuses files larger than this, so one call cannot flood a conversation."""
MAX_SYMLINKS = 40
"""Symlinks one path may go through (the kernel's own limit), so a loop ends in an error."""

LEDGER_DIR = ".apomesh"
"""The workspace directory holding the file tools' effect ledgers; no tool writes into it."""
LOCK_TIMEOUT = 10.0
"""How long an effect or a probe waits for its file's ledger lock before giving up."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o644


class WorkspacePath(msgspec.Struct):
    """A resolved path: ``dir_fd`` is the open directory holding the final component ``name``,
    or, when ``name`` is ``""``, the directory the path names; ``parts`` are the components from
    the workspace root. Valid inside ``open_in_workspace`` only, which closes the descriptors."""

    dir_fd: int
    name: str
    parts: tuple[str, ...]


def _parts(path: str) -> list[str]:
    return [part for part in PurePosixPath(path).parts if part not in ("/", ".")]


@contextlib.contextmanager
def open_in_workspace(
    workspace: Path, path: str, *, tool: str = "", make_dirs: bool = False
) -> Iterator[WorkspacePath]:
    """``path`` resolved inside ``workspace`` component by component (see the module text);
    ``ToolError`` when it would leave it. ``make_dirs`` creates missing parent directories."""
    prefix = f"{tool}: " if tool else ""
    if not path or "\x00" in path:
        raise ToolError(f"{prefix}path {path!r} is not a usable file name")
    root = workspace.resolve()
    candidate = Path(path)
    lexical = Path(os.path.normpath(root / candidate))
    if not lexical.is_relative_to(root):
        if candidate.is_absolute():
            raise ToolError(f"{prefix}absolute path {path!r} is outside the workspace")
        raise ToolError(f"{prefix}path {path!r} climbs out of the workspace with '..'")
    outside = ToolError(f"{prefix}path {path!r} goes through a symlink to outside the workspace")
    pending = list(lexical.relative_to(root).parts)
    stack: list[tuple[str, int]] = [("", os.open(root, _DIR_FLAGS))]
    links = 0
    try:
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if len(stack) == 1:
                    raise outside
                os.close(stack.pop()[1])
                continue
            current = stack[-1][1]
            target = _symlink_target(part, current)
            if target is not None:
                links += 1
                if links > MAX_SYMLINKS:
                    raise ToolError(f"{prefix}path {path!r} goes through too many symlinks")
                if os.path.isabs(target):
                    absolute = Path(os.path.normpath(target))
                    if not absolute.is_relative_to(root):
                        raise outside
                    while len(stack) > 1:
                        os.close(stack.pop()[1])
                    target = str(absolute.relative_to(root))
                pending[:0] = _parts(target)
                continue
            if not pending:
                # The final component: the caller opens it with O_NOFOLLOW.
                yield WorkspacePath(current, part, (*(n for n, _ in stack[1:]), part))
                return
            stack.append((part, _open_dir(part, current, prefix, path, make_dirs)))
        # Every component was a directory (the root itself, say): the path names stack[-1].
        yield WorkspacePath(stack[-1][1], "", tuple(n for n, _ in stack[1:]))
    finally:
        for _, fd in stack:
            with contextlib.suppress(OSError):
                os.close(fd)


def _symlink_target(name: str, dir_fd: int) -> str | None:
    """What the symlink ``name`` in ``dir_fd`` points to, or None when it is not a symlink."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
            return None
        raise


def _open_dir(name: str, dir_fd: int, prefix: str, path: str, make_dirs: bool) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not make_dirs:
            raise ToolError(f"{prefix}no such directory on the way to {path!r}: {name}") from None
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dir_fd)
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            raise ToolError(
                f"{prefix}cannot open {name} on the way to {path!r}: {exc.strerror}"
            ) from None
    except NotADirectoryError:
        raise ToolError(f"{prefix}{name} on the way to {path!r} is not a directory") from None
    except OSError as exc:
        # ELOOP: swapped to a symlink after it was checked; the call is refused, never followed.
        raise ToolError(
            f"{prefix}cannot open {name} on the way to {path!r}: {exc.strerror}"
        ) from None


def resolve_in_workspace(workspace: Path, path: str, *, tool: str = "") -> Path:
    """The path ``path`` names inside ``workspace`` (symlinks inside it resolved), or
    ``ToolError`` when it would leave it. Touches the file system, so call it off the event loop."""
    with open_in_workspace(workspace, path, tool=tool) as where:
        return workspace.resolve().joinpath(*where.parts)


def _str_arg(tool: str, args: dict[str, Any], key: str, default: str | None = None) -> str:
    value = args.get(key, default)
    if not isinstance(value, str):
        raise ToolError(f"{tool}: argument `{key}` must be a string")
    return value


def _open_file(where: WorkspacePath, flags: int, tool: str, path: str) -> int:
    """The final component opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be a regular
    file with no other hard links."""
    if not where.name:
        raise ToolError(f"{tool}: {path} is a directory")
    try:
        fd = os.open(
            where.name,
            flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            _FILE_MODE,
            dir_fd=where.dir_fd,
        )
    except FileNotFoundError:
        raise ToolError(f"{tool}: no such file: {path}") from None
    except IsADirectoryError:
        raise ToolError(f"{tool}: {path} is a directory (use fs.list)") from None
    except OSError as exc:
        # ELOOP (a symlink swapped in), ENXIO (a FIFO with no reader) and the like.
        raise ToolError(f"{tool}: cannot open {path}: {exc.strerror}") from None
    info = os.fstat(fd)
    problem = None
    if stat.S_ISDIR(info.st_mode):
        problem = f"{path} is a directory (use fs.list)"
    elif not stat.S_ISREG(info.st_mode):
        problem = f"{path} is not a regular file"
    elif info.st_nlink > 1:
        problem = f"{path} has other hard links, which could be files outside the workspace"
    if problem is not None:
        os.close(fd)
        raise ToolError(f"{tool}: {problem}")
    os.set_blocking(fd, True)
    return fd


def _read(workspace: Path, path: str) -> str:
    with open_in_workspace(workspace, path, tool="fs.read") as where:
        fd = _open_file(where, os.O_RDONLY, "fs.read", path)
        with os.fdopen(fd, "rb") as handle:
            size = os.fstat(fd).st_size
            if size > MAX_READ_BYTES:
                raise ToolError(
                    f"fs.read: {path} is {size} bytes, over the limit of {MAX_READ_BYTES}"
                )
            data = handle.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        raise ToolError(f"fs.read: {path} is over the limit of {MAX_READ_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"fs.read: {path} is not UTF-8 text") from None


def _list(workspace: Path, path: str) -> str:
    with open_in_workspace(workspace, path, tool="fs.list") as where:
        if where.name:
            try:
                fd = os.open(where.name, _DIR_FLAGS, dir_fd=where.dir_fd)
            except FileNotFoundError:
                raise ToolError(f"fs.list: no such directory: {path}") from None
            except OSError:
                raise ToolError(f"fs.list: {path} is not a directory") from None
        else:
            fd = os.dup(where.dir_fd)
        try:
            with os.scandir(fd) as entries:
                names = sorted(
                    e.name + ("/" if e.is_dir(follow_symlinks=False) else "")
                    for e in entries
                    if where.parts or e.name != LEDGER_DIR
                )
        finally:
            os.close(fd)
    return "\n".join(names)


# --- the effect ledger ----------------------------------------------------------------------------


class Effect(msgspec.Struct):
    """One file-tool call as its ledger knows it: ``writer`` (``session/agent``) and ``epoch``
    fence it, ``effect_id`` names it across dispatches, ``path`` is the target's workspace path."""

    tool: str
    path: str
    writer: str
    epoch: int
    effect_id: str


def effect_of(ctx: ToolContext, tool: str, path: str) -> Effect:
    """The ``Effect`` of a call made in ``ctx``: its id is the session and agent with
    ``ctx.idempotency_key`` when the context has one, else with the journal key of the call
    running now (both stable across re-dispatch, restart and resume)."""
    key = getattr(ctx, "idempotency_key", "") or getattr(ctx, "call_key", "")
    if not key:
        raise ToolError(f"{tool}: this context names no call to fence the effect by")
    writer = f"{ctx.session_id}/{ctx.agent}"
    return Effect(tool, path, writer, ctx.epoch, f"{writer}/{key}")


def ledger_name(parts: tuple[str, ...]) -> str:
    """The ledger file stem of the workspace file at ``parts`` (its components from the root)."""
    return hashlib.sha256("/".join(parts).encode("utf-8")).hexdigest()[:40]


def ledger_lock_path(workspace: Path, path: str) -> Path:
    """The lock file guarding the workspace file ``path`` (its directories must exist)."""
    with open_in_workspace(workspace, path) as where:
        name = ledger_name(where.parts)
    return workspace.resolve() / LEDGER_DIR / "effects" / f"{name}.lock"


class _Ledger:
    """A target file's ledger, read and written under its lock (see the module text)."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self.dir_fd = dir_fd
        self.name = f"{name}.json"
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            data: dict[str, Any] = {}
        else:
            with os.fdopen(fd, "rb") as handle:
                data = json.loads(handle.read() or b"{}")
        self.epochs: dict[str, int] = data.get("epochs", {})
        self.pending: dict[str, Any] | None = data.get("pending")
        self.done: dict[str, str] = data.get("done", {})

    def save(self, *, sync: bool = True) -> None:
        """Store the ledger; ``sync=False`` only where a lost save is re-decided from the file
        (a done entry whose pending one is on disk)."""
        data = {"epochs": self.epochs, "pending": self.pending, "done": self.done}
        encoded = json.dumps(data, sort_keys=True).encode("utf-8")
        _replace_file(self.dir_fd, self.name, encoded, sync=sync)


@contextlib.contextmanager
def _locked_ledger(workspace: Path, where: WorkspacePath, tool: str) -> Iterator[_Ledger]:
    """The ledger of the file ``where`` names, under its ``flock`` (``ToolError`` after
    ``LOCK_TIMEOUT``)."""
    root = os.open(workspace.resolve(), _DIR_FLAGS)
    try:
        top = _open_dir(LEDGER_DIR, root, f"{tool}: ", LEDGER_DIR, True)
        try:
            effects = _open_dir("effects", top, f"{tool}: ", LEDGER_DIR, True)
        finally:
            os.close(top)
    finally:
        os.close(root)
    try:
        name = ledger_name(where.parts)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        lock_fd = os.open(f"{name}.lock", flags, _FILE_MODE, dir_fd=effects)
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT
            waited = False
            while True:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not waited:
                        log.info("%s waits for the lock of %s", tool, "/".join(where.parts))
                        waited = True
                    if time.monotonic() >= deadline:
                        raise ToolError(
                            f"{tool}: another writer held {'/'.join(where.parts)} for over "
                            f"{LOCK_TIMEOUT:g} s"
                        ) from None
                    time.sleep(0.02)
            ledger = _Ledger(effects, name)
            _settle(ledger, where)
            yield ledger
        finally:
            os.close(lock_fd)  # releases the flock
    finally:
        os.close(effects)


def _settle(ledger: _Ledger, where: WorkspacePath) -> None:
    """Decide the pending entry a crash left: done when its bytes are in the file, else gone
    (a half-appended line is cut off first)."""
    pending = ledger.pending
    if pending is None:
        return
    landed = False
    try:
        fd = os.open(where.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=where.dir_fd)
    except OSError:
        fd = -1
    if fd >= 0:
        with os.fdopen(fd, "r+b") as handle:
            if pending["kind"] == "write":
                landed = hashlib.sha256(handle.read()).hexdigest() == pending["digest"]
            else:
                offset, length = pending["offset"], pending["length"]
                handle.seek(offset)
                added = handle.read(length)
                landed = hashlib.sha256(added).hexdigest() == pending["digest"]
                if not landed and len(added) < length and os.fstat(fd).st_size > offset:
                    handle.truncate(offset)
                    os.fsync(fd)
    if landed:
        ledger.done[pending["id"]] = pending["result"]
    ledger.pending = None
    ledger.save()


def _fence(ledger: _Ledger, effect: Effect) -> None:
    newest = ledger.epochs.get(effect.writer, 0)
    if newest > effect.epoch:
        refused = ToolError(
            f"{effect.tool}: {effect.path} was reached by a newer dispatch of this agent "
            f"(epoch {newest}); this one (epoch {effect.epoch}) is stale and does not change it"
        )
        log.warning("%s refused for %s: %s", effect.tool, effect.writer, refused.message)
        raise refused
    ledger.epochs[effect.writer] = effect.epoch


def _replace_file(dir_fd: int, name: str, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to a temporary file, fsync it (unless not ``sync``), rename it over
    ``name`` (a crash never leaves a half file; a symlink swapped in at ``name`` is replaced, not
    followed)."""
    tmp = f".{name[:200]}.{uuid.uuid4().hex[:12]}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, _FILE_MODE, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _target(workspace: Path, effect: Effect) -> contextlib.AbstractContextManager[WorkspacePath]:
    if _parts(effect.path)[:1] == [LEDGER_DIR]:
        raise ToolError(f"{effect.tool}: {LEDGER_DIR}/ holds the tools' own records")
    return open_in_workspace(workspace, effect.path, tool=effect.tool, make_dirs=True)


def _write(workspace: Path, effect: Effect, content: str) -> str:
    path = effect.path
    data = content.encode("utf-8")
    result = f"wrote {len(data)} bytes to {path}"
    with _target(workspace, effect) as where:
        if not where.name:
            raise ToolError(f"fs.write: {path} is a directory")
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(
                os.stat(where.name, dir_fd=where.dir_fd, follow_symlinks=False).st_mode
            ):
                raise ToolError(f"fs.write: {path} is a directory")
        with _locked_ledger(workspace, where, "fs.write") as ledger:
            _fence(ledger, effect)
            if effect.effect_id in ledger.done:
                ledger.save(sync=False)
                return ledger.done[effect.effect_id]
            digest = hashlib.sha256(data).hexdigest()
            ledger.pending = {"id": effect.effect_id, "kind": "write", "digest": digest}
            ledger.pending["result"] = result
            ledger.save()
            try:
                _replace_file(where.dir_fd, where.name, data)
            except OSError as exc:
                # ENOENT: the directory was removed (or swapped away) while the call ran.
                raise ToolError(f"fs.write: cannot write {path}: {exc.strerror}") from None
            ledger.done[effect.effect_id] = result
            ledger.pending = None
            ledger.save(sync=False)
    return result


def _append(workspace: Path, effect: Effect, line: str) -> str:
    if "\n" in line or "\r" in line:
        raise ToolError("fs.append: `line` must be one line (no line breaks)")
    path = effect.path
    data = (line + "\n").encode("utf-8")
    result = f"appended 1 line to {path}"
    with _target(workspace, effect) as where:
        fd = _open_file(where, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "fs.append", path)
        with os.fdopen(fd, "ab") as handle, _locked_ledger(workspace, where, "fs.append") as ledger:
            _fence(ledger, effect)
            if effect.effect_id in ledger.done:
                ledger.save(sync=False)
                return ledger.done[effect.effect_id]
            ledger.pending = {
                "id": effect.effect_id,
                "kind": "append",
                "offset": os.fstat(fd).st_size,
                "length": len(data),
                "digest": hashlib.sha256(data).hexdigest(),
                "result": result,
            }
            ledger.save()
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
            ledger.done[effect.effect_id] = result
            ledger.pending = None
            ledger.save(sync=False)
    return result


def _probe(workspace: Path, effect: Effect) -> ProbeResult:
    try:
        with _target(workspace, effect) as where:
            if not where.name:
                return ProbeResult("cannot_tell", reason=f"{effect.path} is a directory")
            with _locked_ledger(workspace, where, effect.tool) as ledger:
                _fence(ledger, effect)
                ledger.save()  # from now on an older dispatch cannot land its effect here
                if effect.effect_id in ledger.done:
                    return ProbeResult("happened", result=ledger.done[effect.effect_id])
                return ProbeResult("not_happened")
    except ToolError as exc:
        return ProbeResult("cannot_tell", reason=exc.message)


async def fs_read(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.read", args, "path")
    return await anyio.to_thread.run_sync(_read, ctx.workspace, path)


async def fs_list(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.list", args, "path", ".")
    return await anyio.to_thread.run_sync(_list, ctx.workspace, path)


async def fs_write(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.write", args, "path")
    content = _str_arg("fs.write", args, "content")
    effect = effect_of(ctx, "fs.write", path)
    return await anyio.to_thread.run_sync(_write, ctx.workspace, effect, content)


async def fs_append(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = _str_arg("fs.append", args, "path")
    line = _str_arg("fs.append", args, "line")
    effect = effect_of(ctx, "fs.append", path)
    return await anyio.to_thread.run_sync(_append, ctx.workspace, effect, line)


def _file_probe(tool: str) -> ToolProbe:
    async def probe(ctx: ToolContext, args: dict[str, Any]) -> ProbeResult:
        path = _str_arg(tool, args, "path")
        return await anyio.to_thread.run_sync(_probe, ctx.workspace, effect_of(ctx, tool, path))

    return probe


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
HTTP_READ_ONLY = ("GET", "HEAD")
IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_HTTP_BODY = 64 * 1024
"""``http.request`` answers with at most this many bytes of a response's body."""
HTTP_TIMEOUT = 30.0
"""Seconds ``http.request`` waits for a response (connecting, sending, each read)."""


def _http_method(args: dict[str, Any]) -> str:
    method = args.get("method", "GET")
    return method.upper() if isinstance(method, str) else ""


def http_read_only(args: dict[str, Any]) -> bool:
    """Whether an ``http.request`` call is read-only (a GET or a HEAD)."""
    return _http_method(args) in HTTP_READ_ONLY


async def http_request(ctx: ToolContext, args: dict[str, Any]) -> str:
    tool = "http.request"
    url = _str_arg(tool, args, "url")
    method = _http_method(args)
    if method not in HTTP_METHODS:
        raise ToolError(f"{tool}: `method` must be one of {', '.join(HTTP_METHODS)}")
    if not url.startswith(("http://", "https://")):
        raise ToolError(f"{tool}: `url` must be an http:// or https:// URL")
    given = args.get("headers", {})
    if not isinstance(given, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in given.items()
    ):
        raise ToolError(f"{tool}: `headers` must map names to string values")
    headers = {k: v for k, v in given.items() if k.lower() != IDEMPOTENCY_HEADER.lower()}
    if method not in HTTP_READ_ONLY:
        key = getattr(ctx, "idempotency_key", "")
        if not key:
            raise ToolError(f"{tool}: a {method} needs the call's idempotency key")
        headers[IDEMPOTENCY_HEADER] = key
    import httpx  # imported on first use: it is a fifth of a second of every process's start

    body = _str_arg(tool, args, "body", "")
    try:
        async with (
            httpx.AsyncClient(timeout=HTTP_TIMEOUT, trust_env=False) as client,
            client.stream(method, url, headers=headers, content=body.encode() or None) as response,
        ):
            data = b""
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_HTTP_BODY:
                    break
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as exc:
        # Never sent: the call did not happen.
        raise ToolError(f"{tool}: {method} {url} failed: {type(exc).__name__}: {exc}") from None
    except httpx.HTTPError as exc:
        failed = f"{tool}: {method} {url} failed: {type(exc).__name__}: {exc}"
        if method in HTTP_READ_ONLY:
            raise ToolError(failed) from None
        # Sent, and no whole answer came back: whether the server acted is not known.
        raise OutcomeUnknown(f"{failed}; whether it took effect is not known") from None
    text = data[:MAX_HTTP_BODY].decode(response.encoding or "utf-8", errors="replace")
    if len(data) > MAX_HTTP_BODY:
        text += f"\n[cut at {MAX_HTTP_BODY} bytes]"
    kind = response.headers.get("content-type", "")
    answer = f"HTTP {response.status_code} {response.reason_phrase}" + (
        f"\ncontent-type: {kind}" if kind else ""
    )
    if "location" in response.headers:
        answer += f"\nlocation: {response.headers['location']}"
    answer += f"\n\n{text}" if text else ""
    if response.status_code >= 400:
        raise ToolError(f"{tool}: {answer}")
    return answer


async def ask_human(ctx: ToolContext, args: dict[str, Any]) -> str:
    question = _str_arg("ask_human", args, "question")
    if not question.strip():
        raise ToolError("ask_human: `question` must not be empty")
    return await ctx.ask_human(question)


async def checkpoint_now(ctx: ToolContext, args: dict[str, Any]) -> str:
    await ctx.checkpoint_now()
    return "checkpoint taken"


async def jobs_sleep(ctx: ToolContext, args: dict[str, Any]) -> str:
    seconds = args.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ToolError("jobs.sleep: argument `seconds` must be a non-negative number")
    await anyio.sleep(seconds)
    return f"slept {seconds:g} s"


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "A path relative to the workspace."}

BUILTIN_TOOLS: list[Tool] = [
    Tool(
        name="fs.read",
        description="Read a UTF-8 text file from the workspace.",
        run=fs_read,
        parameters=_schema({"path": _PATH}, ["path"]),
    ),
    Tool(
        name="fs.list",
        description="List a workspace directory; directory names end with '/'.",
        run=fs_list,
        parameters=_schema({"path": {**_PATH, "default": "."}}, []),
    ),
    Tool(
        name="fs.write",
        description="Write a whole file in the workspace (replacing it), creating directories.",
        run=fs_write,
        parameters=_schema(
            {"path": _PATH, "content": {"type": "string", "description": "The whole new content."}},
            ["path", "content"],
        ),
        side_effect=True,
        idempotent=True,
        on_unknown="rerun",
        probe=_file_probe("fs.write"),
    ),
    Tool(
        name="fs.append",
        description="Append one line of text to a file in the workspace, creating it if needed.",
        run=fs_append,
        parameters=_schema(
            {"path": _PATH, "line": {"type": "string", "description": "One line, no line breaks."}},
            ["path", "line"],
        ),
        side_effect=True,
        idempotent=False,
        on_unknown="fail",
        probe=_file_probe("fs.append"),
    ),
    Tool(
        name="http.request",
        description=(
            "Send an HTTP request and read the answer. GET and HEAD only read; any other method "
            "changes something and is sent at most once."
        ),
        run=http_request,
        parameters=_schema(
            {
                "url": {"type": "string", "description": "An http:// or https:// URL."},
                "method": {"type": "string", "enum": list(HTTP_METHODS), "default": "GET"},
                "headers": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "Request headers.",
                },
                "body": {"type": "string", "description": "The request body, as text."},
            },
            ["url"],
        ),
        side_effect=True,
        idempotent=False,
        on_unknown="hold",
        read_only_when=http_read_only,
    ),
    Tool(
        name="ask_human",
        description="Ask a human operator a question and wait for the answer.",
        run=ask_human,
        parameters=_schema({"question": {"type": "string"}}, ["question"]),
    ),
    Tool(
        name="checkpoint.now",
        description="Take an explicit checkpoint of this agent now.",
        run=checkpoint_now,
        parameters=_schema({}, []),
    ),
    Tool(
        name="jobs.sleep",
        description="A long-running job that waits the given number of seconds.",
        run=jobs_sleep,
        parameters=_schema(
            {"seconds": {"type": "number", "minimum": 0, "description": "How long to wait."}},
            ["seconds"],
        ),
        async_job=True,
    ),
]
