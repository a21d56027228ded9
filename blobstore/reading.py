"""Reading a store: paths, chunk readers, verifying reads, collections.

1. An ID names only matching bytes (invariant 3 of :mod:`blobstore.store`): every read
   here that returns bytes hashes them first, and a complete blob whose bytes fail is
   quarantined on the spot (:mod:`blobstore.quarantine`).
2. A blob this process is writing is read through its live partial (:class:`OpenPartials`),
   whose bitmap is newer than the one on disk.

Manifests are :mod:`blobstore.manifests`; the chunk reader itself is :mod:`blobstore.reader`.
"""

from __future__ import annotations

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
    BlobNotFound,
    BlobQuarantined,
    ChunkUnavailable,
    CorruptChunk,
)
from blobstore.layout import IO_BUFFER_SIZE, Layout, read_full
from blobstore.manifest import Manifest
from blobstore.manifests import Manifests
from blobstore.partial import OpenPartials, load_bitmap, read_span
from blobstore.quarantine import Quarantine
from blobstore.reader import ChunkReader


class Reader:
    """Reads of the store laid out as ``layout``: paths, chunk readers, verification,
    collections. ``io_buffer``: bytes per read of a whole blob (a power of two)."""

    def __init__(
        self,
        layout: Layout,
        manifests: Manifests,
        partials: OpenPartials,
        quarantine: Quarantine,
        *,
        io_buffer: int = IO_BUFFER_SIZE,
    ) -> None:
        self.layout = layout
        self.manifests = manifests
        self.partials = partials
        self.quarantine = quarantine
        self.io_buffer = io_buffer

    def manifest(self, blob_id: str) -> Manifest:
        """The manifest of a complete, partial or quarantined blob."""
        return self.manifests.get(blob_id)

    def path(self, blob_id: str) -> Path:
        """The read-only file holding exactly the complete blob's bytes (mmap it)."""
        if not self.layout.has(blob_id):
            self.quarantine.refuse(blob_id)
            raise BlobNotFound(f"no complete blob {blob_id} in this store")
        return self.layout.data_path(blob_id)

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
        live = self.partials.get(blob_id)
        if live is not None:
            return ChunkReader(blob_id, manifest, fd=None, bits=None, live=live)
        with os_errors(f"opening {blob_id[:12]} for reading"):
            complete = self.layout.has(blob_id)
            if complete:
                source, bits = self.layout.data_path(blob_id), None
            else:
                bits = load_bitmap(self.layout.partial_dir(blob_id) / "bitmap", manifest.num_chunks)
                source = self.layout.partial_dir(blob_id) / "data"
            try:
                fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed (or published) meanwhile
                self.quarantine.refuse(blob_id)
                raise BlobNotFound(f"no blob {blob_id} in this store") from None
        opened = os.fstat(fd)
        on_corrupt = (
            (lambda what: self.quarantine.on_read(blob_id, what, opened)) if complete else None
        )
        return ChunkReader(blob_id, manifest, fd=fd, bits=bits, live=None, on_corrupt=on_corrupt)

    def chunk_bitmap(self, blob_id: str) -> bytes:
        """Bit i set = chunk i held and verified (see :mod:`blobstore.bitmap`)."""
        manifest = self.manifest(blob_id)
        if self.layout.has(blob_id):
            return bm.full_bitmap(manifest.num_chunks)
        live = self.partials.get(blob_id)
        if live is not None:
            return live.bitmap
        with os_errors(f"reading the bitmap of {blob_id[:12]}"):
            bitmap = self.layout.partial_dir(blob_id) / "bitmap"
            return bytes(load_bitmap(bitmap, manifest.num_chunks))

    def iter_verified(self, blob_id: str) -> Iterator[memoryview]:
        """The complete blob's bytes in large pieces, each chunk checked on the way.

        Each piece is a view of a reused buffer: consume it before asking for the next.
        Raises CorruptChunk at the first chunk that fails, having quarantined the blob.
        """
        manifest = self.manifest(blob_id)
        path = self.path(blob_id)
        c = manifest.chunk_size
        buf = memoryview(bytearray(max(self.io_buffer, c)))
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
                    raise CorruptChunk(what + self.quarantine.on_read(blob_id, what, read_from))
                for off in range(0, n, c):
                    if blake3(buf[off : min(off + c, n)]).digest() != manifest.chunk_hash(index):
                        what = f"chunk {index} of blob {blob_id} is corrupt on disk"
                        tail = self.quarantine.on_read(blob_id, what, read_from)
                        raise CorruptChunk(what + tail)
                    index += 1
                remaining -= n
                yield buf[:n]
        finally:
            os.close(fd)

    def verify(self, blob_id: str, *, quarantine: bool = True) -> list[int]:
        """Indices of chunks whose stored bytes fail their hash ([] = intact).

        A complete blob is checked whole and, if any chunk fails and ``quarantine`` is
        set, quarantined (see :meth:`Quarantine.quarantine`; not in another user's store, which is
        read-only here); a partial one, the chunks it marks
        verified; a quarantined one, its quarantined copy (or the partial seeded from it).
        Raises StoreCorrupt if the manifest itself is damaged.
        """
        manifest = self.manifest(blob_id)
        n = manifest.num_chunks
        complete = self.layout.has(blob_id)
        qdata = self.layout.quarantine_dir(blob_id) / "data"
        if complete:
            source = self.layout.data_path(blob_id)
            indices: Iterable[int] = range(n)
        elif not self.layout.has_partial(blob_id) and qdata.exists():
            source, indices = qdata, range(n)
        else:
            source = self.layout.partial_dir(blob_id) / "data"
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
        if bad and complete and quarantine and not self.quarantine.read_only:
            shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
            reason = f"verify found {len(bad)} corrupt chunk(s): {shown}"
            self.quarantine.quarantine(blob_id, reason, read_from=read_from)
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
        if not self.layout.has(blob_id) or manifest.size < len(COLLECTION_MAGIC):
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
