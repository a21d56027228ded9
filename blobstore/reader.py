"""Reading many chunks of one blob through one open file.

A server answering ``get`` for a range of chunks would otherwise stat, open, read and
close the blob once per chunk. A reader opens it once, keeps the manifest, and reads each
chunk with one ``pread``. Chunks of a partial blob are served only when its bitmap (the
live one when this process writes it, else the persisted one, which marks only chunks
that were verified and fsynced) says they are held.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import TYPE_CHECKING

from blake3 import blake3

from blobstore import bitmap as bm
from blobstore.durable import os_errors
from blobstore.errors import ChunkUnavailable, CorruptChunk
from blobstore.manifest import Manifest
from blobstore.partial import PartialBlob, read_span

if TYPE_CHECKING:
    from blobstore.store import Store


class ChunkReader:
    """Open with :meth:`Store.open_reader`; close when done (or use ``with``)."""

    def __init__(
        self,
        blob_id: str,
        manifest: Manifest,
        *,
        fd: int | None,
        bits: bytes | bytearray | None,
        live: PartialBlob | None,
    ) -> None:
        self.blob_id = blob_id
        self.manifest = manifest
        self._fd = fd
        self._bits = bits
        self._live = live

    @classmethod
    def open(cls, store: Store, blob_id: str) -> ChunkReader:
        return store.open_reader(blob_id)

    def read(self, index: int, *, verify: bool = True) -> bytes:
        """Chunk ``index``; with ``verify`` it is hashed against the manifest again (the
        store verified every chunk on the way in, so this only guards against the disk)."""
        if self._live is not None:
            return self._live.read_chunk(index)
        if self._bits is not None and not bm.get_bit(self._bits, index):
            raise ChunkUnavailable(f"chunk {index} of {self.blob_id[:12]} is not held yet")
        if self._fd is None:
            raise ChunkUnavailable(f"reader for {self.blob_id[:12]} is closed")
        offset, length = self.manifest.chunk_span(index)
        with os_errors(f"reading chunk {index} of {self.blob_id[:12]}"):
            data = read_span(self._fd, offset, length)
        if len(data) != length or (
            verify and blake3(data).digest() != self.manifest.chunk_hash(index)
        ):
            raise CorruptChunk(
                f"chunk {index} of blob {self.blob_id} is corrupt on disk; run `blob verify`"
            )
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
