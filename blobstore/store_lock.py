"""The store lock (invariant 5 of :mod:`blobstore.store`): held briefly around every
publish, delete, quarantine, lease and tag change, never around the long hashing.

1. One lock per store and process: threads of this process queue on a mutex first, and a
   thread holding it may take it again (a quarantine during gc).
2. Across processes it is an ``flock`` on ``locks/store``, a 0600 file in the 0700
   ``locks/``, so no other user can open it, let alone flock it. The holder writes its PID
   into it, so a waiter that gives up can say who holds it.
3. The wait is bounded: after ``timeout`` seconds, StoreBusy (exit 5) naming the holder.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blobstore.durable import try_lock_fd
from blobstore.errors import StoreBusy

STORE_LOCK_TIMEOUT = 10.0
"""Seconds to wait for the store lock before failing with StoreBusy (exit 5). The lock is
held only around publishes, deletes, tag changes and one gc pass: milliseconds, seconds
for gc of a very large store. Waiting longer means a stuck or hostile holder; say so
rather than hang. Override with ``Store.open(lock_timeout=...)`` or the environment
variable named by :data:`LOCK_TIMEOUT_ENV`."""
LOCK_TIMEOUT_ENV = "BLOBNET_LOCK_TIMEOUT"
_LOCK_POLL_MAX = 0.02  # seconds between tries at most: contention is short


class StoreLock:
    """The lock of the store at ``root`` (file ``locks/store``), waited for at most
    ``timeout`` seconds."""

    def __init__(self, root: Path, timeout: float = STORE_LOCK_TIMEOUT) -> None:
        self.root = root
        self.timeout = timeout
        self._file = root / "locks" / "store"
        self._mutex = threading.Lock()  # threads of this process queue here first
        self._owner: int | None = None  # thread holding the lock (re-entry)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the store lock; StoreBusy (exit 5) after ``timeout`` seconds."""
        if self._owner == threading.get_ident():  # nested: e.g. quarantine during gc
            yield
            return
        deadline = time.monotonic() + self.timeout
        if not self._mutex.acquire(timeout=self.timeout):
            raise StoreBusy(
                f"the store at {self.root} is busy: another thread of this process has held "
                f"its lock for over {self.timeout:g} s"
            )
        try:
            fd = os.open(self._file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                delay = 0.001
                while not try_lock_fd(fd):
                    now = time.monotonic()
                    if now >= deadline:
                        raise StoreBusy(
                            f"the store at {self.root} is busy: {_lock_holder(fd)} has held its "
                            f"lock for over {self.timeout:g} s; wait for it or stop it "
                            f"(or raise {LOCK_TIMEOUT_ENV})"
                        )
                    time.sleep(min(delay, deadline - now))
                    delay = min(delay * 2, _LOCK_POLL_MAX)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._owner = threading.get_ident()
                try:
                    yield
                finally:
                    self._owner = None
            finally:
                os.close(fd)
        finally:
            self._mutex.release()


def _lock_holder(fd: int) -> str:
    """Who holds the lock, as far as its file says: 'process 1234' or 'another process'."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return "another process"
    pid = int(text)
    if pid == os.getpid():
        return f"this process ({pid})"
    return f"process {pid}"
