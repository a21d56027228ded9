"""The chunked BLAKE3 blob store (DESIGN section 3).

Theory of operation
===================

Layout under the store root::

    blobnet-store            marker with the format version; refuse foreign dirs
    shared                   present only in a shared store (see File modes)
    locks/store              flock: held briefly around every publish and delete;
                             holds the holder's PID
    blobs/<ab>/<id>          complete blob: its exact bytes, read-only
    blobs/<ab>/<id>.manifest its canonical manifest, read-only
    partial/<id>/            partial blob: manifest, data, bitmap, lock (partial.py)
    quarantine/<id>/         a blob found rotten: data, manifest, reason
    tags/<name>              "<id>\\n": a name that pins a blob
    tmp/                     temp files of writers in progress, each flock-ed
    names/, peers/           the network layer's own files (p2p.names_cache: signed
                             name records; p2p.peer_memory: peers that sent bad data)

File modes
----------

Set explicitly on everything the store creates (the umask plays no part):

=================================  ===========  ==========
what                               private      shared
=================================  ===========  ==========
root, blobs/, partial/, tags/ ...  0700         0755
complete blobs and manifests       0400         0444
tags, bitmaps, partial data        0600         0644
tmp/, locks/                       0700         0700
lock files (store, partials)       0600         0600
=================================  ===========  ==========

A store is private unless opened once with ``Store.open(root, shared=True)`` (or
``blob store-mode shared``), which writes the ``shared`` marker and re-modes what is
there; ``shared=False`` turns it back. The mode belongs to the store, not to whoever
opens it. Shared means other users can read blobs (mmap a checkpoint, run their own
reader) but write or lock nothing: no one but the owner can open a lock file, so no one
else can make the owner's commands wait. The store lock is waited for at most
:data:`STORE_LOCK_TIMEOUT` seconds, then StoreBusy (exit 5) names the holder's PID.

Invariants
----------

1. **A complete blob appears only whole.** Its data is written to ``tmp/``, fsynced,
   then hard-linked to ``blobs/<ab>/<id>``, and the directory fsynced. The manifest is
   published the same way *before* the data, so whoever sees the data finds the manifest
   (a crash between the two leaves a manifest alone; open and gc remove it).
2. **Nothing overwrites a published blob.** Publication uses ``link`` (which fails on an
   existing name): when two writers race with the same content, the first wins and the
   second discards its temp. A published blob is never modified; ``rm`` and ``gc`` are
   the only ways it goes.
3. **An ID names only matching bytes.** The ID is computed from the bytes as they are
   copied (one pass: read, hash, write), never trusted from outside; partial chunks are
   hashed before they are written and again on every reopen (partial.py rules 1 to 4).
4. **Every durable write goes through** :mod:`blobstore.durable` (temp, fsync,
   link/replace, fsync dir). A crash anywhere leaves either the old state or the new
   one, plus at most unlocked temp files that the next :meth:`Store.open` sweeps.
5. **Processes share the store.** Writers hold flocks on their temp files and partial
   locks; sweeps and GC remove only what they can lock. The store lock
   (``locks/store``) serialises publish, delete, quarantine, lease and tag changes
   (never the long hashing), so GC cannot delete a blob at the moment a concurrent
   ``put`` decides to reuse it. Every lock file is 0600 in the 0700 ``locks/`` (and
   partial locks 0600), so only the owner can take one; waits for the store lock end
   in StoreBusy after ``lock_timeout``, and partial locks are never waited for
   (PartialBusy names the holder's PID at once).
6. **GC never deletes** a tagged or leased blob (or, transitively, a child of a tagged
   or leased collection), a partial someone holds, or anything modified within the
   grace period. Re-putting existing content refreshes its mtime, as git does for
   loose objects. A lease (:mod:`blobstore.lease`, ``locks/lease-*``) is alive exactly
   while its holder's flock on it is; an ID joins a lease under the store lock before
   (or as) it is published, so there is no instant at which gc may take it.
7. OSError is translated into the typed errors of :mod:`blobstore.errors` at the public
   methods; a failed operation removes what it created.
8. **Rot is quarantined, never served.** A complete blob whose bytes fail a chunk hash
   (found by :meth:`Store.verify`, a verifying read, or a caller such as a server) is
   moved to ``quarantine/`` by :meth:`Store.quarantine`: unpublished at once. Publishing
   the same ID again (``put`` or a fetched partial, which starts from the rotten copy's
   good chunks) repairs it and clears the quarantine. Only the file whose bytes failed
   is quarantined (a reader that opened it before a repair leaves the repaired file
   alone), and a repair never takes over a quarantined file shared with a hard-linked
   export. A tagged quarantined blob that may be a collection stops gc rather than let
   it guess which children the collection pins.
9. **Modes are the store's, not the umask's** (see File modes): private by default; a
   shared store is readable by others but lockable and writable by the owner only.
   Another user opens it read-only (:attr:`Store.read_only`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from blake3 import blake3

from blobstore import bitmap as bm
from blobstore.collection import (
    COLLECTION_MAGIC,
    MAX_COLLECTION_SIZE,
    CollectionEntry,
    decode_collection_pieces,
    encode_collection,
    looks_like_collection,
)
from blobstore.durable import (
    TRASH_PREFIX,
    TempFile,
    claim_lock,
    delete_trash,
    fsync_dir,
    link_or_rename,
    lock_holder,
    lock_path,
    os_errors,
    sweep_temp_dir,
    translate_os_error,
    try_lock_fd,
    write_all,
    write_file_atomic,
)
from blobstore.errors import (
    AmbiguousPrefix,
    BadBlobId,
    BadCollection,
    BadManifest,
    BadTagName,
    BlobExists,
    BlobNotFound,
    BlobQuarantined,
    ChunkUnavailable,
    CorruptChunk,
    FileChanged,
    NoSpace,
    PartialBusy,
    PathNotFound,
    StoreBusy,
    StoreCorrupt,
    StoreError,
)
from blobstore.lease import Lease, create_lease, live_leased_ids
from blobstore.manifest import (
    DEFAULT_CHUNK_SIZE,
    HASH_SIZE,
    MAX_MANIFEST_SIZE,
    Manifest,
    check_chunk_size,
    parse_blob_id,
)
from blobstore.partial import PartialBlob, load_bitmap, read_span
from blobstore.reader import ChunkReader

Progress = Callable[[int], None]

STORE_FORMAT = 1
MARKER_NAME = "blobnet-store"
_LAYOUT = ("blobs", "partial", "tags", "tmp", "locks", "quarantine")
_PRIVATE_DIRS = ("tmp", "locks")  # 0700 whatever the store's mode
SHARED_MARKER = "shared"
"""File at the root whose presence makes the store shared (see :class:`FileModes`)."""

STORE_LOCK_TIMEOUT = 10.0
"""Seconds to wait for the store lock before failing with StoreBusy (exit 5). The lock is
held only around publishes, deletes, tag changes and one gc pass: milliseconds, seconds
for gc of a very large store. Waiting longer means a stuck or hostile holder; say so
rather than hang. Override with ``Store.open(lock_timeout=...)`` or the environment
variable named by :data:`LOCK_TIMEOUT_ENV`."""
LOCK_TIMEOUT_ENV = "BLOBNET_LOCK_TIMEOUT"
_LOCK_POLL_MAX = 0.02  # seconds between tries at most: contention is short


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

IO_BUFFER_SIZE = 8 * 1024 * 1024
"""Bytes per read/write syscall when copying: large enough that syscall and Python
overhead vanish next to hashing, small enough to stay in L2/L3-friendly territory and
keep memory flat. Always a multiple of the chunk size (both are powers of two)."""

DEFAULT_GC_GRACE = 3600.0
"""Seconds an untagged blob survives GC after it was last put: long enough for a
script to ``put`` then ``tag`` (or a collection's children to wait for their parent)."""

MIN_PREFIX = 8
"""Shortest ID prefix accepted: 32 bits keeps accidental matches rare in a local store."""

TAG_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-fA-F]+")
_MANIFEST_SUFFIX = ".manifest"
_MANIFEST_CACHE_SIZE = 256  # manifests are immutable; cache a few for chunk serving
_MAX_REASON = 500  # characters of a quarantine reason kept: one line of an error message


@dataclass(frozen=True)
class BlobInfo:
    """One row of :meth:`Store.list_blobs`."""

    blob_id: str
    size: int
    chunk_size: int
    complete: bool
    verified_chunks: int
    tags: tuple[str, ...]
    quarantined: bool = False

    @property
    def num_chunks(self) -> int:
        return -(-self.size // self.chunk_size)


def check_tag_name(name: str) -> None:
    """Raise BadTagName unless ``name`` is usable as a tag."""
    if not isinstance(name, str) or TAG_NAME_RE.fullmatch(name) is None:
        raise BadTagName(
            f"bad tag name {name!r}: use 1-128 letters, digits and ._@+- "
            "(starting with a letter or digit)"
        )
    if len(name) >= MIN_PREFIX and _HEX_RE.fullmatch(name):
        raise BadTagName(f"bad tag name {name!r}: it would read as a blob ID prefix")


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


def _read_full(fd: int, view: memoryview) -> int:
    """readinto ``view`` until it is full or EOF; returns bytes read."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


class Store:
    """A local blob store rooted at a directory. Create with :meth:`Store.open`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp_dir = root / "tmp"
        self._blobs = root / "blobs"
        self._partial = root / "partial"
        self._quarantine = root / "quarantine"
        self._tags = root / "tags"
        self._locks = root / "locks"
        self._lock_file = self._locks / "store"
        self.modes = PRIVATE_MODES
        self.lock_timeout = STORE_LOCK_TIMEOUT
        self.read_only = False  # another user's shared store: reads only
        self._lock_mutex = threading.Lock()  # threads of this process queue here first
        self._lock_owner: int | None = None  # thread holding the store lock (re-entry)
        self._mutex = threading.Lock()
        self._open_partials: dict[str, PartialBlob] = {}
        self._manifests: dict[str, Manifest] = {}

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls, root: Path | str, *, shared: bool | None = None, lock_timeout: float | None = None
    ) -> Store:
        """Open (creating if needed) the store at ``root`` and sweep dead temp files.

        ``shared``: None keeps the store's mode (a new store is private); True or False
        sets it, re-moding what is there (see :class:`FileModes`). Switch while no other
        process writes the store: one already running keeps creating files with the
        modes it opened with. ``lock_timeout``:
        seconds to wait for the store lock (default :data:`STORE_LOCK_TIMEOUT`, or the
        environment's :data:`LOCK_TIMEOUT_ENV`).

        Another user's shared store opens read-only (:attr:`read_only`): nothing is
        created, re-moded or swept, and whatever would write fails with exit 5.
        """
        root = Path(root).expanduser().absolute()
        timeout = _lock_timeout(lock_timeout)
        with os_errors(f"opening the store at {root}"):
            if root.is_dir() and root.stat().st_uid != os.geteuid():
                return cls._open_foreign(root, shared, timeout)
            created = not root.exists()
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            marker = root / MARKER_NAME
            if not marker.exists():
                allowed = {*_LAYOUT, "lock", MARKER_NAME, SHARED_MARKER}
                foreign = {p.name for p in root.iterdir()} - allowed
                if foreign:
                    raise StoreError(
                        f"{root} is not empty and is not a blobnet store; "
                        "choose another --store directory"
                    )
            was_shared = (root / SHARED_MARKER).exists()
            is_shared = was_shared if shared is None else shared
            modes = SHARED_MODES if is_shared else PRIVATE_MODES
            if created or stat.S_IMODE(root.stat().st_mode) != modes.dir:
                os.chmod(root, modes.dir)
            for name in _LAYOUT:
                _mkdir(root / name, 0o700 if name in _PRIVATE_DIRS else modes.dir)
            store = cls(root)
            store.modes = modes
            store.lock_timeout = timeout
            if not marker.exists():
                write_file_atomic(
                    marker,
                    f"blobnet store format {STORE_FORMAT}\n".encode(),
                    tmp_dir=root / "tmp",
                    replace=False,
                    mode=modes.file,
                )
            text = marker.read_text(errors="replace").strip()
            if text != f"blobnet store format {STORE_FORMAT}":
                raise StoreError(f"{root} holds an unsupported store format ({text!r})")
            (root / "lock").unlink(missing_ok=True)  # before locks/: anyone could flock it
            if is_shared != was_shared:
                store._set_shared(is_shared)
            store._sweep()
        return store

    @classmethod
    def _open_foreign(cls, root: Path, shared: bool | None, timeout: float) -> Store:
        if shared is not None:
            raise StoreError(f"only the owner of {root} can change who may read it")
        text = (root / MARKER_NAME).read_text(errors="replace").strip()
        if text != f"blobnet store format {STORE_FORMAT}":
            raise StoreError(f"{root} is not a blobnet store this version can read ({text!r})")
        store = cls(root)
        store.modes = SHARED_MODES if (root / SHARED_MARKER).exists() else PRIVATE_MODES
        store.lock_timeout = timeout
        store.read_only = True
        return store

    def _set_shared(self, shared: bool) -> None:
        """Switch the store's mode: marker first, then every directory and file."""
        marker = self.root / SHARED_MARKER
        if shared:
            write_file_atomic(
                marker,
                b"other users may read this store\n",
                tmp_dir=self.tmp_dir,
                replace=True,
                mode=self.modes.file,
            )
        else:
            marker.unlink(missing_ok=True)
        for name in (MARKER_NAME, SHARED_MARKER):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.root / name, self.modes.file)
        for top in ("blobs", "partial", "tags", "quarantine"):
            for dirpath, _dirnames, filenames in os.walk(self.root / top):
                os.chmod(dirpath, self.modes.dir)
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    if name == "lock":
                        mode = 0o600
                    elif top == "blobs":
                        mode = self.modes.blob
                    else:
                        mode = self.modes.file
                    with contextlib.suppress(FileNotFoundError):
                        os.chmod(full, mode, follow_symlinks=False)
        fsync_dir(self.root)

    @property
    def shared(self) -> bool:
        """Whether other users may read this store (see :class:`FileModes`)."""
        return self.modes == SHARED_MODES

    def _sweep(self) -> None:
        """Remove temp files, partial leftovers and leases that no live process holds."""
        sweep_temp_dir(self.tmp_dir)
        with self._store_lock():
            self._remove_orphan_manifests()
            live_leased_ids(self._locks)
            for entry in os.scandir(self._partial):
                fd = lock_path(Path(entry.path) / "lock")
                if fd is None:
                    continue
                try:
                    has_manifest = os.path.exists(os.path.join(entry.path, "manifest"))
                    if not has_manifest or self.has(entry.name):
                        shutil.rmtree(entry.path, ignore_errors=True)
                finally:
                    os.close(fd)

    def _remove_orphan_manifests(self) -> None:
        """Delete manifests whose data never arrived (a crash between the two renames).

        Store lock held: no publication is half done, so every such manifest is dead.
        """
        for shard in os.scandir(self._blobs):
            names = set(os.listdir(shard.path))
            for name in names:
                if name.endswith(_MANIFEST_SUFFIX) and name[: -len(_MANIFEST_SUFFIX)] not in names:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(shard.path, name))

    @contextlib.contextmanager
    def _store_lock(self) -> Iterator[None]:
        """Hold the store lock; StoreBusy (exit 5) after ``lock_timeout`` seconds.

        The lock file lives in ``locks/`` (0700) with mode 0600, so no other user can open
        it, let alone flock it. The holder writes its PID into it, so a waiter that gives
        up can say who holds it."""
        if self._lock_owner == threading.get_ident():  # nested: e.g. quarantine during gc
            yield
            return
        deadline = time.monotonic() + self.lock_timeout
        if not self._lock_mutex.acquire(timeout=self.lock_timeout):
            raise StoreBusy(
                f"the store at {self.root} is busy: another thread of this process has held "
                f"its lock for over {self.lock_timeout:g} s"
            )
        try:
            fd = os.open(
                self._lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
            try:
                delay = 0.001
                while not try_lock_fd(fd):
                    now = time.monotonic()
                    if now >= deadline:
                        raise StoreBusy(
                            f"the store at {self.root} is busy: {_lock_holder(fd)} has held its "
                            f"lock for over {self.lock_timeout:g} s; wait for it or stop it "
                            f"(or raise {LOCK_TIMEOUT_ENV})"
                        )
                    time.sleep(min(delay, deadline - now))
                    delay = min(delay * 2, _LOCK_POLL_MAX)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._lock_owner = threading.get_ident()
                try:
                    yield
                finally:
                    self._lock_owner = None
            finally:
                os.close(fd)
        finally:
            self._lock_mutex.release()

    def _mkdir_in_store(self, path: Path) -> None:
        if not path.is_dir():
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=self.modes.dir)
                os.chmod(path, self.modes.dir)  # exactly, whatever the umask

    # ------------------------------------------------------------------ paths
    def _data_path(self, blob_id: str) -> Path:
        return self._blobs / blob_id[:2] / blob_id

    def _manifest_path(self, blob_id: str) -> Path:
        return self._blobs / blob_id[:2] / (blob_id + _MANIFEST_SUFFIX)

    def _partial_dir(self, blob_id: str) -> Path:
        return self._partial / blob_id

    # ------------------------------------------------------------------ putting
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
        with os_errors("adding a blob to the store"), TempFile(self.tmp_dir) as tmp:
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
                src = os.open(path, os.O_RDONLY | os.O_CLOEXEC | nofollow)
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
                if move and st.st_nlink == 1 and st.st_dev == os.stat(self.tmp_dir).st_dev:
                    return self._move_in(path, src, st, chunk_size, progress, lease)
                self._check_space(st.st_size, f"copy {path} into the store")
                with TempFile(self.tmp_dir) as tmp:
                    writer = _ChunkWriter(tmp.fd, chunk_size)
                    buf = memoryview(bytearray(max(IO_BUFFER_SIZE, chunk_size)))
                    while n := _read_full(src, buf):
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
        buf = memoryview(bytearray(max(IO_BUFFER_SIZE, chunk_size)))
        while n := _read_full(src, buf):
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
            with self._store_lock():
                data_path = self._data_path(blob_id)
                self._mkdir_in_store(data_path.parent)
                moved = self._publish_locked(
                    manifest, lambda: link_or_rename(path, data_path, replace=False), lease
                )
        except BaseException:
            published = _same_file(self._data_path(blob_id), st)
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
        data_path = self._data_path(blob_id)
        with self._store_lock():
            try:
                os.link(data_path, path)
            except FileExistsError:  # a new file stands at ``path``: never drop the bytes
                self.quarantine(blob_id, f"{path} was written while moved in")
                raise FileChanged(
                    f"{path} was written while it was being moved into the store, and a new "
                    f"file now stands there; the moved bytes are kept in "
                    f"{self._quarantine / blob_id / 'data'}"
                ) from None
            data_path.unlink()
            self._manifest_path(blob_id).unlink(missing_ok=True)
            fsync_dir(data_path.parent)
            with self._mutex:
                self._manifests.pop(blob_id, None)
        os.fchmod(src, old_mode)
        fsync_dir(path.parent.absolute())
        raise FileChanged(
            f"{path} was written while it was being moved into the store, so nothing was "
            "stored; put it again once nothing is writing it"
        )

    def _check_space(self, needed: int, what: str) -> None:
        available = self.free_bytes()
        if needed > available:
            raise NoSpace(
                f"not enough disk space to {what}: need {needed} bytes, "
                f"{available} available under {self.root}",
                needed=needed,
                available=available,
            )

    def _ensure_manifest(self, manifest: Manifest) -> bool:
        """Publish the manifest file if missing (store lock held). True if created."""
        path = self._manifest_path(manifest.blob_id)
        if path.exists():
            return False
        return write_file_atomic(
            path, manifest.encode(), tmp_dir=self.tmp_dir, replace=False, mode=self.modes.blob
        )

    def _reuse_existing(self, manifest: Manifest) -> bool:
        """If the blob is already complete, refresh its mtime (GC grace); store lock held."""
        data_path = self._data_path(manifest.blob_id)
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
        data_path = self._data_path(blob_id)
        self._mkdir_in_store(data_path.parent)
        if self._reuse_existing(manifest):
            return False
        manifest_path = self._manifest_path(blob_id)
        had_manifest = manifest_path.exists()
        try:
            self._ensure_manifest(manifest)
            if link_data():
                fsync_dir(data_path.parent)
        except BaseException:
            if not had_manifest and not data_path.exists():
                manifest_path.unlink(missing_ok=True)
            raise
        self._clear_quarantine(blob_id)  # good bytes again: the repair is done
        return True

    def _publish_temp(self, tmp: TempFile, manifest: Manifest, lease: Lease | None) -> str:
        """Publish a fully written temp file as the blob ``manifest`` describes."""
        blob_id = manifest.blob_id
        tmp.sync(self.modes.blob)  # the slow fsync happens before taking the store lock
        with self._store_lock():
            data_path = self._data_path(blob_id)
            self._mkdir_in_store(data_path.parent)
            self._publish_locked(
                manifest, lambda: link_or_rename(tmp.path, data_path, replace=False), lease
            )
        tmp.discard()  # already gone if it was linked in; deleted if the blob existed
        return blob_id

    def _publish_partial(self, partial: PartialBlob, data: Path) -> None:
        """Called by PartialBlob.publish with the partial's lock held and data synced."""
        manifest = partial.manifest
        blob_id = manifest.blob_id
        with os_errors(f"publishing blob {blob_id[:12]}"), self._store_lock():
            data_path = self._data_path(blob_id)
            self._mkdir_in_store(data_path.parent)
            try:
                self._publish_locked(
                    manifest, lambda: link_or_rename(data, data_path, replace=False)
                )
            finally:
                if data_path.exists():  # published (even if a later fsync failed)
                    shutil.rmtree(self._partial_dir(blob_id), ignore_errors=True)
            fsync_dir(self._partial)

    # ------------------------------------------------------------------ quarantine
    def quarantine(
        self, blob_id: str, reason: str, *, read_from: os.stat_result | None = None
    ) -> bool:
        """Take a complete blob found rotten out of the published set.

        Its data and manifest move to ``quarantine/<id>/`` with ``reason``: from then on
        :meth:`has` is False, it is not listed among complete blobs, readers and servers
        stop offering it, and reading it raises :class:`BlobQuarantined` (exit 4). Tags
        stay (the name still means that content). Publishing the ID again, by ``put`` of
        the same content or a fetched partial, repairs it and clears the quarantine; a
        fetch starts from the quarantined file, so only the rotten chunks are fetched.
        Returns False if the blob was not complete here (already quarantined, say).
        Safe from any thread; callers need not hold anything.

        ``read_from``: the ``fstat`` of the file whose bytes failed. A reader can find
        rot in a file that has since been quarantined and repaired (a new file with good
        bytes under the same name); then the published file is not the rotten one, and
        nothing is done (False).
        """
        parse_blob_id(blob_id)
        if self.read_only:
            raise StoreError(
                f"blob {blob_id[:12]} is corrupt in {self.root}, which belongs to another "
                "user: ask its owner to run `blob verify` there"
            )
        with os_errors(f"quarantining blob {blob_id[:12]}"), self._store_lock():
            data_path = self._data_path(blob_id)
            if not data_path.exists():
                return False
            if read_from is not None and not _same_file(data_path, read_from):
                return False  # the rotten file was replaced meanwhile (a repair)
            qdir = self._quarantine / blob_id
            self._mkdir_in_store(qdir)
            # The reason may quote a peer (its report of a bad chunk) and is printed in
            # error lines: one line of printable text, so no escape sequence rides along.
            words = " ".join(reason[:_MAX_REASON].split())
            one_line = "".join(c if c.isprintable() else "?" for c in words)
            write_file_atomic(
                qdir / "reason",
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {one_line}\n".encode(),
                tmp_dir=self.tmp_dir,
                replace=True,
                mode=self.modes.file,
            )
            manifest_path = self._manifest_path(blob_id)
            with contextlib.suppress(FileExistsError):
                os.link(manifest_path, qdir / "manifest")  # before the data leaves
            os.replace(data_path, qdir / "data")  # unpublished from here on
            manifest_path.unlink(missing_ok=True)
            fsync_dir(qdir)
            fsync_dir(data_path.parent)
            with self._mutex:
                self._manifests.pop(blob_id, None)
        return True

    def quarantine_reason(self, blob_id: str) -> str | None:
        """Why the blob is quarantined ("<UTC time> <reason>"), or None if it is not."""
        parse_blob_id(blob_id)
        qdir = self._quarantine / blob_id
        try:
            return (qdir / "reason").read_text(errors="replace").strip() or "no reason recorded"
        except FileNotFoundError:
            return "no reason recorded" if (qdir / "manifest").exists() else None
        except OSError as exc:
            raise translate_os_error(exc, f"reading the quarantine of {blob_id[:12]}") from exc

    def quarantined_ids(self) -> list[str]:
        """IDs of quarantined blobs, sorted."""
        with os_errors("listing quarantined blobs"):
            return sorted(
                e.name
                for e in os.scandir(self._quarantine)
                if _is_id(e.name) and os.path.exists(os.path.join(e.path, "manifest"))
            )

    def _clear_quarantine(self, blob_id: str) -> None:
        """Store lock held: the ID is published again with verified bytes."""
        qdir = self._quarantine / blob_id
        if qdir.exists():
            shutil.rmtree(qdir, ignore_errors=True)
            fsync_dir(self._quarantine)

    def _seed_from_quarantine(self, blob_id: str, pdir: Path) -> None:
        """Store and partial locks held: a repair download starts from the rotten copy;
        the partial's reopen re-hashes every chunk and keeps only those that verify."""
        qdata = self._quarantine / blob_id / "data"
        if (pdir / "data").exists() or not qdata.exists():
            return
        if os.stat(qdata).st_nlink > 1:  # shared with a hard-linked export: not ours to
            return  # rewrite (the user may have edited it); fetch the blob whole instead
        os.chmod(qdata, self.modes.file)
        os.rename(qdata, pdir / "data")
        fsync_dir(pdir)

    def _quarantine_on_read(self, blob_id: str, what: str, read_from: os.stat_result) -> str:
        """Quarantine a complete blob whose read of the file ``read_from`` (its fstat)
        just failed its hash; the message tail."""
        try:
            if not self.quarantine(blob_id, what, read_from=read_from) and self.has(blob_id):
                return "; the store's copy was replaced meanwhile: read it again"
        except StoreError as exc:
            return f"; could not quarantine it ({exc})"
        return f"; quarantined it: fetch it again (blob get {blob_id} --peer ...) or put it again"

    def _quarantined_may_be_collection(self, blob_id: str) -> bool:
        """Whether a quarantined blob could be a collection (so gc cannot know what it
        pins): False only when its first chunk still verifies and lacks the magic."""
        if self.quarantine_reason(blob_id) is None:
            return False
        manifest = self.manifest(blob_id)
        if manifest.size < len(COLLECTION_MAGIC):
            return False
        _, length = manifest.chunk_span(0)
        try:
            with open(self._quarantine / blob_id / "data", "rb") as f:
                first = f.read(length)
        except FileNotFoundError:
            return True  # moved into a repair download: unknown until it is published
        if blake3(first).digest() != manifest.chunk_hash(0):
            return True
        return looks_like_collection(first)

    def _refuse_quarantined(self, blob_id: str) -> None:
        reason = self.quarantine_reason(blob_id)
        if reason is not None:
            raise BlobQuarantined(
                f"blob {blob_id} is quarantined as corrupt ({reason}); fetch it again "
                f"(blob get {blob_id} --peer ...) or put the original again"
            )

    # ------------------------------------------------------------------ partial blobs
    def begin_partial(self, manifest: Manifest) -> PartialBlob:
        """Create or resume the partial blob for ``manifest`` (exclusive per blob)."""
        blob_id = manifest.blob_id
        pdir = self._partial_dir(blob_id)
        with os_errors(f"starting partial blob {blob_id[:12]}"):
            with self._store_lock():
                if self.has(blob_id):
                    raise BlobExists(f"blob {blob_id} is already complete in this store")
                self._mkdir_in_store(pdir)
                lock_fd = lock_path(pdir / "lock")
                if lock_fd is not None:
                    try:
                        claim_lock(lock_fd)
                        self._seed_from_quarantine(blob_id, pdir)
                    except BaseException:
                        os.close(lock_fd)
                        raise
            if lock_fd is None:
                raise PartialBusy(
                    f"blob {blob_id[:12]} is being written by {lock_holder(pdir / 'lock')}; "
                    "wait for it or stop that process"
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
                        mpath, encoded, tmp_dir=self.tmp_dir, replace=True, mode=self.modes.file
                    )
                data_fd = os.open(pdir / "data", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if stat.S_IMODE(os.fstat(data_fd).st_mode) != self.modes.file:
                    os.fchmod(data_fd, self.modes.file)
                data_existed = os.fstat(data_fd).st_size > 0
                if os.fstat(data_fd).st_size != manifest.size:
                    os.ftruncate(data_fd, manifest.size)  # sparse: blocks come as chunks land
                with self._mutex:
                    if blob_id in self._open_partials:  # cannot happen: flock excludes
                        raise PartialBusy(f"blob {blob_id[:12]} is already open here")
                    partial = PartialBlob(self, manifest, pdir, lock_fd, data_fd)
                    self._open_partials[blob_id] = partial
            except BaseException:
                if data_fd >= 0:
                    os.close(data_fd)
                os.close(lock_fd)
                raise
        try:
            partial._load_and_reverify(data_existed)
            missing = sum(manifest.chunk_span(i)[1] for i in partial.missing())
            with os_errors("checking free space"):
                self._check_space(missing, f"download blob {blob_id[:12]}")
        except BaseException:
            partial._release()
            raise
        return partial

    def _forget_partial(self, partial: PartialBlob) -> None:
        with self._mutex:
            if self._open_partials.get(partial.blob_id) is partial:
                del self._open_partials[partial.blob_id]

    def partial_ids(self) -> list[str]:
        """IDs of partial blobs present (held by anyone or no one)."""
        with os_errors("listing partial blobs"):
            return sorted(
                e.name
                for e in os.scandir(self._partial)
                if _is_id(e.name) and os.path.exists(os.path.join(e.path, "manifest"))
            )

    # ------------------------------------------------------------------ reading
    def has(self, blob_id: str) -> bool:
        """Whether the complete blob is in the store."""
        parse_blob_id(blob_id)
        return self._data_path(blob_id).exists()

    def _has_partial(self, blob_id: str) -> bool:
        return (self._partial_dir(blob_id) / "manifest").exists()

    def manifest(self, blob_id: str) -> Manifest:
        """The manifest of a complete or partial blob."""
        parse_blob_id(blob_id)
        with self._mutex:
            cached = self._manifests.get(blob_id)
        if cached is not None:
            return cached
        with os_errors(f"reading the manifest of {blob_id[:12]}"):
            complete = True
            try:
                data = _read_limited(self._manifest_path(blob_id), MAX_MANIFEST_SIZE)
            except FileNotFoundError:
                complete = False
                data = self._read_other_manifest(blob_id)
        try:
            manifest = Manifest.decode(data)
        except BadManifest as exc:
            raise StoreCorrupt(f"stored manifest of {blob_id} is damaged ({exc})") from None
        if manifest.blob_id != blob_id:
            raise StoreCorrupt(f"stored manifest of {blob_id} does not match its ID")
        if complete:
            with self._mutex:
                if len(self._manifests) >= _MANIFEST_CACHE_SIZE:
                    self._manifests.pop(next(iter(self._manifests)))
                self._manifests[blob_id] = manifest
        return manifest

    def _read_other_manifest(self, blob_id: str) -> bytes:
        """The manifest of a partial or quarantined blob (not cached: they change)."""
        for path in (
            self._partial_dir(blob_id) / "manifest",
            self._quarantine / blob_id / "manifest",
        ):
            with contextlib.suppress(FileNotFoundError):
                return _read_limited(path, MAX_MANIFEST_SIZE)
        raise BlobNotFound(f"no blob {blob_id} in this store")

    def path(self, blob_id: str) -> Path:
        """The read-only file holding exactly the complete blob's bytes (mmap it)."""
        if not self.has(blob_id):
            self._refuse_quarantined(blob_id)
            raise BlobNotFound(f"no complete blob {blob_id} in this store")
        return self._data_path(blob_id)

    def read_chunk(self, blob_id: str, index: int) -> bytes:
        """Chunk ``index``, hashed again before it is returned (one read through
        :meth:`open_reader`; a rotten chunk of a complete blob quarantines it)."""
        self.manifest(blob_id)  # BlobNotFound for a blob this store never had
        try:
            reader = self.open_reader(blob_id)
        except (BlobNotFound, BlobQuarantined):  # removed, published or quarantined
            raise ChunkUnavailable(f"chunk {index} of {blob_id[:12]} is gone") from None
        with reader:
            return reader.read(index)

    def open_reader(self, blob_id: str) -> ChunkReader:
        """A :class:`~blobstore.reader.ChunkReader` over the blob's file, opened once."""
        manifest = self.manifest(blob_id)
        with self._mutex:
            live = self._open_partials.get(blob_id)
        if live is not None:
            return ChunkReader(blob_id, manifest, fd=None, bits=None, live=live)
        with os_errors(f"opening {blob_id[:12]} for reading"):
            complete = self.has(blob_id)
            if complete:
                source, bits = self._data_path(blob_id), None
            else:
                bits = load_bitmap(self._partial_dir(blob_id) / "bitmap", manifest.num_chunks)
                source = self._partial_dir(blob_id) / "data"
            try:
                fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed (or published) meanwhile
                self._refuse_quarantined(blob_id)
                raise BlobNotFound(f"no blob {blob_id} in this store") from None
        opened = os.fstat(fd)
        on_corrupt = (
            (lambda what: self._quarantine_on_read(blob_id, what, opened)) if complete else None
        )
        return ChunkReader(blob_id, manifest, fd=fd, bits=bits, live=None, on_corrupt=on_corrupt)

    def chunk_bitmap(self, blob_id: str) -> bytes:
        """Bit i set = chunk i held and verified (see :mod:`blobstore.bitmap`)."""
        manifest = self.manifest(blob_id)
        if self.has(blob_id):
            return bm.full_bitmap(manifest.num_chunks)
        with self._mutex:
            live = self._open_partials.get(blob_id)
        if live is not None:
            return live.bitmap
        with os_errors(f"reading the bitmap of {blob_id[:12]}"):
            return bytes(load_bitmap(self._partial_dir(blob_id) / "bitmap", manifest.num_chunks))

    def iter_verified(self, blob_id: str) -> Iterator[memoryview]:
        """The complete blob's bytes in large pieces, each chunk checked on the way.

        Each piece is a view of a reused buffer: consume it before asking for the next.
        Raises CorruptChunk at the first chunk that fails, having quarantined the blob.
        """
        manifest = self.manifest(blob_id)
        path = self.path(blob_id)
        c = manifest.chunk_size
        buf = memoryview(bytearray(max(IO_BUFFER_SIZE, c)))
        with os_errors(f"reading blob {blob_id[:12]}"):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            read_from = os.fstat(fd)
            index = 0
            remaining = manifest.size
            while remaining > 0:
                with os_errors(f"reading blob {blob_id[:12]}"):
                    n = _read_full(fd, buf[: min(len(buf), remaining)])
                if n < min(len(buf), remaining):
                    what = f"blob {blob_id} is truncated on disk"
                    raise CorruptChunk(what + self._quarantine_on_read(blob_id, what, read_from))
                for off in range(0, n, c):
                    if blake3(buf[off : min(off + c, n)]).digest() != manifest.chunk_hash(index):
                        what = f"chunk {index} of blob {blob_id} is corrupt on disk"
                        tail = self._quarantine_on_read(blob_id, what, read_from)
                        raise CorruptChunk(what + tail)
                    index += 1
                remaining -= n
                yield buf[:n]
        finally:
            os.close(fd)

    def verify(self, blob_id: str, *, quarantine: bool = True) -> list[int]:
        """Indices of chunks whose stored bytes fail their hash ([] = intact).

        A complete blob is checked whole and, if any chunk fails and ``quarantine`` is
        set, quarantined (see :meth:`quarantine`; not in another user's store, which is
        read-only here); a partial one, the chunks it marks
        verified; a quarantined one, its quarantined copy (or the partial seeded from it).
        Raises StoreCorrupt if the manifest itself is damaged.
        """
        manifest = self.manifest(blob_id)
        n = manifest.num_chunks
        complete = self.has(blob_id)
        qdata = self._quarantine / blob_id / "data"
        if complete:
            source = self._data_path(blob_id)
            indices: Iterable[int] = range(n)
        elif not self._has_partial(blob_id) and qdata.exists():
            source, indices = qdata, range(n)
        else:
            source = self._partial_dir(blob_id) / "data"
            indices = bm.set_indices(self.chunk_bitmap(blob_id), n)
        whole = indices == range(n)
        bad = []
        with os_errors(f"verifying blob {blob_id[:12]}"):
            try:
                fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise BlobNotFound(f"blob {blob_id} disappeared while being verified") from None
            try:
                read_from = os.fstat(fd)
                for i in indices:
                    offset, length = manifest.chunk_span(i)
                    data = read_span(fd, offset, length)
                    if len(data) != length or blake3(data).digest() != manifest.chunk_hash(i):
                        bad.append(i)
                if whole and os.fstat(fd).st_size != manifest.size and not bad:
                    bad.append(max(n - 1, 0))  # trailing garbage past the last chunk
            finally:
                os.close(fd)
        if bad and complete and quarantine and not self.read_only:
            shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
            reason = f"verify found {len(bad)} corrupt chunk(s): {shown}"
            self.quarantine(blob_id, reason, read_from=read_from)
        return bad

    # ------------------------------------------------------------------ names
    def resolve(self, ref: str) -> str:
        """A full ID, a unique prefix of 8+ hex characters, or a tag name -> blob ID."""
        if _is_id(ref):
            if self.has(ref) or self._has_partial(ref) or self.quarantine_reason(ref):
                return ref
            raise BlobNotFound(f"no blob {ref} in this store")
        with os_errors(f"looking up {ref!r}"):
            tag_file = self._tags / ref
            if TAG_NAME_RE.fullmatch(ref) and tag_file.is_file():
                return self._read_tag(tag_file)
            lowered = ref.lower()
            if len(ref) >= MIN_PREFIX and _HEX_RE.fullmatch(ref) and len(ref) < 64:
                matches = sorted(
                    {i for i in self._complete_ids(lowered[:2]) if i.startswith(lowered)}
                    | {i for i in self.partial_ids() if i.startswith(lowered)}
                    | {i for i in self.quarantined_ids() if i.startswith(lowered)}
                )
                if len(matches) == 1:
                    return matches[0]
                if matches:
                    shown = ", ".join(m[:16] for m in matches[:5])
                    raise AmbiguousPrefix(
                        f"prefix {ref} matches {len(matches)} blobs ({shown}...); "
                        "give more characters"
                    )
                raise BlobNotFound(f"no blob with ID prefix {ref} in this store")
        if len(ref) < MIN_PREFIX and _HEX_RE.fullmatch(ref):
            raise BlobNotFound(
                f"no tag named {ref!r}, and ID prefixes need at least {MIN_PREFIX} characters"
            )
        raise BlobNotFound(f"no blob or tag named {ref!r} in this store")

    def _read_tag(self, path: Path) -> str:
        text = path.read_text(errors="replace").strip()
        try:
            return parse_blob_id(text)
        except BadBlobId:
            raise StoreCorrupt(f"tag file {path} is damaged; re-create the tag") from None

    def tag(self, name: str, blob_id: str) -> None:
        """Point tag ``name`` at ``blob_id`` (complete or partial), replacing any old one."""
        check_tag_name(name)
        parse_blob_id(blob_id)
        with os_errors(f"tagging {blob_id[:12]} as {name}"), self._store_lock():
            if not (self.has(blob_id) or self._has_partial(blob_id)):
                raise BlobNotFound(f"no blob {blob_id} in this store")
            write_file_atomic(
                self._tags / name,
                f"{blob_id}\n".encode(),
                tmp_dir=self.tmp_dir,
                replace=True,
                mode=self.modes.file,
            )

    def untag(self, name: str) -> None:
        check_tag_name(name)
        with os_errors(f"removing tag {name}"), self._store_lock():
            try:
                (self._tags / name).unlink()
            except FileNotFoundError:
                raise BlobNotFound(f"no tag named {name!r}") from None
            fsync_dir(self._tags)

    def tags(self) -> dict[str, str]:
        """All tags: name -> blob ID (damaged tag files are skipped)."""
        out = {}
        with os_errors("reading tags"):
            for entry in os.scandir(self._tags):
                if TAG_NAME_RE.fullmatch(entry.name) is None or not entry.is_file():
                    continue
                try:
                    out[entry.name] = self._read_tag(Path(entry.path))
                except (StoreCorrupt, FileNotFoundError):
                    continue
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------ listing
    def _complete_ids(self, shard: str | None = None) -> list[str]:
        shards = [shard] if shard is not None else sorted(os.listdir(self._blobs))
        ids: list[str] = []
        for s in shards:
            try:
                names = os.listdir(self._blobs / s)
            except (FileNotFoundError, NotADirectoryError):
                continue
            ids.extend(n for n in names if _is_id(n) and n.startswith(s))
        return sorted(ids)

    def blob_ids(self) -> list[str]:
        """IDs of every complete, partial and quarantined blob, sorted (even ones with
        damaged files)."""
        with os_errors("listing blobs"):
            return sorted({*self._complete_ids(), *self.partial_ids(), *self.quarantined_ids()})

    def list_blobs(self) -> list[BlobInfo]:
        """Every complete, partial and quarantined blob, sorted by ID (unreadable ones
        skipped). Only rows with ``complete`` set are published (served, advertised)."""
        by_blob: dict[str, list[str]] = {}
        for name, blob_id in self.tags().items():
            by_blob.setdefault(blob_id, []).append(name)
        rows = []
        with os_errors("listing blobs"):
            complete = set(self._complete_ids())
            quarantined = set(self.quarantined_ids()) - complete
            for blob_id in sorted({*complete, *self.partial_ids(), *quarantined}):
                try:
                    manifest = self.manifest(blob_id)
                    bits = self.chunk_bitmap(blob_id)
                except (StoreCorrupt, BlobNotFound):
                    continue
                rows.append(
                    BlobInfo(
                        blob_id=blob_id,
                        size=manifest.size,
                        chunk_size=manifest.chunk_size,
                        complete=blob_id in complete,
                        verified_chunks=bm.count_bits(bits),
                        tags=tuple(by_blob.get(blob_id, ())),
                        quarantined=blob_id in quarantined,
                    )
                )
        return rows

    def free_bytes(self) -> int:
        """Bytes available to this user on the store's file system."""
        with os_errors("checking free space"):
            st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # ------------------------------------------------------------------ removing
    def rm(self, blob_id: str) -> None:
        """Remove a blob (complete, partial or quarantined) and every tag pointing at it."""
        parse_blob_id(blob_id)
        with os_errors(f"removing blob {blob_id[:12]}"), self._store_lock():
            found = False
            data_path = self._data_path(blob_id)
            if data_path.exists():
                data_path.unlink()
                self._manifest_path(blob_id).unlink(missing_ok=True)
                fsync_dir(data_path.parent)
                found = True
            pdir = self._partial_dir(blob_id)
            if pdir.exists():
                fd = lock_path(pdir / "lock")
                if fd is None:
                    raise PartialBusy(
                        f"blob {blob_id[:12]} is being written by {lock_holder(pdir / 'lock')}"
                    )
                try:
                    shutil.rmtree(pdir)
                finally:
                    os.close(fd)
                found = True
            qdir = self._quarantine / blob_id
            if qdir.exists():
                shutil.rmtree(qdir)
                found = True
            if not found:
                raise BlobNotFound(f"no blob {blob_id} in this store")
            for entry in os.scandir(self._tags):
                with contextlib.suppress(StoreCorrupt, OSError):
                    if self._read_tag(Path(entry.path)) == blob_id:
                        os.unlink(entry.path)
            with self._mutex:
                self._manifests.pop(blob_id, None)

    def lease(self, blob_ids: Iterable[str] = ()) -> Lease:
        """Protect ``blob_ids`` from gc until the lease is released, whatever the grace
        period; a collection's children are protected with it. Use as a context manager;
        :meth:`Lease.add` protects more. See :mod:`blobstore.lease`."""
        return create_lease(self, self._locks, blob_ids)

    def _protected(self) -> set[str]:
        """Tagged and leased IDs plus, transitively, the children of such collections.
        Store lock held (live leases are read, stale ones deleted)."""
        keep: set[str] = set()
        todo = [*self.tags().values(), *live_leased_ids(self._locks)]
        while todo:
            blob_id = todo.pop()
            if blob_id in keep:
                continue
            keep.add(blob_id)
            if not self.has(blob_id) and self._quarantined_may_be_collection(blob_id):
                raise StoreCorrupt(
                    f"gc stopped: tagged blob {blob_id} is quarantined, so the children it "
                    "may pin are unknown; fetch it again or untag it, then run gc"
                )
            try:
                children = self.collection_entries(blob_id) if self.has(blob_id) else None
                todo.extend(e.blob_id for e in children or ())
            except CorruptChunk as exc:  # quarantined just now
                raise StoreCorrupt(
                    f"gc stopped: tagged blob {blob_id[:12]} is corrupt ({exc})"
                ) from None
            except StoreError:
                continue  # a malformed collection pins nothing but itself
        return keep

    def gc(self, grace_seconds: float = DEFAULT_GC_GRACE, *, dry_run: bool = False) -> list[str]:
        """Delete untagged blobs and idle partials older than ``grace_seconds``.

        Returns the removed IDs (with ``dry_run``, those it would remove, removing
        nothing). Never touches a tagged or leased blob (or a child of a tagged or leased
        collection), a partial another writer holds, or anything younger than the grace.

        The store lock is held only while deciding and renaming: what goes is renamed into
        ``tmp/`` (one rename each, however large the file) and deleted after the lock is
        released, so a ``put`` or a fetch waiting on the lock is not held up by the
        filesystem freeing gigabytes. A crash in between leaves only names in ``tmp/``,
        which the next open sweeps.
        """
        now = time.time()
        removed: list[str] = []
        doomed: list[str] = []  # paths in tmp/, deleted once the lock is released
        with os_errors("collecting garbage"):
            if not dry_run:
                sweep_temp_dir(self.tmp_dir)
            with self._store_lock():
                keep = self._protected()
                for blob_id in self._complete_ids():
                    data_path = self._data_path(blob_id)
                    if blob_id in keep or now - data_path.stat().st_mtime < grace_seconds:
                        continue
                    removed.append(blob_id)
                    if dry_run:
                        continue
                    doomed.append(self._to_trash(data_path))
                    self._manifest_path(blob_id).unlink(missing_ok=True)
                    with self._mutex:
                        self._manifests.pop(blob_id, None)
                if not dry_run:
                    self._remove_orphan_manifests()
                for entry in os.scandir(self._partial):
                    if entry.name in keep:
                        continue
                    fd = lock_path(Path(entry.path) / "lock")
                    if fd is None:  # a live writer holds it
                        continue
                    try:
                        newest = max(
                            (e.stat().st_mtime for e in os.scandir(entry.path)),
                            default=0.0,
                        )
                        if now - newest < grace_seconds:
                            continue
                        if not dry_run:
                            doomed.append(self._to_trash(Path(entry.path)))
                        if _is_id(entry.name):
                            removed.append(entry.name)
                    finally:
                        os.close(fd)
                for entry in os.scandir(self._quarantine):
                    if entry.name in keep or self._has_partial(entry.name):
                        continue  # pinned, or a repair download is using it
                    newest = max((e.stat().st_mtime for e in os.scandir(entry.path)), default=0.0)
                    if now - newest >= grace_seconds:
                        if not dry_run:
                            doomed.append(self._to_trash(Path(entry.path)))
                        if _is_id(entry.name):
                            removed.append(entry.name)
            for path in doomed:
                delete_trash(path)
        return sorted(set(removed))

    def _to_trash(self, path: Path) -> str:
        """Rename ``path`` (a file or a directory) into ``tmp/`` under a trash name; the
        caller deletes it. Store lock held."""
        trash = os.path.join(self.tmp_dir, f"{TRASH_PREFIX}{secrets.token_hex(8)}")
        os.rename(path, trash)
        return trash

    # ------------------------------------------------------------------ collections
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
            self._check_space(sum(f[2] for f in files), f"copy {root} into the store")
        own_lease = lease is None
        held = self.lease() if lease is None else lease
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
                size = self.manifest(blob_id).size
                entries.append(CollectionEntry(path=rel, blob_id=blob_id, size=size))
                done += size
            return self.put_bytes(encode_collection(entries), chunk_size=chunk_size, lease=held)
        finally:
            if own_lease:
                held.release()

    def is_collection(self, blob_id: str) -> bool:
        """Whether the complete blob is a collection (see :meth:`collection_entries`)."""
        return self.collection_entries(blob_id) is not None

    def collection_entries(self, blob_id: str) -> list[CollectionEntry] | None:
        """The entries if the complete blob is a collection, else None; one decode.

        A blob that starts with the collection magic but does not decode (hostile paths,
        too many entries, not canonical) raises BadCollection (exit 4) rather than pass
        as a plain file: whoever made it meant a collection, and exporting or fetching
        it as anything else would surprise the user. ``blob cat`` gives its raw bytes.
        """
        manifest = self.manifest(blob_id)
        if not self.has(blob_id) or manifest.size < len(COLLECTION_MAGIC):
            return None
        with os_errors(f"reading blob {blob_id[:12]}"), open(self.path(blob_id), "rb") as f:
            head = f.read(len(COLLECTION_MAGIC))
        if not looks_like_collection(head):
            return None
        return self.read_collection(blob_id)

    def read_collection(self, blob_id: str) -> list[CollectionEntry]:
        """The entries of a collection blob (BadCollection if it is not one).

        Decoded incrementally from the verified chunks, never holding the whole blob."""
        manifest = self.manifest(blob_id)
        if manifest.size > MAX_COLLECTION_SIZE:
            raise BadCollection(
                f"blob {blob_id[:12]} is {manifest.size} bytes, too large to be a collection "
                f"(limit {MAX_COLLECTION_SIZE})"
            )
        try:
            return decode_collection_pieces(self.iter_verified(blob_id), manifest.size)
        except BadCollection as exc:
            raise BadCollection(f"blob {blob_id[:12]} is a malformed collection: {exc}") from None

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
        cannot delete them half way (see :meth:`lease`).
        """
        if link not in _EXPORT_LINKS:
            raise ValueError(f"link must be one of {', '.join(_EXPORT_LINKS)}, not {link!r}")
        # Another user's shared store cannot be leased (locks/ is the owner's alone).
        with contextlib.nullcontext() if self.read_only else self.lease([blob_id]):
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
        entries = self.collection_entries(blob_id)
        if entries is not None:
            for e in entries:
                if not self.has(e.blob_id):
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
        if self._file_matches(blob_id, dest):
            if progress is not None:
                progress(self.manifest(blob_id).size)
            return
        staging = parent / f".{dest.name}.blobnet-{secrets.token_hex(6)}"
        try:
            with os_errors(f"exporting to {dest}"):
                self._export_file(blob_id, staging, progress, verify, link)
                os.replace(staging, dest)
                fsync_dir(parent)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise

    def _file_matches(self, blob_id: str, path: Path) -> bool:
        """Whether ``path`` is a regular file holding exactly the blob's bytes: the
        store's own file (a hard link), or equal size and every chunk hashing right."""
        manifest = self.manifest(blob_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != manifest.size:
                return False
            if _same_file(self._data_path(blob_id), st):
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
        return all(
            self._file_matches(e.blob_id, dest.joinpath(*e.path.split("/"))) for e in entries
        )

    def _export_file(
        self,
        blob_id: str,
        target: Path,
        progress: Progress | None,
        verify: bool,
        link: ExportLink,
    ) -> None:
        size = self.manifest(blob_id).size
        source = self.path(blob_id)
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
        else:
            self._check_space(size, f"export blob {blob_id[:12]}")
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            if link != "copy" and size and _reflink(source, fd):
                if verify:
                    self._hash_through(blob_id, progress)
            elif verify:
                done = 0
                for piece in self.iter_verified(blob_id):
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
        for piece in self.iter_verified(blob_id):
            done += len(piece)
            if progress is not None:
                progress(done)


ExportLink = Literal["reflink", "hardlink", "copy"]
_EXPORT_LINKS: tuple[ExportLink, ...] = ("reflink", "hardlink", "copy")
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_LINK_FALLBACK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.EACCES}


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
            while n := _read_full(src, buf):
                write_all(fd, buf[:n])
                done += n
                if progress is not None:
                    progress(done)
        if done != size:
            raise CorruptChunk(f"{source} is {done} bytes on disk, its manifest says {size}")
    finally:
        os.close(src)


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


def _lock_timeout(given: float | None) -> float:
    if given is not None:
        return max(0.0, float(given))
    text = os.environ.get(LOCK_TIMEOUT_ENV)
    if not text:
        return STORE_LOCK_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise StoreError(f"{LOCK_TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if not value >= 0:
        raise StoreError(f"{LOCK_TIMEOUT_ENV}={text!r} must be zero or more seconds")
    return value


def _lock_holder(fd: int) -> str:
    """Who holds the lock, as far as its file says: 'process 1234' or 'another process'."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return "another process"
    pid = int(text)
    if pid == os.getpid():
        return f"this process ({pid})"
    return f"process {pid}"


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


def _is_id(name: str) -> bool:
    try:
        parse_blob_id(name)
    except BadBlobId:
        return False
    return True


def _same_file(path: Path, st: os.stat_result) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def _raise(exc: OSError) -> None:
    raise exc


def _read_limited(path: Path, limit: int) -> bytes:
    """The file's bytes, refusing one over ``limit`` before reading it. (``read(limit)``
    would allocate ``limit`` bytes up front: 32 MiB for every manifest read.)"""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise StoreCorrupt(f"{path} is larger than any valid manifest")
        data = f.read()
    if len(data) > limit:  # grew while being read
        raise StoreCorrupt(f"{path} is larger than any valid manifest")
    return data


__all__ = ["DEFAULT_GC_GRACE", "HASH_SIZE", "BlobInfo", "Store"]
