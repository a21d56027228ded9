"""Manifests and blob IDs (DESIGN section 2).

A blob is cut into chunks of ``c`` bytes (a power of two, 64 KiB to 16 MiB); the last
chunk may be shorter. Its manifest is the canonical msgpack map::

    {"v": 1, "size": N, "chunk": c, "hashes": <32 * ceil(N / c) bytes>}

with exactly these keys in this order and msgpack's smallest encodings, and the blob ID
is BLAKE3-256 of those bytes as 64 lowercase hex characters. The ID authenticates the
manifest and the manifest authenticates each chunk, so any chunk from anyone can be
checked the moment it arrives.

Canonical form is enforced by re-encoding: a decoded manifest is accepted only if
encoding it again gives the very same bytes. That one comparison rejects reordered or
duplicated keys, non-minimal integers, ``str8`` where ``fixstr`` fits, trailing bytes,
and every other second spelling of the same value, so one blob has exactly one ID.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from blake3 import blake3

from blobstore.errors import BadBlobId, BadManifest
from blobstore.schema import Field, Schema

HASH_SIZE = 32
"""BLAKE3-256 digest length in bytes."""

MANIFEST_VERSION = 1

MIN_CHUNK_SIZE = 64 * 1024
"""Smaller chunks make the manifest (32 bytes each) and per-request overhead dominate."""

DEFAULT_CHUNK_SIZE = 1024 * 1024
"""1 MiB: BLAKE3 hashes it in well under a millisecond and a lost chunk costs little to
refetch, while a 70 GB checkpoint still has a manageable 2.2 MB manifest."""

MAX_CHUNK_SIZE = 16 * 1024 * 1024
"""A chunk is the unit held in memory while it is verified; 16 MiB bounds that per
in-flight request and what a lying peer can make us buffer."""

MAX_CHUNKS = 1 << 19
"""At most 2^19 chunks: 512 GiB at the default chunk size, 8 TiB at the largest, with a
hash list of 16 MiB, which is also the most a peer's manifest can make us allocate. It is
what one manifest frame of the wire protocol carries (``p2p.blob.messages.MAX_MANIFEST_BYTES``),
so every blob this store accepts can also be served; a larger one is refused at ``put``
with the advice to use larger chunks (or a collection of shards, as checkpoints usually
are)."""

MAX_MANIFEST_SIZE = HASH_SIZE * MAX_CHUNKS + 64
"""The hash list plus room for the map header, keys and integers (41 bytes at most).
Checked before any decoding, so an oversized claim costs nothing."""

MAX_BLOB_SIZE = MAX_CHUNKS * MAX_CHUNK_SIZE
"""Derived: the largest blob a manifest can describe (8 TiB)."""

_BLOB_ID_RE = re.compile(r"[0-9a-f]{64}")


def parse_blob_id(text: str) -> str:
    """Return ``text`` if it is a blob ID (64 lowercase hex characters), else raise."""
    if not isinstance(text, str) or _BLOB_ID_RE.fullmatch(text) is None:
        shown = text if isinstance(text, str) and len(text) <= 80 else f"{str(text)[:80]}..."
        raise BadBlobId(f"not a blob ID (want 64 lowercase hex characters): {shown!r}")
    return text


def check_chunk_size(chunk_size: int) -> None:
    """Raise :class:`BadManifest` unless ``chunk_size`` is a power of two in range."""
    if (
        type(chunk_size) is not int
        or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
        or chunk_size & (chunk_size - 1)
    ):
        raise BadManifest(
            f"chunk size {chunk_size!r} is not a power of two between "
            f"{MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes"
        )


def num_chunks_for(size: int, chunk_size: int) -> int:
    """ceil(size / chunk_size)."""
    return -(-size // chunk_size)


_MANIFEST = Schema(
    "manifest",
    Field("v", int, const=MANIFEST_VERSION),
    Field("size", int),
    Field("chunk", int, attr="chunk_size"),
    Field("hashes", bytes),
)


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. Construction checks every limit and raises BadManifest."""

    size: int
    chunk_size: int
    hashes: bytes

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size)
        if type(self.size) is not int or not 0 <= self.size <= MAX_BLOB_SIZE:
            raise BadManifest(f"blob size {self.size!r} is outside 0..{MAX_BLOB_SIZE}")
        n = num_chunks_for(self.size, self.chunk_size)
        if n > MAX_CHUNKS:
            raise BadManifest(
                f"{self.size} bytes in {self.chunk_size}-byte chunks is {n} chunks, more than "
                f"the limit of {MAX_CHUNKS}; use a larger chunk size"
            )
        if type(self.hashes) is not bytes or len(self.hashes) != HASH_SIZE * n:
            got = len(self.hashes) if isinstance(self.hashes, bytes | bytearray) else "no"
            raise BadManifest(
                f"hash list has {got} bytes; a {self.size}-byte blob in {self.chunk_size}-byte "
                f"chunks needs {HASH_SIZE * n}"
            )

    @classmethod
    def of_bytes(
        cls, data: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> Manifest:
        """The manifest of ``data`` cut into ``chunk_size`` chunks."""
        check_chunk_size(chunk_size)
        view = memoryview(data).cast("B")
        hashes = b"".join(
            blake3(view[off : off + chunk_size]).digest() for off in range(0, len(view), chunk_size)
        )
        return cls(size=len(view), chunk_size=chunk_size, hashes=hashes)

    def encode(self) -> bytes:
        """The canonical msgpack bytes (the preimage of the blob ID)."""
        return _MANIFEST.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """Strictly decode canonical manifest bytes; anything else raises BadManifest."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise BadManifest(f"manifest must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_MANIFEST_SIZE:  # before unpacking: refuse without allocating
            raise BadManifest(
                f"manifest is {len(data)} bytes, over the limit of {MAX_MANIFEST_SIZE}"
            )
        manifest = cls(**_MANIFEST.decode(data, max_size=MAX_MANIFEST_SIZE, error=BadManifest))
        if manifest.encode() != data:
            raise BadManifest(
                "manifest is not in canonical form (keys, order or integer encodings)"
            )
        return manifest

    @cached_property
    def blob_id(self) -> str:
        """BLAKE3-256 of :meth:`encode`, 64 lowercase hex characters."""
        digest: str = blake3(self.encode()).hexdigest()
        return digest

    @property
    def num_chunks(self) -> int:
        return len(self.hashes) // HASH_SIZE

    def chunk_hash(self, index: int) -> bytes:
        """The BLAKE3-256 digest of chunk ``index``."""
        self._check_index(index)
        return self.hashes[index * HASH_SIZE : (index + 1) * HASH_SIZE]

    def chunk_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of chunk ``index`` within the blob."""
        self._check_index(index)
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} out of range (blob has {self.num_chunks} chunks)")
