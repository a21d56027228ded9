"""A published file is never overwritten (DESIGN section 3; STYLE rule 7).

``link_or_rename(replace=False)`` is the last guard behind the store lock's existence
check: a second publisher that reaches it with the name already taken must keep what is
there (same bytes, same inode, so open readers, memory maps and hard-linked exports see
one file) and leave its own file for the caller to discard. A plain ``os.replace`` in its
place passed every other store test.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from blobstore import durable


def two_files(tmp_path: Path) -> tuple[Path, Path]:
    target = tmp_path / "published"
    target.write_bytes(b"first publisher")
    source = tmp_path / "late"
    source.write_bytes(b"late publisher")
    return source, target


def test_no_overwrite_keeps_the_published_file(tmp_path: Path) -> None:
    source, target = two_files(tmp_path)
    inode = target.stat().st_ino
    assert durable.link_or_rename(source, target, replace=False) is False
    assert target.read_bytes() == b"first publisher"
    assert target.stat().st_ino == inode
    assert source.read_bytes() == b"late publisher"  # left for the caller to discard


def test_no_overwrite_holds_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """File systems without hard links take the existence check and rename instead."""

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported here")

    monkeypatch.setattr(durable.os, "link", no_links)
    source, target = two_files(tmp_path)
    assert durable.link_or_rename(source, target, replace=False) is False
    assert target.read_bytes() == b"first publisher"
    fresh = tmp_path / "fresh"
    assert durable.link_or_rename(source, fresh, replace=False) is True
    assert fresh.read_bytes() == b"late publisher"
    assert not source.exists()


def test_durable_write_without_replace_keeps_what_is_there(tmp_path: Path) -> None:
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    target = tmp_path / "manifest"
    assert durable.write_file_atomic(target, b"one", tmp_dir=tmp_dir, replace=False) is True
    inode = target.stat().st_ino
    assert durable.write_file_atomic(target, b"two", tmp_dir=tmp_dir, replace=False) is False
    assert target.read_bytes() == b"one"
    assert target.stat().st_ino == inode
    assert not os.listdir(tmp_dir)  # the loser's temp file is gone
    assert durable.write_file_atomic(target, b"two", tmp_dir=tmp_dir, replace=True) is True
    assert target.read_bytes() == b"two"
