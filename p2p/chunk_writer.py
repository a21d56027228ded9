"""Dedicated threads that verify and write fetched chunks into a partial blob.

A fetched chunk is hashed against its manifest and written with ``O_DIRECT`` by
``PartialBlob.write_chunk``, which blocks (BLAKE3 and the disk), so it runs off the event
loop. One ``trio.to_thread.run_sync`` per 1 MiB chunk was measured to cost the fetcher
more than the hashing itself on a 2-vCPU machine: each call goes through trio's thread
cache (a thread per concurrent call, woken and named per job, with a capacity limiter and
a context copy), and the extra runnable threads preempt the event loop that receives the
next chunk. Here a download owns a fixed, small set of threads fed through one queue;
each answer goes back to the waiting task with a single ``run_sync_soon``. In
``bench/stack.py``'s ``fast_stream_store`` row (a fast-path stream whose receiver does a
fetch's store work) this took 2 GiB from 417-501 MB/s to 498-644 MB/s in alternating runs.
"""

from __future__ import annotations

import os
import queue
import threading
from types import TracebackType
from typing import Protocol

import outcome
import trio

# Threads per download: one keeps a 2-vCPU machine's second core for the sender and the
# event loop; bigger machines get more, so hashing (about 3 GB/s per thread) and disk
# latency do not cap a fast link.
MAX_WRITER_THREADS = 4


def default_writer_threads() -> int:
    """Half the CPUs this process may run on, between 1 and ``MAX_WRITER_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WRITER_THREADS, cpus // 2))


class ChunkSink(Protocol):
    """What the writer writes into (``blobstore.PartialBlob``)."""

    def write_chunk(self, index: int, data: memoryview) -> bool: ...


_Job = tuple[int, memoryview, trio.lowlevel.Task]


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

    async def write(self, index: int, data: memoryview) -> bool:
        if not self._open:
            raise RuntimeError("ChunkWriter.write outside its `async with` block")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._jobs.put((index, data, trio.lowlevel.current_task()))

        def abort(_: object) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED  # the thread still owns `data`

        result: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    def _work(self) -> None:
        token = self._token
        assert token is not None
        while (job := self._jobs.get()) is not None:
            index, data, task = job
            result = outcome.capture(self._partial.write_chunk, index, data)
            del data, job  # the waiting task owns the buffer again once rescheduled
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)
