"""blobnet's chunked BLAKE3 blob store: manifests, IDs, the crash-safe store, collections.

See :mod:`blobstore.store` for the theory of operation.

File modes: a store is private by default. Its root and directories are 0700, complete
blobs and manifests 0400, everything else the store writes 0600, set explicitly whatever
the umask. ``Store.open(root, shared=True)`` (or ``blob store-mode shared``) makes it
readable by other users (directories 0755, blobs 0444, other files 0644) and it stays
shared for every later opener until ``shared=False``; another user then opens it
read-only. In both modes ``tmp/`` and ``locks/`` stay 0700 and every lock file 0600, so
no other user can take the store lock or a partial's lock, and waiting for the store lock
is bounded (``STORE_LOCK_TIMEOUT``, ``BLOBNET_LOCK_TIMEOUT``): then StoreBusy, exit 5,
naming the holder's PID. The full table is in :mod:`blobstore.store`.

For other packages: :meth:`Store.quarantine` takes a blob found rotten out of the
published set (``verify`` and verifying reads call it themselves), :meth:`Store.lease`
keeps what a running operation needs safe from gc, and :meth:`Store.export` takes
``verify=False`` and ``link=`` for exports right after a fetch.
"""

from __future__ import annotations

from blobstore.catalog import BlobInfo
from blobstore.collection import CollectionEntry
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
from blobstore.exporting import ExportLink
from blobstore.layout import FileModes
from blobstore.lease import Lease
from blobstore.manifest import (
    DEFAULT_CHUNK_SIZE,
    MAX_BLOB_SIZE,
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MAX_MANIFEST_SIZE,
    MIN_CHUNK_SIZE,
    Manifest,
    parse_blob_id,
)
from blobstore.partial import PartialBlob
from blobstore.reader import ChunkReader
from blobstore.removal import DEFAULT_GC_GRACE
from blobstore.store import Store
from blobstore.store_lock import LOCK_TIMEOUT_ENV, STORE_LOCK_TIMEOUT
from blobstore.writing import blob_id_of

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_GC_GRACE",
    "LOCK_TIMEOUT_ENV",
    "MAX_BLOB_SIZE",
    "MAX_CHUNKS",
    "MAX_CHUNK_SIZE",
    "MAX_MANIFEST_SIZE",
    "MIN_CHUNK_SIZE",
    "STORE_LOCK_TIMEOUT",
    "AmbiguousPrefix",
    "BadBlobId",
    "BadCollection",
    "BadManifest",
    "BadTagName",
    "BlobExists",
    "BlobInfo",
    "BlobNotFound",
    "BlobQuarantined",
    "ChunkReader",
    "ChunkUnavailable",
    "CollectionEntry",
    "CorruptChunk",
    "ExportLink",
    "FileChanged",
    "FileModes",
    "Lease",
    "Manifest",
    "NoSpace",
    "PartialBlob",
    "PartialBusy",
    "PathNotFound",
    "Store",
    "StoreBusy",
    "StoreCorrupt",
    "StoreError",
    "blob_id_of",
    "parse_blob_id",
]
