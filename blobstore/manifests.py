"""The manifests a store holds, read and checked against their IDs.

1. A stored manifest must decode (canonical) and hash to the ID it is filed under, or it
   is StoreCorrupt: the store's own file is damaged.
2. Manifests of complete blobs are immutable, so a few are cached; those of partial and
   quarantined blobs are read afresh each time. Whoever unpublishes a blob (quarantine,
   rm, gc) calls :meth:`Manifests.forget`.
3. A manifest file larger than any valid manifest is refused before it is read.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from blobstore.durable import os_errors
from blobstore.errors import BadManifest, BlobNotFound, StoreCorrupt
from blobstore.layout import Layout
from blobstore.manifest import MAX_MANIFEST_SIZE, Manifest, parse_blob_id

MANIFEST_CACHE_SIZE = 256  # manifests are immutable; cache a few for chunk serving


class Manifests:
    """The manifests of the store laid out as ``layout``, the complete ones cached."""

    def __init__(self, layout: Layout, cache_size: int = MANIFEST_CACHE_SIZE) -> None:
        self.layout = layout
        self.cache_size = cache_size
        self._mutex = threading.Lock()
        self._cache: dict[str, Manifest] = {}

    def get(self, blob_id: str) -> Manifest:
        """The manifest of a complete, partial or quarantined blob."""
        parse_blob_id(blob_id)
        with self._mutex:
            cached = self._cache.get(blob_id)
        if cached is not None:
            return cached
        with os_errors(f"reading the manifest of {blob_id[:12]}"):
            complete = True
            try:
                data = read_limited(self.layout.manifest_path(blob_id), MAX_MANIFEST_SIZE)
            except FileNotFoundError:
                complete = False
                data = self._read_other(blob_id)
        try:
            manifest = Manifest.decode(data)
        except BadManifest as exc:
            raise StoreCorrupt(f"stored manifest of {blob_id} is damaged ({exc})") from None
        if manifest.blob_id != blob_id:
            raise StoreCorrupt(f"stored manifest of {blob_id} does not match its ID")
        if complete:
            with self._mutex:
                if len(self._cache) >= self.cache_size:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[blob_id] = manifest
        return manifest

    def forget(self, blob_id: str) -> None:
        """Drop a cached manifest: the blob was unpublished."""
        with self._mutex:
            self._cache.pop(blob_id, None)

    def _read_other(self, blob_id: str) -> bytes:
        """The manifest of a partial or quarantined blob (not cached: they change)."""
        for path in (
            self.layout.partial_dir(blob_id) / "manifest",
            self.layout.quarantine_dir(blob_id) / "manifest",
        ):
            with contextlib.suppress(FileNotFoundError):
                return read_limited(path, MAX_MANIFEST_SIZE)
        raise BlobNotFound(f"no blob {blob_id} in this store")


def read_limited(path: Path, limit: int) -> bytes:
    """The file's bytes, refusing one over ``limit`` before reading it. (``read(limit)``
    would allocate ``limit`` bytes up front: 32 MiB for every manifest read.)"""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise StoreCorrupt(f"{path} is larger than any valid manifest")
        data = f.read()
    if len(data) > limit:  # grew while being read
        raise StoreCorrupt(f"{path} is larger than any valid manifest")
    return data
