"""blobnet's chunked BLAKE3 blob store: manifests, IDs, the crash-safe store, collections.

See :mod:`blobstore.store` for the theory of operation.
"""

from __future__ import annotations

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
from blobstore.store import (
    DEFAULT_GC_GRACE,
    LOCK_TIMEOUT_ENV,
    STORE_LOCK_TIMEOUT,
    BlobInfo,
    ExportLink,
    FileModes,
    Store,
)

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
    "parse_blob_id",
]
