"""Collections: a directory as one blob (DESIGN section 2).

A collection blob's content is the canonical msgpack map::

    {"collection": 1, "entries": [[relative_path, blob_id, size], ...]}

with entries sorted by path (as Python sorts str) and no duplicates. The fixed leading
bytes (:data:`COLLECTION_MAGIC`) let :func:`looks_like_collection` recognise one from its
first few bytes. Paths are relative POSIX paths whose parts are never ``""``, ``"."`` or
``".."``, so exporting a collection can never write outside its destination, whatever
the blob came from. Decoding re-encodes and compares bytes, as manifests do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from blobstore.errors import BadCollection, BadManifest
from blobstore.manifest import MAX_BLOB_SIZE, parse_blob_id

COLLECTION_VERSION = 1
COLLECTION_MAGIC = b"\x82\xaacollection\x01"  # fixmap(2), fixstr "collection", 1

MAX_COLLECTION_ENTRIES = 1_000_000
"""Far above any model directory; bounds the work a hostile collection can cause."""

MAX_COLLECTION_SIZE = 256 * 1024 * 1024
"""Largest collection blob we decode (about 130 bytes per entry at the entry limit)."""

MAX_PATH_LENGTH = 4096  # PATH_MAX on Linux
MAX_NAME_LENGTH = 255  # NAME_MAX on Linux (bytes of one component)


@dataclass(frozen=True)
class CollectionEntry:
    """One file of a collection: its relative POSIX path, blob ID and size."""

    path: str
    blob_id: str
    size: int


def check_relpath(path: str) -> None:
    """Raise BadCollection unless ``path`` is a safe relative POSIX path."""
    if not isinstance(path, str) or not path:
        raise BadCollection(f"collection path {path!r} is empty or not text")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_LENGTH:
        raise BadCollection(f"collection path is longer than {MAX_PATH_LENGTH} bytes")
    if "\x00" in path or "\\" in path:
        raise BadCollection(f"collection path {path!r} contains NUL or a backslash")
    if path.startswith("/"):
        raise BadCollection(f"collection path {path!r} is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise BadCollection(f"collection path {path!r} has an empty, '.' or '..' part")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_LENGTH:
            raise BadCollection(f"collection path {path!r} has a part over {MAX_NAME_LENGTH} bytes")


def check_entries(entries: list[CollectionEntry]) -> None:
    """Paths safe, strictly sorted (so unique), no file standing where a directory must."""
    if len(entries) > MAX_COLLECTION_ENTRIES:
        raise BadCollection(f"collection has over {MAX_COLLECTION_ENTRIES} entries")
    files = set()
    for prev, entry in zip([None, *entries], entries, strict=False):
        check_relpath(entry.path)
        try:
            parse_blob_id(entry.blob_id)
        except Exception:
            raise BadCollection(f"collection entry {entry.path!r} has a bad blob ID") from None
        if type(entry.size) is not int or not 0 <= entry.size <= MAX_BLOB_SIZE:
            raise BadCollection(f"collection entry {entry.path!r} has a bad size {entry.size!r}")
        if prev is not None and not prev.path < entry.path:
            raise BadCollection(f"collection paths are not sorted and unique at {entry.path!r}")
        files.add(entry.path)
    for entry in entries:
        parts = entry.path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in files:
                raise BadCollection(f"collection path {entry.path!r} lies under a file")


def encode_collection(entries: list[CollectionEntry]) -> bytes:
    """Canonical bytes of a collection (entries are sorted here)."""
    ordered = sorted(entries, key=lambda e: e.path)
    check_entries(ordered)
    out: bytes = msgpack.packb(
        {
            "collection": COLLECTION_VERSION,
            "entries": [[e.path, e.blob_id, e.size] for e in ordered],
        },
        use_bin_type=True,
    )
    return out


def looks_like_collection(head: bytes) -> bool:
    """Whether a blob starting with ``head`` is meant to be a collection."""
    return head.startswith(COLLECTION_MAGIC)


def decode_collection(data: bytes) -> list[CollectionEntry]:
    """Strictly decode a collection; raise BadCollection on anything else."""
    if len(data) > MAX_COLLECTION_SIZE:
        raise BadCollection(f"collection is {len(data)} bytes, over {MAX_COLLECTION_SIZE}")
    if not looks_like_collection(data):
        raise BadCollection("blob is not a collection")
    try:
        obj: Any = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:
        raise BadCollection(f"collection is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or tuple(obj) != ("collection", "entries"):
        raise BadCollection("collection must be a map with keys collection, entries")
    raw_entries = obj["entries"]
    if not isinstance(raw_entries, list):
        raise BadCollection("collection entries must be a list")
    entries = []
    for item in raw_entries:
        if not isinstance(item, list) or len(item) != 3:
            raise BadCollection("collection entry must be [path, blob_id, size]")
        entries.append(CollectionEntry(path=item[0], blob_id=item[1], size=item[2]))
    check_entries(entries)
    try:
        canonical = encode_collection(entries)
    except (BadCollection, BadManifest):
        raise
    except Exception as exc:
        raise BadCollection(f"collection does not re-encode ({type(exc).__name__})") from None
    if canonical != data:
        raise BadCollection("collection is not in canonical form")
    return entries
