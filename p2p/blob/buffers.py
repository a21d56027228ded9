"""A bounded pool of page-aligned buffers for chunk bodies in flight.

A fetched chunk is decrypted straight into one of these buffers by the stream that
receives it, then hashed and written to disk by a worker thread while the stream goes on
receiving the next chunk into another buffer. The pool bounds the fetcher's memory
(buffers x chunk size, whatever the blob's size) and makes a stream wait when every
buffer is still queued for the disk. Buffers are anonymous mmaps, so they are page
aligned, which lets the store write them with ``O_DIRECT``.
"""

from __future__ import annotations

import mmap

import trio


class ChunkBuffers:
    """``count`` buffers of ``size`` bytes each, allocated on first use."""

    def __init__(self, size: int, count: int) -> None:
        if size <= 0 or count <= 0:
            raise ValueError("buffer size and count must be positive")
        self.size = size
        self.count = count
        self._free: list[mmap.mmap] = []
        # Every buffer this pool made, by id, holding a reference so an id is never reused
        # by some other object while the pool lives.
        self._mine: dict[int, mmap.mmap] = {}
        self._slots = trio.Semaphore(count)

    async def acquire(self) -> mmap.mmap:
        """A free buffer; waits while all ``count`` are in use."""
        try:
            self._slots.acquire_nowait()  # no scheduler round trip in the common case
        except trio.WouldBlock:
            await self._slots.acquire()
        if self._free:
            return self._free.pop()
        buf = mmap.mmap(-1, self.size)
        self._mine[id(buf)] = buf
        return buf

    def owns(self, buf: object) -> bool:
        """Whether ``buf`` (or the buffer under a memoryview) came from this pool."""
        if isinstance(buf, memoryview):
            buf = buf.obj
        return isinstance(buf, mmap.mmap) and self._mine.get(id(buf)) is buf

    def release(self, buf: object) -> None:
        """Return a buffer, or a memoryview of one, to the pool; one that did not come from
        it (a body too large for the pool's buffers) is left to the garbage collector."""
        if isinstance(buf, memoryview):
            buf = buf.obj
        if not isinstance(buf, mmap.mmap) or self._mine.get(id(buf)) is not buf:
            return
        if buf in self._free:
            raise ValueError("buffer released twice")
        self._free.append(buf)
        self._slots.release()

    @property
    def in_use(self) -> int:
        return self.count - self._slots.value
