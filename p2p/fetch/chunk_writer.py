"""Dedicated threads that write fetched chunks into a partial blob.

``PartialBlob.write_chunk`` blocks (an ``O_DIRECT`` write, and BLAKE3 unless the caller
hashed already), so it runs off the event loop. A download owns a small, fixed set of
threads fed through one queue, and each answer goes back to the waiting task with a single
``run_sync_soon``; ``trio.to_thread`` per chunk would spread consecutive chunks over its
thread cache (seven threads seen in one fetch), each woken, named and limited per job.

The gain is hashing while the bytes are still in the receiving core's cache, and one
thread taking the GIL once per chunk rather than competing for it around every call; the
thread plumbing alone, with the hash in the thread, is within a small VM's noise. On the
2-vCPU VM, six alternating rounds of 2 GiB fetches from one provider: hashing each chunk
on arrival and leaving only the write to one such thread, 478-508 MB/s; ``trio.to_thread``
doing both, 301-470 (slower in every pair).
"""

from __future__ import annotations

import os
import queue
import threading
from types import TracebackType
from typing import Protocol

import outcome
import trio

# Hashing, when left to the writer threads (see p2p.fetch.download_parts.HASH_ON_ARRIVAL), runs at
# about 3 GB/s per thread; more threads also keep several writes in flight on fast disks.
MAX_WRITER_THREADS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_writer_threads() -> int:
    """Half the usable CPUs, between 1 and ``MAX_WRITER_THREADS``."""
    return max(1, min(MAX_WRITER_THREADS, usable_cpus() // 2))


class ChunkSink(Protocol):
    """What the writer writes into (``blobstore.PartialBlob``)."""

    def write_chunk(self, index: int, data: memoryview, *, digest: bytes | None = None) -> bool: ...


_Job = tuple[int, memoryview, bytes | None, trio.lowlevel.Task]


class ChunkWriter:
    """``async with ChunkWriter(partial) as writer: await writer.write(index, data)``.

    ``write`` returns what ``partial.write_chunk`` returns and raises what it raises. It
    is not abandoned when its caller is cancelled: the thread owns ``data`` until the call
    returns, and the cancellation arrives at the caller's next checkpoint. Leaving the
    block waits for the writes already queued, then stops the threads.
    """

    def __init__(self, partial: ChunkSink, threads: int | None = None) -> None:
        count = default_writer_threads() if threads is None else threads
        if count < 1:
            raise ValueError("a chunk writer needs at least one thread")
        self._partial = partial
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"blobnet chunk writer {i}", daemon=True)
            for i in range(count)
        ]
        self._token: trio.lowlevel.TrioToken | None = None
        self._open = False

    @property
    def threads(self) -> int:
        return len(self._threads)

    async def __aenter__(self) -> ChunkWriter:
        if self._token is not None:
            raise RuntimeError("a ChunkWriter can be entered once")
        self._token = trio.lowlevel.current_trio_token()
        for thread in self._threads:
            thread.start()
        self._open = True
        return self

    @trio.lowlevel.enable_ki_protection
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        for _ in self._threads:
            self._jobs.put(None)  # after every job already queued
        with trio.CancelScope(shield=True):
            for thread in self._threads:
                await trio.to_thread.run_sync(thread.join)

    # KeyboardInterrupt must not land between queueing the job and waiting for it: the
    # thread would later reschedule a task that had exited (TrioInternalError).
    @trio.lowlevel.enable_ki_protection
    async def write(self, index: int, data: memoryview, digest: bytes | None = None) -> bool:
        """``partial.write_chunk(index, data, digest=digest)`` in a writer thread."""
        if not self._open:
            raise RuntimeError("ChunkWriter.write outside its `async with` block")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._jobs.put((index, data, digest, trio.lowlevel.current_task()))

        def abort(_: object) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED  # the thread still owns `data`

        result: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    def _work(self) -> None:
        token = self._token
        assert token is not None
        write_chunk = self._partial.write_chunk
        while (job := self._jobs.get()) is not None:
            index, data, digest, task = job
            result = outcome.capture(write_chunk, index, data, digest=digest)
            del data, job  # the waiting task owns the buffer again once rescheduled
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)
