"""Writing a store: puts (bytes, files, directories) and partial blobs, and how either
is published.

Invariants 1 to 4 of :mod:`blobstore.store` hold here:

1. Data is hashed as it is copied (one pass) into ``tmp/``, fsynced, then linked into
   ``blobs/`` after its manifest, under the store lock; the slow fsync happens first.
2. Publication never overwrites: identical content already present is reused (its mtime
   refreshed for gc's grace), and the newcomer's temp is discarded.
3. A file that changes while it is read is refused (FileChanged), and a moved-in file
   written after its link is unpublished and given back.
4. A partial blob is exclusive per blob (its flock; PartialBusy names the holder), and
   publishing one clears any quarantine of its ID (:mod:`blobstore.quarantine`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from blake3 import blake3

from blobstore.collection import CollectionEntry, encode_collection
from blobstore.durable import (
    TempFile,
    claim_lock,
    fsync_dir,
    link_or_rename,
    lock_holder,
    lock_path,
    os_errors,
    write_all,
    write_file_atomic,
)
from blobstore.errors import BlobExists, FileChanged, PartialBusy, PathNotFound, StoreError
from blobstore.layout import (
    IO_BUFFER_SIZE,
    FileModes,
    Layout,
    Progress,
    mkdir_in_store,
    read_full,
    same_file,
)
from blobstore.lease import Lease, Leases
from blobstore.manifest import DEFAULT_CHUNK_SIZE, Manifest, check_chunk_size
from blobstore.manifests import Manifests
from blobstore.partial import OpenPartials, PartialBlob
from blobstore.quarantine import Quarantine
from blobstore.space import Space
from blobstore.store_lock import StoreLock


class _ChunkWriter:
    """Hashes a byte stream chunk by chunk while writing it to ``fd`` (one pass)."""

    def __init__(self, fd: int | None, chunk_size: int) -> None:
        self.fd = fd
        self.chunk_size = chunk_size
        self.pending = bytearray(chunk_size)
        self.fill = 0
        self.hashes = bytearray()
        self.size = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        c = self.chunk_size
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self.fill:
            take = min(len(view), c - self.fill)
            self.pending[self.fill : self.fill + take] = view[:take]
            self.fill += take
            view = view[take:]
            if self.fill < c:
                return
            self._emit(memoryview(self.pending))
            self.fill = 0
        whole = len(view) - len(view) % c
        if whole:
            for off in range(0, whole, c):
                self.hashes += blake3(view[off : off + c]).digest()
            if self.fd is not None:
                write_all(self.fd, view[:whole])
        rest = len(view) - whole
        if rest:
            self.pending[:rest] = view[whole:]
            self.fill = rest

    def _emit(self, chunk: memoryview) -> None:
        self.hashes += blake3(chunk).digest()
        if self.fd is not None:
            write_all(self.fd, chunk)

    def finish(self) -> Manifest:
        if self.fill:
            self._emit(memoryview(self.pending)[: self.fill])
            self.fill = 0
        return Manifest(size=self.size, chunk_size=self.chunk_size, hashes=bytes(self.hashes))


def blob_id_of(
    blocks: Iterable[bytes | bytearray | memoryview], *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> str:
    """The ID :meth:`Writer.put_blocks` gives the concatenation of ``blocks``, computed
    without a store: nothing is written."""
    check_chunk_size(chunk_size)
    writer = _ChunkWriter(None, chunk_size)
    for block in blocks:
        writer.feed(block)
    return writer.finish().blob_id


class Writer:
    """Puts, partial blobs and publication into the store laid out as ``layout``.
    ``io_buffer``: bytes per read of a file being put (a power of two)."""

    def __init__(
        self,
        layout: Layout,
        lock: StoreLock,
        modes: FileModes,
        *,
        space: Space,
        manifests: Manifests,
        partials: OpenPartials,
        quarantine: Quarantine,
        leases: Leases,
        io_buffer: int = IO_BUFFER_SIZE,
    ) -> None:
        self.layout = layout
        self.lock = lock
        self.modes = modes
        self.space = space
        self.manifests = manifests
        self.partials = partials
        self.quarantine = quarantine
        self.leases = leases
        self.io_buffer = io_buffer

    def put_bytes(
        self,
        data: bytes | bytearray | memoryview,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        lease: Lease | None = None,
    ) -> str:
        """Store ``data``; returns its blob ID.

        Every put takes ``lease``: the ID joins it under the same store lock that
        publishes the blob, so no gc can remove it before the caller tags or uses it."""
        return self.put_blocks([data], chunk_size=chunk_size, lease=lease)

    def put_blocks(
        self,
        blocks: Iterable[bytes | bytearray | memoryview],
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress: Progress | None = None,
        lease: Lease | None = None,
    ) -> str:
        """Store the concatenation of ``blocks`` (any sizes); returns its blob ID."""
        check_chunk_size(chunk_size)
        with os_errors("adding a blob to the store"), TempFile(self.layout.tmp) as tmp:
            writer = _ChunkWriter(tmp.fd, chunk_size)
            for block in blocks:
                writer.feed(block)
                if progress is not None:
                    progress(writer.size)
            return self._publish_temp(tmp, writer.finish(), lease)

    def put_path(
        self,
        path: Path | str,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        move: bool = False,
        progress: Progress | None = None,
        lease: Lease | None = None,
        follow_symlinks: bool = True,
    ) -> str:
        """Store the file at ``path``, hashing while copying; returns its blob ID.

        With ``move=True`` the file is hashed in place and linked into the store, then
        removed from ``path`` (no copy) when it lies on the store's file system and has
        no other hard links; otherwise it is copied and then removed.

        A file that changes while it is read (its size, mtime or inode differ before and
        after, or fewer or more bytes arrive than it had) is refused with
        :class:`FileChanged` and nothing is stored: the blob would match no state of it.
        A moved file is checked once more after it is linked in (a writer may still hold
        it open): if it was written meanwhile, it is unpublished and put back. A write
        after that check would edit the store's file itself, so move only files that no
        process still writes; ``verify`` finds (and quarantines) what such a write did.
        """
        check_chunk_size(chunk_size)
        path = Path(path)
        what = f"adding {path} to the store"
        with os_errors(what):
            nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
            try:
                # Non-blocking: a FIFO's open would wait for a writer before the type check
                # below could refuse it (reads of a regular file are the same either way).
                src = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | nofollow)
            except FileNotFoundError:
                raise PathNotFound(f"no such file: {path}") from None
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise StoreError(f"{path} is a symbolic link; not following it") from None
            try:
                st = os.fstat(src)
                if stat.S_ISDIR(st.st_mode):
                    raise StoreError(f"{path} is a directory; put it as a collection")
                if not stat.S_ISREG(st.st_mode):
                    raise StoreError(f"{path} is not a regular file")
                with contextlib.suppress(OSError):
                    os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                if move and st.st_nlink == 1 and st.st_dev == os.stat(self.layout.tmp).st_dev:
                    return self._move_in(path, src, st, chunk_size, progress, lease)
                self.space.check(st.st_size, f"copy {path} into the store")
                with TempFile(self.layout.tmp) as tmp:
                    writer = _ChunkWriter(tmp.fd, chunk_size)
                    buf = memoryview(bytearray(max(self.io_buffer, chunk_size)))
                    while n := read_full(src, buf):
                        writer.feed(buf[:n])
                        if progress is not None:
                            progress(writer.size)
                    _check_unchanged(path, src, st, writer.size)
                    blob_id = self._publish_temp(tmp, writer.finish(), lease)
            finally:
                os.close(src)
            if move:
                os.unlink(path)
            return blob_id

    def _move_in(
        self,
        path: Path,
        src: int,
        st: os.stat_result,
        chunk_size: int,
        progress: Progress | None,
        lease: Lease | None,
    ) -> str:
        """Hash ``path`` in place, then link it into the store and unlink ``path``."""
        writer = _ChunkWriter(None, chunk_size)
        buf = memoryview(bytearray(max(self.io_buffer, chunk_size)))
        while n := read_full(src, buf):
            writer.feed(buf[:n])
            if progress is not None:
                progress(writer.size)
        manifest = writer.finish()
        _check_unchanged(path, src, st, writer.size)
        blob_id = manifest.blob_id
        old_mode = stat.S_IMODE(st.st_mode)
        os.fchmod(src, self.modes.blob)
        try:
            os.fsync(src)
            with self.lock.hold():
                data_path = self.layout.data_path(blob_id)
                mkdir_in_store(data_path.parent, self.modes)
                moved = self._publish_locked(
                    manifest, lambda: link_or_rename(path, data_path, replace=False), lease
                )
        except BaseException:
            published = same_file(self.layout.data_path(blob_id), st)
            if not published:  # give the user's file its mode back
                with contextlib.suppress(OSError):
                    os.fchmod(src, old_mode)
            raise
        if not moved:  # identical content was already stored: the file is redundant
            os.unlink(path)
        elif _written_since(src, st):
            self._give_back(path, blob_id, old_mode, src)
        fsync_dir(path.parent.absolute())
        return blob_id

    def _give_back(self, path: Path, blob_id: str, old_mode: int, src: int) -> None:
        """A moved-in file was written between its last check and its link (a writer
        still had it open): the store's name for it would lie. Unpublish it, put the
        file back at ``path`` with its mode, and refuse (FileChanged)."""
        data_path = self.layout.data_path(blob_id)
        with self.lock.hold():
            try:
                os.link(data_path, path)
            except FileExistsError:  # a new file stands at ``path``: never drop the bytes
                self.quarantine.quarantine(blob_id, f"{path} was written while moved in")
                raise FileChanged(
                    f"{path} was written while it was being moved into the store, and a new "
                    f"file now stands there; the moved bytes are kept in "
                    f"{self.layout.quarantine_dir(blob_id) / 'data'}"
                ) from None
            data_path.unlink()
            self.layout.manifest_path(blob_id).unlink(missing_ok=True)
            fsync_dir(data_path.parent)
            self.manifests.forget(blob_id)
        os.fchmod(src, old_mode)
        fsync_dir(path.parent.absolute())
        raise FileChanged(
            f"{path} was written while it was being moved into the store, so nothing was "
            "stored; put it again once nothing is writing it"
        )

    def _ensure_manifest(self, manifest: Manifest) -> bool:
        """Publish the manifest file if missing (store lock held). True if created."""
        path = self.layout.manifest_path(manifest.blob_id)
        if path.exists():
            return False
        return write_file_atomic(
            path, manifest.encode(), tmp_dir=self.layout.tmp, replace=False, mode=self.modes.blob
        )

    def _reuse_existing(self, manifest: Manifest) -> bool:
        """If the blob is already complete, refresh its mtime (GC grace); store lock held."""
        data_path = self.layout.data_path(manifest.blob_id)
        if not data_path.exists():
            return False
        self._ensure_manifest(manifest)
        with contextlib.suppress(OSError):
            os.utime(data_path)
        return True

    def _publish_locked(
        self, manifest: Manifest, link_data: Callable[[], bool], lease: Lease | None = None
    ) -> bool:
        """Publish manifest then data (store lock held); False if the blob was already
        complete (then nothing of ours was used). On failure, removes a manifest this
        call created unless the data made it, so no orphan is left behind. The ID joins
        ``lease`` first, so it is protected from the moment it is visible."""
        blob_id = manifest.blob_id
        if lease is not None:
            lease.add([blob_id])
        data_path = self.layout.data_path(blob_id)
        mkdir_in_store(data_path.parent, self.modes)
        if self._reuse_existing(manifest):
            return False
        manifest_path = self.layout.manifest_path(blob_id)
        had_manifest = manifest_path.exists()
        try:
            self._ensure_manifest(manifest)
            if link_data():
                fsync_dir(data_path.parent)
        except BaseException:
            if not had_manifest and not data_path.exists():
                manifest_path.unlink(missing_ok=True)
            raise
        self.quarantine.clear(blob_id)  # good bytes again: the repair is done
        return True

    def _publish_temp(self, tmp: TempFile, manifest: Manifest, lease: Lease | None) -> str:
        """Publish a fully written temp file as the blob ``manifest`` describes."""
        blob_id = manifest.blob_id
        tmp.sync(self.modes.blob)  # the slow fsync happens before taking the store lock
        with self.lock.hold():
            data_path = self.layout.data_path(blob_id)
            mkdir_in_store(data_path.parent, self.modes)
            self._publish_locked(
                manifest, lambda: link_or_rename(tmp.path, data_path, replace=False), lease
            )
        tmp.discard()  # already gone if it was linked in; deleted if the blob existed
        return blob_id

    def _publish_partial(self, partial: PartialBlob, data: Path) -> None:
        """Called by PartialBlob.publish with the partial's lock held and data synced."""
        manifest = partial.manifest
        blob_id = manifest.blob_id
        with os_errors(f"publishing blob {blob_id[:12]}"), self.lock.hold():
            data_path = self.layout.data_path(blob_id)
            mkdir_in_store(data_path.parent, self.modes)
            try:
                self._publish_locked(
                    manifest, lambda: link_or_rename(data, data_path, replace=False)
                )
            finally:
                if data_path.exists():  # published (even if a later fsync failed)
                    shutil.rmtree(self.layout.partial_dir(blob_id), ignore_errors=True)
            fsync_dir(self.layout.partial)

    def begin_partial(self, manifest: Manifest) -> PartialBlob:
        """Create or resume the partial blob for ``manifest`` (exclusive per blob)."""
        blob_id = manifest.blob_id
        pdir = self.layout.partial_dir(blob_id)
        with os_errors(f"starting partial blob {blob_id[:12]}"):
            with self.lock.hold():
                if self.layout.has(blob_id):
                    raise BlobExists(f"blob {blob_id} is already complete in this store")
                mkdir_in_store(pdir, self.modes)
                lock_fd = lock_path(pdir / "lock")
                if lock_fd is not None:
                    try:
                        claim_lock(lock_fd)
                        self.quarantine.seed_partial(blob_id, pdir)
                    except BaseException:
                        os.close(lock_fd)
                        raise
            if lock_fd is None:
                raise PartialBusy(
                    f"blob {blob_id[:12]} is being written by {lock_holder(pdir / 'lock')}; "
                    "wait for it or stop that process",
                    blob_id,
                )
            data_fd = -1
            try:
                mpath = pdir / "manifest"
                encoded = manifest.encode()
                try:
                    on_disk: bytes | None = mpath.read_bytes()
                except FileNotFoundError:
                    on_disk = None
                if on_disk != encoded:
                    write_file_atomic(
                        mpath, encoded, tmp_dir=self.layout.tmp, replace=True, mode=self.modes.file
                    )
                data_fd = os.open(pdir / "data", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if stat.S_IMODE(os.fstat(data_fd).st_mode) != self.modes.file:
                    os.fchmod(data_fd, self.modes.file)
                data_existed = os.fstat(data_fd).st_size > 0
                if os.fstat(data_fd).st_size != manifest.size:
                    os.ftruncate(data_fd, manifest.size)  # sparse: blocks come as chunks land
                partial = PartialBlob(
                    manifest,
                    pdir,
                    lock_fd,
                    data_fd,
                    tmp_dir=self.layout.tmp,
                    modes=self.modes,
                    publish=self._publish_partial,
                    on_release=self.partials.forget,
                )
                self.partials.add(partial)
            except BaseException:
                if data_fd >= 0:
                    os.close(data_fd)
                os.close(lock_fd)
                raise
        try:
            partial.load_and_reverify(data_existed)
            with os_errors("checking free space"):
                self.space.check(self.space.to_finish(manifest), f"download blob {blob_id[:12]}")
        except BaseException:
            partial.release()
            raise
        return partial

    def partial_writer(self, blob_id: str) -> str | None:
        """Who writes ``blob_id``'s partial now ('process 1234'), or None when nobody
        does (no partial, or one whose writer has finished or died)."""
        lock = self.layout.partial_dir(blob_id) / "lock"
        if not lock.exists():
            return None
        try:
            fd = lock_path(lock)
        except OSError:  # the partial went (published or removed) meanwhile
            return None
        if fd is None:
            return lock_holder(lock)
        os.close(fd)
        return None

    def put_dir(
        self,
        path: Path | str,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress: Progress | None = None,
        follow_symlinks: bool = False,
        lease: Lease | None = None,
    ) -> str:
        """Store every file under directory ``path`` and a collection naming them.

        Symbolic links are refused unless ``follow_symlinks``: a link can point outside
        the directory (``~/.ssh/id_ed25519``), and a collection would then publish that
        file to every peer. With it, links to files and directories are followed (a
        directory reached twice through links is refused, so loops end). Every child is
        leased from the moment it is published, so a concurrent gc cannot remove it
        before the collection that names it exists.
        """
        root = Path(path)
        if not root.is_dir():
            raise PathNotFound(f"no such directory: {root}")
        files: list[tuple[str, Path, int]] = []
        seen_dirs: set[tuple[int, int]] = set()
        with os_errors(f"reading directory {root}"):
            for dirpath, dirnames, filenames in os.walk(
                root, onerror=_raise, followlinks=follow_symlinks
            ):
                st = os.stat(dirpath)
                if (st.st_dev, st.st_ino) in seen_dirs:
                    raise StoreError(f"{dirpath} is reached twice through symbolic links")
                seen_dirs.add((st.st_dev, st.st_ino))
                dirnames.sort()
                for d in dirnames:
                    if not follow_symlinks and os.path.islink(os.path.join(dirpath, d)):
                        raise StoreError(
                            f"{os.path.join(dirpath, d)} is a symbolic link; collections "
                            "hold files only (pass --follow-symlinks to follow links)"
                        )
                for name in sorted(filenames):
                    full = Path(dirpath) / name
                    if not follow_symlinks and full.is_symlink():
                        raise StoreError(
                            f"{full} is a symbolic link (to {os.readlink(full)}); refusing "
                            "to publish what may lie outside the directory (pass "
                            "--follow-symlinks to follow links)"
                        )
                    if not full.is_file():
                        raise StoreError(f"{full} is not a regular file")
                    rel = full.relative_to(root).as_posix()
                    try:
                        rel.encode("utf-8")
                    except UnicodeEncodeError:
                        raise StoreError(f"{full} has a name that is not UTF-8") from None
                    files.append((rel, full, full.stat().st_size))
            self.space.check(sum(f[2] for f in files), f"copy {root} into the store")
        own_lease = lease is None
        held = self.leases.take() if lease is None else lease
        try:
            entries = []
            done = 0
            for rel, full, _size in files:
                base = done

                def child_progress(n: int, base: int = base) -> None:
                    if progress is not None:
                        progress(base + n)

                blob_id = self.put_path(
                    full,
                    chunk_size=chunk_size,
                    progress=child_progress,
                    lease=held,
                    follow_symlinks=follow_symlinks,
                )
                size = self.manifests.get(blob_id).size
                entries.append(CollectionEntry(path=rel, blob_id=blob_id, size=size))
                done += size
            return self.put_bytes(encode_collection(entries), chunk_size=chunk_size, lease=held)
        finally:
            if own_lease:
                held.release()


def _check_unchanged(path: Path, fd: int, before: os.stat_result, read: int) -> None:
    """Refuse a file that changed while it was read: the blob would match no state of it."""
    after = os.fstat(fd)
    try:
        now_ino = os.stat(path).st_ino
    except FileNotFoundError:
        now_ino = -1
    fields = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino", "st_dev")
    if (
        read != before.st_size
        or now_ino != before.st_ino
        or any(getattr(after, f) != getattr(before, f) for f in fields)
    ):
        raise FileChanged(
            f"{path} changed while it was being read, so nothing was stored; "
            "put it again once nothing is writing it"
        )


def _written_since(fd: int, before: os.stat_result) -> bool:
    """Whether the open file's size or modification time moved since ``before``."""
    after = os.fstat(fd)
    return (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns)


def _raise(exc: OSError) -> None:
    raise exc
