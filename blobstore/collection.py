"""Collections: a directory as one blob (DESIGN section 2).

A collection blob's content is the canonical msgpack map::

    {"collection": 1, "entries": [[relative_path, blob_id, size], ...]}

with entries sorted by path (as Python sorts str) and no duplicates. The fixed leading
bytes (:data:`COLLECTION_MAGIC`) let :func:`looks_like_collection` recognise one from its
first few bytes. Paths are relative POSIX paths whose parts are never ``""``, ``"."`` or
``".."``, so exporting a collection can never write outside its destination, whatever
the blob came from.

Decoding is incremental (:func:`decode_collection_pieces`): the bytes are fed to a
bounded ``msgpack.Unpacker`` a little at a time, the entry count is read from the array
header and refused above :data:`MAX_COLLECTION_ENTRIES` before anything is allocated for
it, and each entry is checked the moment it is decoded, so a hostile blob fails at its
first bad entry. Memory stays proportional to the entries actually accepted (about three
times their encoded size), never to what a header claims. Canonical form is checked by
hashing the raw bytes and the re-encoding of what was decoded, side by side, and
comparing at the end: no second copy of the blob is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
from blake3 import blake3

from blobstore.canonical import encode as encode_canonical
from blobstore.errors import BadCollection
from blobstore.manifest import MAX_BLOB_SIZE, parse_blob_id

COLLECTION_VERSION = 1
COLLECTION_MAGIC = b"\x82\xaacollection\x01"  # fixmap(2), fixstr "collection", 1

MAX_COLLECTION_ENTRIES = 1_000_000
"""Far above any model directory; bounds the work a hostile collection can cause."""

MAX_COLLECTION_SIZE = 256 * 1024 * 1024
"""Largest collection blob we decode (about 130 bytes per entry at the entry limit)."""

MAX_PATH_LENGTH = 4096  # PATH_MAX on Linux
MAX_NAME_LENGTH = 255  # NAME_MAX on Linux (bytes of one component)

DECODE_READ_SIZE = 16 * 1024
"""Bytes the decoder takes from the blob at a time."""

DECODE_BUFFER_LIMIT = 64 * 1024
"""Most bytes the decoder buffers for one msgpack object. A valid entry is under 4.2 KiB
(a 4096-byte path, a 64-character ID, a size); anything that needs more is hostile. It
also bounds what one hostile entry can allocate: at most one object per byte (about
64 Ki small objects, a few MiB), however its arrays nest."""

_CANONICAL_BATCH = 64 * 1024  # re-encoded bytes hashed per blake3 call


@dataclass(frozen=True, slots=True)
class CollectionEntry:
    """One file of a collection: its relative POSIX path, blob ID and size."""

    path: str
    blob_id: str
    size: int


def check_relpath(path: str) -> None:
    """Raise BadCollection unless ``path`` is a safe relative POSIX path."""
    if not isinstance(path, str) or not path:
        raise BadCollection(f"collection path {path!r} is empty or not text")
    # UTF-8 takes at most 4 bytes a character: encode only a path that might be too long.
    if len(path) * 4 > MAX_PATH_LENGTH and len(path.encode("utf-8", "surrogateescape")) > (
        MAX_PATH_LENGTH
    ):
        raise BadCollection(f"collection path is longer than {MAX_PATH_LENGTH} bytes")
    if "\x00" in path or "\\" in path:
        raise BadCollection(f"collection path {path!r} contains NUL or a backslash")
    if path.startswith("/"):
        raise BadCollection(f"collection path {path!r} is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise BadCollection(f"collection path {path!r} has an empty, '.' or '..' part")
        if len(part) * 4 > MAX_NAME_LENGTH and (
            len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_LENGTH
        ):
            raise BadCollection(f"collection path {path!r} has a part over {MAX_NAME_LENGTH} bytes")


class _EntryChecker:
    """Checks entries one at a time, in order: safe paths, strictly sorted (so unique),
    valid IDs and sizes, and no file standing where a directory must."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.prev: str | None = None

    def add(self, entry: CollectionEntry) -> None:
        check_relpath(entry.path)
        try:
            parse_blob_id(entry.blob_id)
        except Exception:
            raise BadCollection(f"collection entry {entry.path!r} has a bad blob ID") from None
        if type(entry.size) is not int or not 0 <= entry.size <= MAX_BLOB_SIZE:
            raise BadCollection(f"collection entry {entry.path!r} has a bad size {entry.size!r}")
        if self.prev is not None and not self.prev < entry.path:
            raise BadCollection(f"collection paths are not sorted and unique at {entry.path!r}")
        # Sorted order puts every proper prefix ("a") before the paths under it ("a/b").
        slash = entry.path.find("/")
        while slash != -1:
            if entry.path[:slash] in self.files:
                raise BadCollection(f"collection path {entry.path!r} lies under a file")
            slash = entry.path.find("/", slash + 1)
        self.files.add(entry.path)
        self.prev = entry.path


def check_entries(entries: list[CollectionEntry]) -> None:
    """Paths safe, strictly sorted (so unique), no file standing where a directory must."""
    if len(entries) > MAX_COLLECTION_ENTRIES:
        raise BadCollection(f"collection has over {MAX_COLLECTION_ENTRIES} entries")
    checker = _EntryChecker()
    for entry in entries:
        checker.add(entry)


def encode_collection(entries: list[CollectionEntry]) -> bytes:
    """Canonical bytes of a collection (entries are sorted here)."""
    ordered = sorted(entries, key=lambda e: e.path)
    check_entries(ordered)
    out: bytes = encode_canonical(
        {
            "collection": COLLECTION_VERSION,
            "entries": [[e.path, e.blob_id, e.size] for e in ordered],
        }
    )
    return out


def looks_like_collection(head: bytes | bytearray | memoryview) -> bool:
    """Whether a blob starting with ``head`` is meant to be a collection."""
    return bytes(head[: len(COLLECTION_MAGIC)]) == COLLECTION_MAGIC


class _PieceStream:
    """A file-like ``read`` over pieces of bytes, hashing everything it hands out.

    Pieces may be views of a reused buffer (:meth:`Store.iter_verified`): each is copied
    out in small slices before the next is asked for."""

    def __init__(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        self._pieces: Iterator[bytes | bytearray | memoryview] = iter(pieces)
        self._current = memoryview(b"")
        self.hasher = blake3()
        self.consumed = 0

    def read(self, n: int) -> bytes:
        while not self._current:
            piece = next(self._pieces, None)
            if piece is None:
                return b""
            self._current = memoryview(piece).cast("B")
        out = bytes(self._current[:n])
        self._current = self._current[len(out) :]
        self.hasher.update(out)
        self.consumed += len(out)
        return out


def decode_collection(data: bytes | bytearray | memoryview) -> list[CollectionEntry]:
    """Strictly decode a collection; raise BadCollection on anything else."""
    return decode_collection_pieces([data], len(data))


def decode_collection_pieces(
    pieces: Iterable[bytes | bytearray | memoryview], size: int
) -> list[CollectionEntry]:
    """Strictly and incrementally decode the collection whose ``size`` bytes arrive as
    ``pieces``; raise BadCollection on anything else (see the module docstring)."""
    if size > MAX_COLLECTION_SIZE:
        raise BadCollection(f"collection is {size} bytes, over {MAX_COLLECTION_SIZE}")
    stream = _PieceStream(pieces)
    unpacker = msgpack.Unpacker(
        stream,
        read_size=DECODE_READ_SIZE,
        max_buffer_size=DECODE_BUFFER_LIMIT,
        raw=False,
        use_list=True,
        strict_map_key=True,
        max_str_len=MAX_PATH_LENGTH,
        max_bin_len=0,
        max_ext_len=0,
        max_map_len=2,
        max_array_len=3,  # entries' own header is read with read_array_header
    )
    try:
        entries = _decode(unpacker, stream)
    except BadCollection:
        raise
    except Exception as exc:
        raise BadCollection(f"collection is not valid msgpack ({type(exc).__name__})") from None
    if stream.consumed != size:
        raise BadCollection(f"collection has {stream.consumed} bytes, its manifest says {size}")
    return entries


def _decode(unpacker: msgpack.Unpacker, stream: _PieceStream) -> list[CollectionEntry]:
    canonical = blake3()
    if unpacker.read_map_header() != 2:
        raise BadCollection("collection must be a map with keys collection, entries")
    key: Any = unpacker.unpack()
    version: Any = unpacker.unpack()
    if key != "collection":
        raise BadCollection("collection must be a map with keys collection, entries")
    if type(version) is not int or version != COLLECTION_VERSION:
        raise BadCollection(f"collection version {version!r} is not {COLLECTION_VERSION}")
    if unpacker.unpack() != "entries":
        raise BadCollection("collection must be a map with keys collection, entries")
    count = unpacker.read_array_header()
    if count > MAX_COLLECTION_ENTRIES:  # before anything is allocated for them
        raise BadCollection(f"collection claims {count} entries, over {MAX_COLLECTION_ENTRIES}")
    packer = msgpack.Packer(use_bin_type=True)
    canonical.update(COLLECTION_MAGIC + packer.pack("entries") + packer.pack_array_header(count))
    checker = _EntryChecker()
    entries = []
    pending = bytearray()
    for _ in range(count):
        item: Any = unpacker.unpack()  # at most DECODE_BUFFER_LIMIT bytes, arrays of 3
        if type(item) is not list or len(item) != 3:
            raise BadCollection("collection entry must be [path, blob_id, size]")
        entry = CollectionEntry(path=item[0], blob_id=item[1], size=item[2])
        checker.add(entry)
        pending += packer.pack(item)
        if len(pending) >= _CANONICAL_BATCH:
            canonical.update(pending)
            pending.clear()
        entries.append(entry)
    canonical.update(pending)
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        pass
    else:
        raise BadCollection("collection has trailing data after its entries")
    if stream.hasher.digest() != canonical.digest():
        raise BadCollection("collection is not in canonical form")
    return entries
