"""The daemon's private state on disk: a data dir only its user can enter, and files only its user
can read, written without following a symlink someone planted.

``private_dir`` creates a directory ``0700`` (tightening one of ours that is looser) and refuses,
with ``UnsafeDataDir``, one that another user owns or that others may write to: a pre-existing
directory is not trusted just because it is where the config points. ``write_private_file``
replaces a file atomically (a temp file made with ``O_EXCL | O_NOFOLLOW`` at ``0600``, then a
rename, which replaces a symlink instead of writing through it); ``read_private_file`` reads one
with ``O_NOFOLLOW`` (a symlink there is an ``OSError``); ``open_private_append`` opens a file for
appending with ``O_NOFOLLOW`` at ``0600``.

``lock_dir`` makes a directory one process's: it takes an exclusive ``flock`` on a lock file in
it (``0600``, no symlink followed) and writes the holder's pid there; a second taker, in this
process or another, gets ``DataDirInUse`` naming that pid at once instead of waiting. The kernel
lets go of the lock when its holder exits however it exits, so a lock file a killed process left
behind blocks nobody: the pid in it only says who held it last. The file stays in place when the
lock is released (removing it would let two processes lock two different files of one name).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import uuid
from pathlib import Path
from typing import BinaryIO

from apomesh.core.errors import StoreError

__all__ = [
    "DataDirInUse",
    "DirLock",
    "UnsafeDataDir",
    "lock_dir",
    "open_private_append",
    "private_dir",
    "read_private_file",
    "write_private_file",
]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UnsafeDataDir(StoreError):
    """A directory the daemon keeps secrets in is owned by another user, or others may write to
    it: starting there would trust whatever they left in it."""

    code = "unsafe_data_dir"
    retryable = False


class DataDirInUse(StoreError):
    """A directory another live process holds the lock of (``lock_dir``): ``pid`` is that
    process (``None`` when it has not written its pid yet)."""

    code = "data_dir_in_use"
    retryable = False

    def __init__(self, message: str, *, path: Path, pid: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user may enter: created ``0700`` when missing (parents
    too), tightened to ``0700`` when it is ours; ``UnsafeDataDir`` when it is not a directory,
    belongs to another user, or is group- or world-writable (a symlink is judged by what it
    points to, and must itself be ours or root's)."""
    path = Path(path)
    if not os.path.lexists(path):
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    me = os.geteuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise UnsafeDataDir(f"{path} is a symlink owned by uid {link.st_uid}, not by this user")
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UnsafeDataDir(f"{path} cannot be used: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDataDir(f"{path} is not a directory")
    if info.st_uid != me:
        raise UnsafeDataDir(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {me}): refusing to trust"
            " what another user may have put there; use a directory of your own"
        )
    if info.st_mode & 0o022:
        raise UnsafeDataDir(
            f"{path} is writable by {'others' if info.st_mode & 0o002 else 'its group'}"
            f" (mode {stat.S_IMODE(info.st_mode):04o}): anyone who can write there could plant"
            " files the daemon trusts; `chmod 700` it or use another directory"
        )
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def write_private_file(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data``, mode ``0600``, atomically and without following a symlink
    at ``path`` (the rename replaces the link itself). A private file that already holds ``data``
    is left as it is (a restart rewrites the same config and port files: no write, no sync).
    ``durable=False`` skips the sync, for a file that means nothing once the machine restarts (a
    running process's pid)."""
    path = Path(path)
    if _holds(path, data):
        return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is already a private file of ours (not a link) holding exactly ``data``."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size != len(data):
            return False
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != PRIVATE_FILE_MODE:
            return False
        return read_private_file(path) == data
    except OSError:
        return False


def read_private_file(path: Path) -> bytes:
    """The bytes of ``path``; ``OSError`` when it is missing or a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def open_private_append(path: Path) -> BinaryIO:
    """``path`` opened for appending (created ``0600``); refuses a symlink at ``path``."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)
    return os.fdopen(fd, "ab")


class DirLock:
    """The held lock of one directory (``lock_dir``); ``release`` lets go of it (once is
    enough; the process ending does too)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def lock_dir(directory: Path, name: str, *, what: str, holder: str) -> DirLock:
    """Hold ``directory`` for this process through ``directory/name``: an exclusive, non-blocking
    ``flock``, then this pid written in the file. ``DataDirInUse`` when another holder has it, its
    message naming ``what`` the directory is (e.g. ``data dir``), the directory, ``holder`` (what
    holds such a lock, e.g. ``apomesh serve``) and the pid that file names. The lock file is
    opened close-on-exec, so child processes do not hold it on."""
    directory = Path(directory)
    path = directory / name
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            raise DataDirInUse(
                f"{what} {directory} is in use by {holder} pid {pid if pid is not None else '?'}"
                f" (it holds the lock on {path}); stop that process first, or use another"
                " directory",
                path=directory,
                pid=pid,
            ) from None
        os.fchmod(fd, PRIVATE_FILE_MODE)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return DirLock(path, fd)


def _pid_in(fd: int) -> int | None:
    """The pid a lock file holds, ``None`` when it holds none yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        return int(text) if text else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
