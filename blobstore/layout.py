"""What every part of the store builds on: its paths, its lock, its free space.

:class:`StoreBase` is the base of :class:`blobstore.store.Store`; the layout, file modes
and invariants it serves are stated in :mod:`blobstore.store` (its theory of operation).
Held here:

1. Paths: ``blobs/<ab>/<id>`` and its ``.manifest``, ``partial/<id>/``.
2. The store lock (invariant 5): one per store and process (threads queue on a mutex
   first, and a thread holding it may take it again), waited for at most
   ``lock_timeout`` seconds, then StoreBusy naming the holder's PID.
3. Free space is checked before a copy claims it (NoSpace says how much is missing).
4. Leases (invariant 6) are taken here, so every part can keep what it uses from gc.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from blobstore.durable import os_errors, try_lock_fd
from blobstore.errors import BadBlobId, NoSpace, StoreBusy
from blobstore.lease import Lease, create_lease
from blobstore.manifest import Manifest, parse_blob_id
from blobstore.partial import PartialBlob

Progress = Callable[[int], None]

IO_BUFFER_SIZE = 8 * 1024 * 1024
"""Bytes per read/write syscall when copying: large enough that syscall and Python
overhead vanish next to hashing, small enough to stay in L2/L3-friendly territory and
keep memory flat. Always a multiple of the chunk size (both are powers of two)."""


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

STORE_LOCK_TIMEOUT = 10.0
"""Seconds to wait for the store lock before failing with StoreBusy (exit 5). The lock is
held only around publishes, deletes, tag changes and one gc pass: milliseconds, seconds
for gc of a very large store. Waiting longer means a stuck or hostile holder; say so
rather than hang. Override with ``Store.open(lock_timeout=...)`` or the environment
variable named by :data:`LOCK_TIMEOUT_ENV`."""
LOCK_TIMEOUT_ENV = "BLOBNET_LOCK_TIMEOUT"
_LOCK_POLL_MAX = 0.02  # seconds between tries at most: contention is short
MANIFEST_SUFFIX = ".manifest"


class StoreBase:
    """The paths, modes and lock of a store (see :mod:`blobstore.layout`)."""

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

    def _data_path(self, blob_id: str) -> Path:
        return self._blobs / blob_id[:2] / blob_id

    def _manifest_path(self, blob_id: str) -> Path:
        return self._blobs / blob_id[:2] / (blob_id + MANIFEST_SUFFIX)

    def _partial_dir(self, blob_id: str) -> Path:
        return self._partial / blob_id

    def has(self, blob_id: str) -> bool:
        """Whether the complete blob is in the store."""
        parse_blob_id(blob_id)
        return self._data_path(blob_id).exists()

    def _has_partial(self, blob_id: str) -> bool:
        return (self._partial_dir(blob_id) / "manifest").exists()

    def _check_space(self, needed: int, what: str) -> None:
        available = self.free_bytes()
        if needed > available:
            raise NoSpace(
                f"not enough disk space to {what}: need {needed} bytes, "
                f"{available} available under {self.root}",
                needed=needed,
                available=available,
            )

    def free_bytes(self) -> int:
        """Bytes available to this user on the store's file system."""
        with os_errors("checking free space"):
            st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def space_to_finish(self, manifest: Manifest) -> int:
        """Disk space a download of ``manifest`` still has to claim: its size, less what
        its partial's data file already occupies. Not less the verified chunks only: the
        blocks of chunks written but not yet marked verified (after a disk-full stop, when
        the bitmap itself could not be written) take space too, and writing them again
        claims none, so counting them as missing would refuse the very retry that the
        freed space allows."""
        with os_errors(f"checking the partial blob {manifest.blob_id[:12]}"):
            try:
                st = os.stat(self._partial_dir(manifest.blob_id) / "data")
            except FileNotFoundError:
                return manifest.size
        return max(0, manifest.size - min(manifest.size, st.st_blocks * 512))

    def lease(self, blob_ids: Iterable[str] = ()) -> Lease:
        """Protect ``blob_ids`` from gc until the lease is released, whatever the grace
        period; a collection's children are protected with it. Use as a context manager;
        :meth:`Lease.add` protects more. See :mod:`blobstore.lease`."""
        return create_lease(self, self._locks, blob_ids)


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
