"""Exporting a blob or a collection out of the store: a file, or a whole directory.

1. What is written is built beside ``dest`` under a temporary name and renamed into place,
   so a half-made export is never visible under ``dest``, and a failed one (no space, an
   I/O error, Ctrl-C) leaves nothing behind.
2. Bytes reach ``dest`` by reflink, hard link or copy (:data:`ExportLink`); with
   ``verify`` every chunk is hashed on the way (a rotten blob is quarantined).
3. The blob and a collection's children are leased for the whole export.
4. Exporting again where identical content already is writes nothing.
5. Free space is checked on ``dest``'s file system, not the store's, before bytes are
   copied: for the whole export at once when ``dest`` is on another file system (every
   byte is then copied), else file by file when a clone or link turned out impossible.

The partial and linked exports of ``blob export`` are :mod:`blobstore.export`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Literal

from blake3 import blake3

from blobstore.collection import CollectionEntry
from blobstore.durable import fsync_dir, os_errors, write_all
from blobstore.errors import BlobNotFound, CorruptChunk, NoSpace, PathNotFound, StoreError
from blobstore.layout import IO_BUFFER_SIZE, Layout, Progress, read_full, same_file
from blobstore.lease import Leases
from blobstore.partial import read_span
from blobstore.reading import Reader

ExportLink = Literal["reflink", "hardlink", "copy"]
_EXPORT_LINKS: tuple[ExportLink, ...] = ("reflink", "hardlink", "copy")
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_LINK_FALLBACK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.EACCES}


class Exporter:
    """Writing blobs and collections out of the store laid out as ``layout``.
    ``read_only``: another user's store, which cannot be leased (``locks/`` is its
    owner's alone)."""

    def __init__(
        self, layout: Layout, *, reader: Reader, leases: Leases, read_only: bool = False
    ) -> None:
        self.layout = layout
        self.reader = reader
        self.leases = leases
        self.read_only = read_only

    def export(
        self,
        blob_id: str,
        dest: Path | str,
        *,
        progress: Progress | None = None,
        verify: bool = True,
        link: ExportLink = "reflink",
    ) -> None:
        """Write the blob to ``dest``: a file, or for a collection a whole directory.

        ``link`` says how bytes reach ``dest``:

        * ``"reflink"`` (default): a copy-on-write clone where the file system supports
          it (btrfs, XFS: no bytes copied, the export is independent of the store), else
          a copy;
        * ``"hardlink"``: ``dest`` shares the store's read-only file (nothing copied,
          no extra space; do not ``chmod`` it writable and edit it, that would edit the
          store), else as ``"reflink"``;
        * ``"copy"``: always an independent copy.

        ``verify`` re-hashes every chunk on the way out (a clone or link is hashed by
        reading the store's file). Pass False right after fetching or verifying the blob:
        its chunks were checked as they arrived, and hashing again only costs time.

        Exporting again where identical content already is succeeds without writing
        (a file is compared chunk by chunk with the manifest, a directory file by file);
        a directory holding anything else is refused. A file is written beside ``dest``
        and renamed over it (an existing different file is replaced); a collection is
        built in a temp directory beside ``dest`` and renamed into place. The blob and a
        collection's children are leased for the whole export, so a concurrent gc
        cannot delete them half way (see :mod:`blobstore.lease`).
        """
        if link not in _EXPORT_LINKS:
            raise ValueError(f"link must be one of {', '.join(_EXPORT_LINKS)}, not {link!r}")
        # Another user's shared store cannot be leased (locks/ is the owner's alone).
        with contextlib.nullcontext() if self.read_only else self.leases.take([blob_id]):
            self._export(blob_id, Path(dest), progress, verify, link)

    def _export(
        self,
        blob_id: str,
        dest: Path,
        progress: Progress | None,
        verify: bool,
        link: ExportLink,
    ) -> None:
        parent = dest.parent.absolute()
        if not parent.is_dir():
            raise PathNotFound(f"directory {parent} does not exist")
        entries = self.reader.collection_entries(blob_id)
        if entries is not None:
            for e in entries:
                if not self.layout.has(e.blob_id):
                    raise BlobNotFound(
                        f"collection {blob_id[:12]} needs {e.path} (blob {e.blob_id}), "
                        "which is not complete in this store"
                    )
            if dest.exists() or dest.is_symlink():
                if not dest.is_dir() or dest.is_symlink():
                    raise StoreError(f"{dest} already exists and is not a directory")
                if any(dest.iterdir()):
                    if self._dir_matches(entries, dest):
                        if progress is not None:
                            progress(sum(e.size for e in entries))
                        return  # exported before: the same files are there
                    raise StoreError(
                        f"{dest} already exists with other content; give a new path or an "
                        "empty directory"
                    )
            self.check_export_space(parent, sum(e.size for e in entries), f"export {blob_id[:12]}")
            staging = parent / f".{dest.name}.blobnet-{secrets.token_hex(6)}"
            done = 0
            try:
                with os_errors(f"exporting to {dest}"):
                    staging.mkdir()
                    for e in entries:
                        target = staging.joinpath(*e.path.split("/"))
                        target.parent.mkdir(parents=True, exist_ok=True)
                        base = done

                        def child_progress(n: int, base: int = base) -> None:
                            if progress is not None:
                                progress(base + n)

                        self._export_file(e.blob_id, target, child_progress, verify, link)
                        done += e.size
                    os.rename(staging, dest)
                    fsync_dir(parent)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return
        if dest.is_dir():
            raise StoreError(f"{dest} is a directory; give a file path")
        if self.holds(blob_id, dest):
            if progress is not None:
                progress(self.reader.manifest(blob_id).size)
            return
        size = self.reader.manifest(blob_id).size
        self.check_export_space(parent, size, f"export {blob_id[:12]}")
        staging = parent / f".{dest.name}.blobnet-{secrets.token_hex(6)}"
        try:
            with os_errors(f"exporting to {dest}"):
                self._export_file(blob_id, staging, progress, verify, link)
                os.replace(staging, dest)
                fsync_dir(parent)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise

    def check_export_space(self, directory: Path, size: int, what: str) -> None:
        """Rule 5, for a whole export of ``size`` bytes into ``directory``: NoSpace when it
        is on another file system than the store's (where nothing can be cloned or linked,
        so every byte is copied) and they do not fit there."""
        with os_errors(f"checking {directory}"):
            elsewhere = os.stat(directory).st_dev != os.stat(self.layout.root).st_dev
        if elsewhere:
            check_free_space(directory, size, what)

    def holds(self, blob_id: str, path: Path | str) -> bool:
        """Whether ``path`` is a regular file (not a symlink) holding exactly the blob's
        bytes, checked cheaply: its size against the manifest's first, then the store's
        own file (a hard link), then every chunk's hash. The blob need not be complete
        here: a partial blob's manifest is enough."""
        manifest = self.reader.manifest(blob_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != manifest.size:
                return False
            if same_file(self.layout.data_path(blob_id), st):
                return True
            for i in range(manifest.num_chunks):
                offset, length = manifest.chunk_span(i)
                if blake3(read_span(fd, offset, length)).digest() != manifest.chunk_hash(i):
                    return False
            return True
        finally:
            os.close(fd)

    def _dir_matches(self, entries: list[CollectionEntry], dest: Path) -> bool:
        """Whether ``dest`` holds exactly the collection's files, each identical (empty
        directories aside), and nothing else."""
        found: set[str] = set()
        for dirpath, _dirs, filenames in os.walk(dest):
            for name in filenames:
                found.add((Path(dirpath) / name).relative_to(dest).as_posix())
        if found != {e.path for e in entries}:
            return False
        return all(self.holds(e.blob_id, dest.joinpath(*e.path.split("/"))) for e in entries)

    def _export_file(
        self,
        blob_id: str,
        target: Path,
        progress: Progress | None,
        verify: bool,
        link: ExportLink,
    ) -> None:
        size = self.reader.manifest(blob_id).size
        source = self.reader.path(blob_id)
        if link == "hardlink":
            try:
                os.link(source, target)
            except OSError as exc:
                if exc.errno not in _LINK_FALLBACK:
                    raise
            else:
                try:
                    if verify:
                        self._hash_through(blob_id, progress)
                except BaseException:
                    target.unlink(missing_ok=True)
                    raise
                if progress is not None:
                    progress(size)
                return
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            cloned = link != "copy" and size > 0 and _reflink(source, fd)
            if not cloned:  # rule 5: the bytes are copied, so they must fit where they go
                check_free_space(target.parent, size, f"export blob {blob_id[:12]}")
            if cloned:
                if verify:
                    self._hash_through(blob_id, progress)
            elif verify:
                done = 0
                for piece in self.reader.iter_verified(blob_id):
                    write_all(fd, piece)
                    done += len(piece)
                    if progress is not None:
                        progress(done)
            else:
                _copy_unhashed(source, fd, size, progress)
            if progress is not None:
                progress(size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _hash_through(self, blob_id: str, progress: Progress | None) -> None:
        """Read and check every chunk of the stored blob (quarantining it if rotten)."""
        done = 0
        for piece in self.reader.iter_verified(blob_id):
            done += len(piece)
            if progress is not None:
                progress(done)


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """NoSpace unless ``needed`` bytes are free to this user on ``directory``'s file system."""
    with os_errors(f"checking free space under {directory}"):
        st = os.statvfs(directory)
    available = st.f_bavail * st.f_frsize
    if needed > available:
        raise NoSpace(
            f"not enough disk space to {what}: need {needed} bytes, {available} available "
            f"under {directory}",
            needed=needed,
            available=available,
        )


def _reflink(source: Path, fd: int) -> bool:
    """Clone ``source`` into ``fd`` copy-on-write; False where unsupported."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FICLONE, src)
    except OSError:  # EOPNOTSUPP, EXDEV, EINVAL, ENOTTY: not here; copy instead
        return False
    finally:
        os.close(src)
    return True


def _copy_unhashed(source: Path, fd: int, size: int, progress: Progress | None) -> None:
    """Copy in the kernel (``copy_file_range``; some file systems clone), else by reads."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(src, fd, min(IO_BUFFER_SIZE, size - done))
                if n == 0:
                    break
                done += n
                if progress is not None:
                    progress(done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            os.lseek(src, done, os.SEEK_SET)
            os.lseek(fd, done, os.SEEK_SET)
            buf = memoryview(bytearray(IO_BUFFER_SIZE))
            while n := read_full(src, buf):
                write_all(fd, buf[:n])
                done += n
                if progress is not None:
                    progress(done)
        if done != size:
            raise CorruptChunk(f"{source} is {done} bytes on disk, its manifest says {size}")
    finally:
        os.close(src)
