"""Where a store keeps what (the layout of :mod:`blobstore.store`), and the modes it gives it.

:class:`Layout` is a value: the store root and the paths under it, with the questions a
path answers alone (is a blob complete, is a partial there, which IDs are listed). It holds
no lock and caches nothing, so every part of the store may ask it anything at any time.

1. ``blobs/<ab>/<id>`` is a complete blob and ``blobs/<ab>/<id>.manifest`` its manifest;
   ``partial/<id>/``, ``quarantine/<id>/``, ``tags/<name>``, ``tmp/`` and ``locks/`` hold
   the rest (the table in :mod:`blobstore.store`).
2. A listing names only entries whose name is a blob ID (and, for partial and quarantined
   blobs, that still have a manifest): stray files are never taken for blobs.
3. Directories are made with the store's modes exactly, whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blobstore.durable import os_errors
from blobstore.errors import BadBlobId, StoreError
from blobstore.manifest import parse_blob_id

Progress = Callable[[int], None]

IO_BUFFER_SIZE = 8 * 1024 * 1024
"""Bytes per read/write syscall when copying: large enough that syscall and Python
overhead vanish next to hashing, small enough to stay in L2/L3-friendly territory and
keep memory flat. Always a multiple of the chunk size (both are powers of two)."""

MANIFEST_SUFFIX = ".manifest"
DIRS = ("blobs", "partial", "tags", "tmp", "locks", "quarantine")
PRIVATE_DIRS = ("tmp", "locks")  # 0700 whatever the store's mode


@dataclass(frozen=True)
class FileModes:
    """The permission bits the store gives what it creates (set explicitly, not by umask).

    Private (the default): only the owner can read anything (the root directory is 0700,
    so even files created by an older version behind it are out of reach). Shared: other
    users may read blobs, manifests, tags and partial data (a job under another account
    can mmap a checkpoint) but never write or lock anything: ``tmp/`` and ``locks/`` stay
    0700 and lock files 0600, so no other user can take the store lock or a partial's.
    """

    dir: int
    blob: int  # complete blobs and their manifests: read-only
    file: int  # tags, bitmaps, partial data and manifests, the format marker


PRIVATE_MODES = FileModes(dir=0o700, blob=0o400, file=0o600)
SHARED_MODES = FileModes(dir=0o755, blob=0o444, file=0o644)


@dataclass(frozen=True)
class Layout:
    """The paths of the store rooted at ``root`` (rule 1) and what they say alone."""

    root: Path

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def partial(self) -> Path:
        return self.root / "partial"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def tags(self) -> Path:
        return self.root / "tags"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def data_path(self, blob_id: str) -> Path:
        return self.blobs / blob_id[:2] / blob_id

    def manifest_path(self, blob_id: str) -> Path:
        return self.blobs / blob_id[:2] / (blob_id + MANIFEST_SUFFIX)

    def partial_dir(self, blob_id: str) -> Path:
        return self.partial / blob_id

    def quarantine_dir(self, blob_id: str) -> Path:
        return self.quarantine / blob_id

    def has(self, blob_id: str) -> bool:
        """Whether the complete blob is in the store."""
        parse_blob_id(blob_id)
        return self.data_path(blob_id).exists()

    def has_partial(self, blob_id: str) -> bool:
        return (self.partial_dir(blob_id) / "manifest").exists()

    def make_dirs(self, modes: FileModes) -> None:
        """Every directory of rule 1, with exactly its mode (``tmp/``, ``locks/``: 0700)."""
        for name in DIRS:
            _mkdir(self.root / name, 0o700 if name in PRIVATE_DIRS else modes.dir)

    def complete_ids(self, shard: str | None = None) -> list[str]:
        """IDs of complete blobs (in one ``shard``, the IDs' first two characters)."""
        shards = [shard] if shard is not None else sorted(os.listdir(self.blobs))
        ids: list[str] = []
        for s in shards:
            try:
                names = os.listdir(self.blobs / s)
            except (FileNotFoundError, NotADirectoryError):
                continue
            ids.extend(n for n in names if is_blob_id(n) and n.startswith(s))
        return sorted(ids)

    def partial_ids(self) -> list[str]:
        """IDs of partial blobs present (held by anyone or no one)."""
        with os_errors("listing partial blobs"):
            return _ids_with_manifest(self.partial)

    def quarantined_ids(self) -> list[str]:
        """IDs of quarantined blobs, sorted."""
        with os_errors("listing quarantined blobs"):
            return _ids_with_manifest(self.quarantine)


def mkdir_in_store(path: Path, modes: FileModes) -> None:
    """Make ``path`` (a directory of the store) with ``modes.dir``, if it is missing."""
    if not path.is_dir():
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=modes.dir)
            os.chmod(path, modes.dir)  # exactly, whatever the umask


def _mkdir(path: Path, mode: int) -> None:
    """Make a directory with exactly ``mode`` (umask aside), fixing an existing one."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        if not path.is_dir() or path.is_symlink():
            raise StoreError(f"{path} should be a directory of the store") from None
        if stat.S_IMODE(path.stat().st_mode) == mode:
            return
    os.chmod(path, mode)


def _ids_with_manifest(directory: Path) -> list[str]:
    return sorted(
        e.name
        for e in os.scandir(directory)
        if is_blob_id(e.name) and os.path.exists(os.path.join(e.path, "manifest"))
    )


def read_full(fd: int, view: memoryview) -> int:
    """readinto ``view`` until it is full or EOF; returns bytes read."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


def same_file(path: Path, st: os.stat_result) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def is_blob_id(name: str) -> bool:
    try:
        parse_blob_id(name)
    except BadBlobId:
        return False
    return True
