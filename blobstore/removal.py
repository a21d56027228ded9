"""Removing blobs: ``rm`` and garbage collection (invariant 6 of :mod:`blobstore.store`).

1. gc never deletes a tagged or leased blob, nor transitively a child of a tagged or
   leased collection, a partial someone holds, or anything modified within the grace.
2. A tagged quarantined blob that may be a collection stops gc: the children it pins
   are unknown.
3. The store lock is held only while deciding and renaming: what goes is renamed into
   ``tmp/`` and deleted after the lock is released (the next open sweeps what a crash
   left there).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from pathlib import Path

from blake3 import blake3

from blobstore.catalog import Catalog
from blobstore.collection import COLLECTION_MAGIC, looks_like_collection
from blobstore.durable import (
    TRASH_PREFIX,
    delete_trash,
    fsync_dir,
    lock_holder,
    lock_path,
    os_errors,
    sweep_temp_dir,
)
from blobstore.errors import BlobNotFound, CorruptChunk, PartialBusy, StoreCorrupt, StoreError
from blobstore.layout import MANIFEST_SUFFIX, Layout, is_blob_id
from blobstore.lease import Leases
from blobstore.manifest import parse_blob_id
from blobstore.manifests import Manifests
from blobstore.quarantine import Quarantine
from blobstore.reading import Reader
from blobstore.store_lock import StoreLock

DEFAULT_GC_GRACE = 3600.0
"""Seconds an untagged blob survives GC after it was last put: long enough for a
script to ``put`` then ``tag`` (or a collection's children to wait for their parent)."""


class Collector:
    """rm and gc of the store laid out as ``layout``."""

    def __init__(
        self,
        layout: Layout,
        lock: StoreLock,
        *,
        catalog: Catalog,
        reader: Reader,
        manifests: Manifests,
        quarantine: Quarantine,
        leases: Leases,
    ) -> None:
        self.layout = layout
        self.lock = lock
        self.catalog = catalog
        self.reader = reader
        self.manifests = manifests
        self.quarantine = quarantine
        self.leases = leases

    def rm(self, blob_id: str) -> None:
        """Remove a blob (complete, partial or quarantined) and every tag pointing at it."""
        parse_blob_id(blob_id)
        with os_errors(f"removing blob {blob_id[:12]}"), self.lock.hold():
            found = False
            data_path = self.layout.data_path(blob_id)
            if data_path.exists():
                data_path.unlink()
                self.layout.manifest_path(blob_id).unlink(missing_ok=True)
                fsync_dir(data_path.parent)
                found = True
            pdir = self.layout.partial_dir(blob_id)
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
            qdir = self.layout.quarantine_dir(blob_id)
            if qdir.exists():
                shutil.rmtree(qdir)
                found = True
            if not found:
                raise BlobNotFound(f"no blob {blob_id} in this store")
            for entry in os.scandir(self.layout.tags):
                with contextlib.suppress(StoreCorrupt, OSError):
                    if self.catalog.read_tag(Path(entry.path)) == blob_id:
                        os.unlink(entry.path)
            self.manifests.forget(blob_id)

    def _protected(self) -> set[str]:
        """Tagged and leased IDs plus, transitively, the children of such collections.
        Store lock held (live leases are read, stale ones deleted)."""
        keep: set[str] = set()
        todo = [*self.catalog.tags().values(), *self.leases.live_ids()]
        while todo:
            blob_id = todo.pop()
            if blob_id in keep:
                continue
            keep.add(blob_id)
            if not self.layout.has(blob_id) and self._quarantined_may_be_collection(blob_id):
                raise StoreCorrupt(
                    f"gc stopped: tagged blob {blob_id} is quarantined, so the children it "
                    "may pin are unknown; fetch it again or untag it, then run gc"
                )
            try:
                children = (
                    self.reader.collection_entries(blob_id) if self.layout.has(blob_id) else None
                )
                todo.extend(e.blob_id for e in children or ())
            except CorruptChunk as exc:  # quarantined just now
                raise StoreCorrupt(
                    f"gc stopped: tagged blob {blob_id[:12]} is corrupt ({exc})"
                ) from None
            except StoreError:
                continue  # a malformed collection pins nothing but itself
        return keep

    def _quarantined_may_be_collection(self, blob_id: str) -> bool:
        """Whether a quarantined blob could be a collection (so gc cannot know what it
        pins): False only when its first chunk still verifies and lacks the magic."""
        if self.quarantine.reason(blob_id) is None:
            return False
        manifest = self.manifests.get(blob_id)
        if manifest.size < len(COLLECTION_MAGIC):
            return False
        _, length = manifest.chunk_span(0)
        try:
            with open(self.layout.quarantine_dir(blob_id) / "data", "rb") as f:
                first = f.read(length)
        except FileNotFoundError:
            return True  # moved into a repair download: unknown until it is published
        if blake3(first).digest() != manifest.chunk_hash(0):
            return True
        return looks_like_collection(first)

    def gc(self, grace_seconds: float = DEFAULT_GC_GRACE, *, dry_run: bool = False) -> list[str]:
        """Delete untagged blobs and idle partials older than ``grace_seconds``.

        Returns the removed IDs (with ``dry_run``, those it would remove, removing none).
        Never touches a tagged or leased blob (or a child of a tagged or leased
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
                sweep_temp_dir(self.layout.tmp)
            with self.lock.hold():
                keep = self._protected()
                for blob_id in self.layout.complete_ids():
                    data_path = self.layout.data_path(blob_id)
                    if blob_id in keep or now - data_path.stat().st_mtime < grace_seconds:
                        continue
                    removed.append(blob_id)
                    if dry_run:
                        continue
                    doomed.append(self._to_trash(data_path))
                    self.layout.manifest_path(blob_id).unlink(missing_ok=True)
                    self.manifests.forget(blob_id)
                if not dry_run:
                    self.remove_orphan_manifests()
                for entry in os.scandir(self.layout.partial):
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
                        if is_blob_id(entry.name):
                            removed.append(entry.name)
                    finally:
                        os.close(fd)
                for entry in os.scandir(self.layout.quarantine):
                    if entry.name in keep or self.layout.has_partial(entry.name):
                        continue  # pinned, or a repair download is using it
                    newest = max((e.stat().st_mtime for e in os.scandir(entry.path)), default=0.0)
                    if now - newest >= grace_seconds:
                        if not dry_run:
                            doomed.append(self._to_trash(Path(entry.path)))
                        if is_blob_id(entry.name):
                            removed.append(entry.name)
            for path in doomed:
                delete_trash(path)
        return sorted(set(removed))

    def _to_trash(self, path: Path) -> str:
        """Rename ``path`` (a file or a directory) into ``tmp/`` under a trash name; the
        caller deletes it. Store lock held."""
        trash = os.path.join(self.layout.tmp, f"{TRASH_PREFIX}{secrets.token_hex(8)}")
        os.rename(path, trash)
        return trash

    def remove_orphan_manifests(self) -> None:
        """Delete manifests whose data never arrived (a crash between the two renames).

        Store lock held: no publication is half done, so every such manifest is dead.
        """
        for shard in os.scandir(self.layout.blobs):
            names = set(os.listdir(shard.path))
            for name in names:
                if name.endswith(MANIFEST_SUFFIX) and name[: -len(MANIFEST_SUFFIX)] not in names:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(shard.path, name))
