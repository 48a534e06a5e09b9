"""``write_private_file``: atomic, mode 0600, never through a symlink, and a file that already
holds the bytes is left as it is (a restart rewrites the same config and port files)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from apomesh.adapters.private_files import PRIVATE_FILE_MODE, write_private_file


def test_a_new_file_is_written_private(tmp_path: Path) -> None:
    path = tmp_path / "config"
    write_private_file(path, b"port: 4222\n")
    assert path.read_bytes() == b"port: 4222\n"
    assert stat.S_IMODE(path.stat().st_mode) == PRIVATE_FILE_MODE
    assert [p.name for p in tmp_path.iterdir()] == ["config"]  # no temporary file left


def test_the_same_bytes_leave_the_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "config"
    write_private_file(path, b"port: 4222\n")
    before = path.stat()
    write_private_file(path, b"port: 4222\n")
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_other_bytes_replace_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pid"
    write_private_file(path, b"100\n", durable=False)
    write_private_file(path, b"200\n", durable=False)
    assert path.read_bytes() == b"200\n"


def test_the_same_bytes_under_a_looser_mode_are_written_again_private(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_bytes(b"secret\n")
    os.chmod(path, 0o644)
    write_private_file(path, b"secret\n")
    assert stat.S_IMODE(path.stat().st_mode) == PRIVATE_FILE_MODE


def test_a_symlink_holding_the_same_bytes_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret\n")
    os.chmod(target, PRIVATE_FILE_MODE)
    link = tmp_path / "config"
    link.symlink_to(target)
    write_private_file(link, b"secret\n")
    assert not link.is_symlink()
    assert link.read_bytes() == b"secret\n"
    assert target.read_bytes() == b"secret\n"
