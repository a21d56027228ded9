"""The store lock (blobstore.store_lock.StoreLock), built without a Store."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from blobstore import StoreBusy
from blobstore.store_lock import StoreLock


def test_the_lock_is_reentrant_in_its_thread_and_a_bounded_wait_for_others(
    tmp_path: Path,
) -> None:
    (tmp_path / "locks").mkdir()
    lock = StoreLock(tmp_path, timeout=0.2)
    outcome: list[BaseException | str] = []

    def contend() -> None:
        try:
            with lock.hold():
                outcome.append("held")
        except BaseException as exc:
            outcome.append(exc)

    with lock.hold(), lock.hold():  # nested in one thread: a quarantine during gc
        start = time.monotonic()
        thread = threading.Thread(target=contend)
        thread.start()
        thread.join(timeout=10)
        waited = time.monotonic() - start
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], StoreBusy), outcome
    assert 0.2 <= waited < 10
    with lock.hold():  # released by the outer block: free again
        pass
    assert (tmp_path / "locks" / "store").read_text() == f"{os.getpid()}\n"


def test_another_lock_on_the_same_store_names_the_holder(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir()
    holder = StoreLock(tmp_path)
    waiter = StoreLock(tmp_path, timeout=0.1)  # another opener: the flock decides
    busy = pytest.raises(StoreBusy, match=rf"this process \({os.getpid()}\)")
    with holder.hold(), busy, waiter.hold():
        pass
