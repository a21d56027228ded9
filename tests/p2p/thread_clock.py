"""Virtual time for a fetch whose store work runs in real threads.

trio's ``MockClock`` autojumps once every task has been blocked for
``autojump_threshold`` real seconds. A task waiting on a thread is blocked too, so a
store call that took longer than the threshold (a durable create or publish, a chunk
write: milliseconds alone, far more on a loaded 2-vCPU CI machine) let the clock jump to
the next deadline while the thread still worked: a request's timeout fired that real
time never reached, and a chunk was asked again. ``thread_aware_clock`` turns the
autojump off while a ``trio.to_thread.run_sync`` call or a chunk write
(``p2p.fetch.chunk_writer.ChunkWriter.write``) is under way, and on again once none is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from p2p.fetch.chunk_writer import ChunkWriter


class ThreadWatch:
    """Counts the thread work under way; the clock autojumps only while there is none."""

    def __init__(self, clock: trio.testing.MockClock, threshold: float) -> None:
        self.clock = clock
        self.threshold = threshold
        self.working = 0  # to_thread calls and chunk writes under way
        self.held = 0  # thread calls during which the autojump was off

    def _begin(self) -> None:
        if self.working == 0:
            self.clock.autojump_threshold = math.inf
        self.working += 1
        self.held += 1

    def _end(self) -> None:
        self.working -= 1
        if self.working == 0:
            self.clock.autojump_threshold = self.threshold

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self._begin()
            try:
                return await call(*args, **kwargs)
            finally:
                self._end()

        return counted


def thread_aware_clock(monkeypatch: pytest.MonkeyPatch, threshold: float) -> ThreadWatch:
    """The watch of a MockClock (``.clock``) that autojumps after ``threshold`` real
    seconds of idleness, but never while store work runs in a thread."""
    clock = trio.testing.MockClock(autojump_threshold=threshold)
    watch = ThreadWatch(clock, threshold)
    monkeypatch.setattr(trio.to_thread, "run_sync", watch.wrap(trio.to_thread.run_sync))
    write = ChunkWriter.write

    async def counted_write(writer: ChunkWriter, *args: Any, **kwargs: Any) -> bool:
        result: bool = await watch.wrap(write)(writer, *args, **kwargs)
        return result

    monkeypatch.setattr(ChunkWriter, "write", counted_write)
    return watch
