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
    names/, peers/           the network layer's own files (p2p.names.cache: signed
                             name records; p2p.fetch.peer_memory: peers that sent bad data)

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

Where the code is
-----------------

:class:`Store` (this module: opening, modes, the sweep on open) owns one part per job,
each an object with its own state, built here from what it needs and tested alone:
:class:`~blobstore.layout.Layout` (paths: what a path says alone),
:class:`~blobstore.store_lock.StoreLock` (invariant 5), :class:`~blobstore.space.Space`,
:class:`~blobstore.lease.Leases` (invariant 6), :class:`~blobstore.manifests.Manifests`
(the manifest cache), :class:`~blobstore.partial.OpenPartials`,
:class:`~blobstore.quarantine.Quarantine` (invariant 8),
:class:`~blobstore.reading.Reader` (readers, verification, collections),
:class:`~blobstore.writing.Writer` (puts, partials, publication: invariants 1 to 4),
:class:`~blobstore.catalog.Catalog` (IDs, prefixes, tags, listings),
:class:`~blobstore.removal.Collector` (rm and gc: invariant 6) and
:class:`~blobstore.exporting.Exporter`. The store's public methods are its parts' own,
named on :class:`Store` as attributes, so a method has one body and one signature.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from blobstore.catalog import Catalog
from blobstore.durable import fsync_dir, lock_path, os_errors, sweep_temp_dir, write_file_atomic
from blobstore.errors import StoreError
from blobstore.exporting import Exporter
from blobstore.layout import (
    DIRS,
    IO_BUFFER_SIZE,
    PRIVATE_MODES,
    SHARED_MODES,
    FileModes,
    Layout,
)
from blobstore.lease import Leases
from blobstore.manifest import MIN_CHUNK_SIZE
from blobstore.manifests import Manifests
from blobstore.partial import OpenPartials
from blobstore.quarantine import Quarantine
from blobstore.reading import Reader
from blobstore.removal import Collector
from blobstore.space import Space
from blobstore.store_lock import LOCK_TIMEOUT_ENV, STORE_LOCK_TIMEOUT, StoreLock
from blobstore.writing import Writer

STORE_FORMAT = 1
MARKER_NAME = "blobnet-store"
SHARED_MARKER = "shared"
"""File at the root whose presence makes the store shared (see :class:`FileModes`)."""


class Store:
    """A local blob store rooted at a directory. Create with :meth:`Store.open`.

    ``modes``, ``lock_timeout``, ``read_only`` and ``io_buffer`` (bytes per read of a
    whole file or blob: a power of two, at least the smallest chunk) are fixed for its
    life; :meth:`open` finds the first three from the directory and the environment.
    """

    def __init__(
        self,
        root: Path,
        *,
        modes: FileModes = PRIVATE_MODES,
        lock_timeout: float = STORE_LOCK_TIMEOUT,
        read_only: bool = False,
        io_buffer: int = IO_BUFFER_SIZE,
    ) -> None:
        if io_buffer < MIN_CHUNK_SIZE or io_buffer & (io_buffer - 1):
            raise ValueError(f"io_buffer must be a power of two of at least {MIN_CHUNK_SIZE}")
        self.root = root
        self.tmp_dir = root / "tmp"
        self.modes = modes
        self.read_only = read_only  # another user's shared store: reads only
        self.layout = Layout(root)
        self.lock = StoreLock(root, lock_timeout)
        self.space = Space(self.layout)
        self.leases = Leases(self.layout.locks, self.lock)
        self.manifests = Manifests(self.layout)
        self.partials = OpenPartials()
        self.quarantined = Quarantine(
            self.layout, self.lock, self.manifests, modes, read_only=read_only
        )
        self.reader = Reader(
            self.layout, self.manifests, self.partials, self.quarantined, io_buffer=io_buffer
        )
        self.writer = Writer(
            self.layout,
            self.lock,
            modes,
            space=self.space,
            manifests=self.manifests,
            partials=self.partials,
            quarantine=self.quarantined,
            leases=self.leases,
            io_buffer=io_buffer,
        )
        self.catalog = Catalog(
            self.layout, self.lock, modes, reader=self.reader, quarantine=self.quarantined
        )
        self.collector = Collector(
            self.layout,
            self.lock,
            catalog=self.catalog,
            reader=self.reader,
            manifests=self.manifests,
            quarantine=self.quarantined,
            leases=self.leases,
        )
        self.exporter = Exporter(
            self.layout, reader=self.reader, leases=self.leases, read_only=read_only
        )
        # The public surface: each method is its part's own.
        self.has = self.layout.has
        self.partial_ids = self.layout.partial_ids
        self.quarantined_ids = self.layout.quarantined_ids
        self.free_bytes = self.space.free_bytes
        self.space_to_finish = self.space.to_finish
        self.lease = self.leases.take
        self.quarantine = self.quarantined.quarantine
        self.quarantine_reason = self.quarantined.reason
        self.manifest = self.reader.manifest
        self.path = self.reader.path
        self.read_chunk = self.reader.read_chunk
        self.open_reader = self.reader.open_reader
        self.chunk_bitmap = self.reader.chunk_bitmap
        self.iter_verified = self.reader.iter_verified
        self.verify = self.reader.verify
        self.is_collection = self.reader.is_collection
        self.collection_entries = self.reader.collection_entries
        self.read_collection = self.reader.read_collection
        self.put_bytes = self.writer.put_bytes
        self.put_blocks = self.writer.put_blocks
        self.put_path = self.writer.put_path
        self.put_dir = self.writer.put_dir
        self.begin_partial = self.writer.begin_partial
        self.partial_writer = self.writer.partial_writer
        self.resolve = self.catalog.resolve
        self.tag = self.catalog.tag
        self.untag = self.catalog.untag
        self.tags = self.catalog.tags
        self.blob_ids = self.catalog.blob_ids
        self.list_blobs = self.catalog.list_blobs
        self.rm = self.collector.rm
        self.gc = self.collector.gc
        self.export = self.exporter.export
        self.check_export_space = self.exporter.check_export_space
        self.holds = self.exporter.holds

    @property
    def lock_timeout(self) -> float:
        """Seconds a wait for the store lock lasts before StoreBusy."""
        return self.lock.timeout

    @classmethod
    def open(
        cls,
        root: Path | str,
        *,
        shared: bool | None = None,
        lock_timeout: float | None = None,
        io_buffer: int = IO_BUFFER_SIZE,
    ) -> Store:
        """Open (creating if needed) the store at ``root`` and sweep dead temp files.

        ``shared``: None keeps the store's mode (a new store is private); True or False
        sets it, re-moding what is there (see :class:`FileModes`). Switch while no other
        process writes the store: one already running keeps creating files with the
        modes it opened with. ``lock_timeout``:
        seconds to wait for the store lock (default :data:`STORE_LOCK_TIMEOUT`, or the
        environment's :data:`LOCK_TIMEOUT_ENV`). ``io_buffer``: see :class:`Store`.

        Another user's shared store opens read-only (:attr:`read_only`): nothing is
        created, re-moded or swept, and whatever would write fails with exit 5.
        """
        root = Path(root).expanduser().absolute()
        timeout = _lock_timeout(lock_timeout)
        with os_errors(f"opening the store at {root}"):
            if root.is_dir() and root.stat().st_uid != os.geteuid():
                return cls._open_foreign(root, shared, timeout, io_buffer)
            created = not root.exists()
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            marker = root / MARKER_NAME
            if not marker.exists():
                allowed = {*DIRS, "lock", MARKER_NAME, SHARED_MARKER}
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
            Layout(root).make_dirs(modes)
            store = cls(root, modes=modes, lock_timeout=timeout, io_buffer=io_buffer)
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
    def _open_foreign(
        cls, root: Path, shared: bool | None, timeout: float, io_buffer: int
    ) -> Store:
        if shared is not None:
            raise StoreError(f"only the owner of {root} can change who may read it")
        text = (root / MARKER_NAME).read_text(errors="replace").strip()
        if text != f"blobnet store format {STORE_FORMAT}":
            raise StoreError(f"{root} is not a blobnet store this version can read ({text!r})")
        modes = SHARED_MODES if (root / SHARED_MARKER).exists() else PRIVATE_MODES
        return cls(root, modes=modes, lock_timeout=timeout, read_only=True, io_buffer=io_buffer)

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
        with self.lock.hold():
            self.collector.remove_orphan_manifests()
            self.leases.live_ids()
            for entry in os.scandir(self.layout.partial):
                fd = lock_path(Path(entry.path) / "lock")
                if fd is None:
                    continue
                try:
                    has_manifest = os.path.exists(os.path.join(entry.path, "manifest"))
                    if not has_manifest or self.has(entry.name):
                        shutil.rmtree(entry.path, ignore_errors=True)
                finally:
                    os.close(fd)


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


__all__ = ["Store"]
