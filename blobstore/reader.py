"""Reading many chunks of one blob through one open file.

A server answering ``get`` for a range of chunks would otherwise stat, open, read and
close the blob once per chunk. A reader opens it once, keeps the manifest, and reads each
chunk with one ``pread``. Chunks of a partial blob are served only when its bitmap (the
live one when this process writes it, else the persisted one, which marks only chunks
that were verified and fsynced) says they are held.

A chunk of a complete blob that fails its hash (``verify``, the default) quarantines
the blob (:meth:`Store.quarantine`): it stops being advertised and served at once.

``read_into`` fills a caller's buffer instead (no allocation per chunk) and, with
``cached_only``, reads only what the page cache already holds (``RWF_NOWAIT``), so an
event loop can serve hot chunks inline and send only cold ones to a worker thread.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from types import TracebackType

from blake3 import blake3

from blobstore import bitmap as bm
from blobstore.durable import os_errors
from blobstore.errors import ChunkUnavailable, CorruptChunk
from blobstore.manifest import Manifest
from blobstore.partial import PartialBlob

# preadv flag: fail with EAGAIN rather than wait for the disk (Linux 4.14+).
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


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
        on_corrupt: Callable[[str], str] | None = None,
    ) -> None:
        self.blob_id = blob_id
        self.manifest = manifest
        self._fd = fd
        self._bits = bits
        self._live = live
        # Called (outside the event loop: never with cached_only) when a chunk of a
        # complete blob fails its hash; the store quarantines the blob and returns a
        # tail for the message.
        self._on_corrupt = on_corrupt
        # Cleared when the file system refuses RWF_NOWAIT (tmpfs does), to stop asking.
        self._nowait = bool(_RWF_NOWAIT)

    def read(self, index: int, *, verify: bool = True) -> bytes:
        """Chunk ``index``; with ``verify`` it is hashed against the manifest again (the
        store verified every chunk on the way in, so this only guards against the disk)."""
        out = bytearray(self.manifest.chunk_span(index)[1])
        self.read_into(index, memoryview(out), verify=verify)
        return bytes(out)

    def read_into(
        self, index: int, out: memoryview, *, verify: bool = True, cached_only: bool = False
    ) -> bool:
        """Fill ``out`` (exactly the chunk's length) with chunk ``index``. With
        ``cached_only``, return False instead of waiting for the disk (nothing is
        guaranteed about ``out`` then); call again without it, from a thread."""
        offset, length = self.manifest.chunk_span(index)
        if len(out) != length:
            raise ValueError(f"buffer of {len(out)} bytes for a {length}-byte chunk")
        if self._live is not None:
            if cached_only:
                return False  # a partial being written here: go through its checks
            out[:] = self._live.read_chunk(index)
            return True
        if self._bits is not None and not bm.get_bit(self._bits, index):
            raise ChunkUnavailable(f"chunk {index} of {self.blob_id[:12]} is not held yet")
        if self._fd is None:
            raise ChunkUnavailable(f"reader for {self.blob_id[:12]} is closed")
        if cached_only and not self._nowait:
            return False
        flags = _RWF_NOWAIT if cached_only else 0
        pos = 0
        with os_errors(f"reading chunk {index} of {self.blob_id[:12]}"):
            while pos < length:
                try:
                    n = os.preadv(self._fd, [out[pos:]], offset + pos, flags)
                except OSError as exc:
                    if cached_only and exc.errno == errno.EOPNOTSUPP:
                        self._nowait = False
                        return False
                    if cached_only and exc.errno == errno.EAGAIN:
                        return False
                    raise
                if n == 0:
                    break
                pos += n
        if pos != length or (verify and blake3(out).digest() != self.manifest.chunk_hash(index)):
            what = f"chunk {index} of blob {self.blob_id} is corrupt on disk"
            if self._on_corrupt is None or cached_only:
                raise CorruptChunk(what + "; run `blob verify`")
            raise CorruptChunk(what + self._on_corrupt(what))
        return True

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
