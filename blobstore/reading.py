"""Reading a store: manifests, paths, chunk readers, verifying reads, collections.

1. An ID names only matching bytes (invariant 3 of :mod:`blobstore.store`): every read
   here that returns bytes hashes them first, and a complete blob whose bytes fail is
   quarantined on the spot (:mod:`blobstore.quarantine`).
2. Manifests of complete blobs are immutable, so a few are cached; those of partial and
   quarantined blobs are read afresh each time.
3. A manifest file larger than any valid manifest is refused before it is read.

The chunk reader itself is :mod:`blobstore.reader`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from blake3 import blake3

from blobstore import bitmap as bm
from blobstore.collection import (
    COLLECTION_MAGIC,
    MAX_COLLECTION_SIZE,
    CollectionEntry,
    decode_collection_pieces,
    looks_like_collection,
)
from blobstore.durable import os_errors
from blobstore.errors import (
    BadCollection,
    BadManifest,
    BlobNotFound,
    BlobQuarantined,
    ChunkUnavailable,
    CorruptChunk,
    StoreCorrupt,
)
from blobstore.layout import IO_BUFFER_SIZE, read_full
from blobstore.manifest import MAX_MANIFEST_SIZE, Manifest, parse_blob_id
from blobstore.partial import load_bitmap, read_span
from blobstore.quarantine import QuarantineOps
from blobstore.reader import ChunkReader

_MANIFEST_CACHE_SIZE = 256  # manifests are immutable; cache a few for chunk serving


class ReadOps(QuarantineOps):
    """Manifests, paths, chunk readers, verification, collections."""

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
                data = read_limited(self._manifest_path(blob_id), MAX_MANIFEST_SIZE)
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
                return read_limited(path, MAX_MANIFEST_SIZE)
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
                    n = read_full(fd, buf[: min(len(buf), remaining)])
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
