"""Leases: the blobs a running get or put still needs, kept from gc however long it runs.

gc's grace period protects what was touched recently; an operation that outlasts it (a
large collection fetch) or a ``gc --grace 0`` would delete what already arrived. A lease
names blob IDs; while it is held, gc keeps them, and for a collection everything it
lists, whatever their age::

    with store.lease([collection_id]) as lease:
        ...fetch the collection, then its children...
        lease.add(more_ids)        # IDs learnt later
        store.export(collection_id, out)

Each lease is a file ``locks/lease-<pid>-<random>`` holding ``pid <pid>`` and then one
ID per line, created and appended to under the store lock (so gc, which reads leases
under the same lock, never sees half a line) and flock-ed by its holder for its whole
life. Liveness is the flock, not the PID: the kernel drops it when the holder dies, so a
lease that gc (or the next :meth:`Store.open`) can lock is stale and is deleted, and a
recycled PID cannot keep one alive. ``locks/`` is 0700: no other user can lease.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from blobstore.durable import os_errors, try_lock_fd, write_all
from blobstore.manifest import parse_blob_id
from blobstore.store_lock import StoreLock

LEASE_PREFIX = "lease-"
MAX_LEASE_FILE = 128 * 1024 * 1024
"""Largest lease file gc reads (about 2 million IDs; a lease on a collection covers its
children without listing them). A bigger one is treated as live but naming nothing
readable, so it protects nothing extra and costs gc nothing."""


class Lease:
    """Get one from :meth:`Store.lease`; release it (or leave the ``with`` block)."""

    def __init__(self, lock: StoreLock, path: Path, fd: int, ids: Iterable[str] = ()) -> None:
        self._lock = lock
        self.path = path
        self._fd: int | None = fd
        self._ids: set[str] = set(ids)

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(self._ids)

    def add(self, blob_ids: Iterable[str]) -> None:
        """Protect more IDs; protected once this returns (any gc after it sees them)."""
        new = [parse_blob_id(i) for i in dict.fromkeys(blob_ids) if i not in self._ids]
        if not new:
            return
        if self._fd is None:
            raise ValueError("lease already released")
        with os_errors("extending a gc lease"), self._lock.hold():
            write_all(self._fd, "".join(f"{i}\n" for i in new).encode())
        self._ids.update(new)

    def release(self) -> None:
        """Stop protecting. Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Leases:
    """The leases of the store whose ``locks/`` is ``locks_dir``: taking one, and reading
    which IDs the live ones name."""

    def __init__(self, locks_dir: Path, lock: StoreLock) -> None:
        self.locks_dir = locks_dir
        self._lock = lock

    def take(self, blob_ids: Iterable[str] = ()) -> Lease:
        """A new lease file, locked, naming ``blob_ids`` (see the module docstring)."""
        ids = [parse_blob_id(i) for i in dict.fromkeys(blob_ids)]
        with os_errors("taking a gc lease"), self._lock.hold():
            path = self.locks_dir / f"{LEASE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(path, flags, 0o600)
            try:
                if not try_lock_fd(fd):  # a fresh file nobody else can open: cannot happen
                    raise OSError(f"could not lock the new lease {path}")
                lines = [f"pid {os.getpid()}\n", *(f"{i}\n" for i in ids)]
                write_all(fd, "".join(lines).encode())
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
        return Lease(self._lock, path, fd, ids)

    def live_ids(self) -> set[str]:
        """IDs named by live leases; deletes stale ones. Call with the store lock held."""
        return live_leased_ids(self.locks_dir)


def live_leased_ids(locks_dir: Path) -> set[str]:
    """IDs named by live leases; deletes stale ones. Call with the store lock held."""
    ids: set[str] = set()
    for entry in os.scandir(locks_dir):
        if not entry.name.startswith(LEASE_PREFIX):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if try_lock_fd(fd):  # its holder is gone
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            if os.fstat(fd).st_size > MAX_LEASE_FILE:
                continue
            with open(fd, "rb", closefd=False) as f:
                lines = f.read().split(b"\n")
        finally:
            os.close(fd)
        for line in lines:
            if len(line) == 64:
                with contextlib.suppress(Exception):
                    ids.add(parse_blob_id(line.decode("ascii")))
    return ids
