"""The one durable-write helper, file locks, and the OSError boundary.

Every file the store must find intact after a crash is written the same way
(:class:`TempFile`): a temp file in the store's ``tmp/`` directory (same file system as
every target, so the final rename is atomic), written, ``fsync``-ed, renamed or
hard-linked onto its final name, and the target directory ``fsync``-ed. A reader sees
either no file or the whole file, never a torn one.

Two publication modes:

* ``replace=True`` (tags, bitmaps): ``os.replace``; the last writer wins.
* ``replace=False`` (blobs, manifests): ``os.link`` then unlink the temp. ``link`` fails
  with EEXIST when the target exists, so a published object is never overwritten, not
  even by identical bytes from a concurrent writer; the loser's temp is discarded.

Temp files of live writers must survive another process's sweep. Each writer holds an
exclusive ``flock`` on its temp file for the file's whole life; :func:`sweep_temp_dir`
deletes only the files whose lock it can take. A writer that loses the race (the
sweeper locked and unlinked the name between the writer's ``open`` and ``flock``) sees
the name no longer points to its file and starts over with a fresh name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from blobstore.errors import NoSpace, PathNotFound, StoreError

TEMP_PREFIX = "tmp-"
_OPEN_RETRIES = 16  # a fresh random name colliding with a sweep 16 times in a row is a bug
_LINK_UNSUPPORTED = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}


def translate_os_error(exc: OSError, what: str) -> StoreError:
    """The typed error for an OSError raised while doing ``what``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"no space left on device while {what}; free some disk space and retry")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoreError(f"permission denied while {what}: {exc.strerror}")
    if exc.errno == errno.ENOENT:
        return PathNotFound(f"not found while {what}: {exc.filename or exc.strerror}")
    return StoreError(f"I/O error while {what}: {exc.strerror or exc}")


@contextlib.contextmanager
def os_errors(what: str) -> Iterator[None]:
    """Translate OSError inside the block into the store's typed errors."""
    try:
        yield
    except OSError as exc:
        raise translate_os_error(exc, what) from exc


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename or link inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte is written (a regular file may take fewer)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def try_lock_fd(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False if someone holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def lock_path(path: Path) -> int | None:
    """Open (creating) ``path`` and hold an exclusive flock on it.

    Returns the locked fd, or None if another holder has it. Guards against a holder
    that deletes the lock file just before releasing it: after locking, the name must
    still point to the locked file, else we retry on the new file.
    """
    for _ in range(_OPEN_RETRIES):
        # 0600: a lock that others could open, they could flock (read access suffices).
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        if not try_lock_fd(fd):
            os.close(fd)
            return None
        if _names(path, fd):
            return fd
        os.close(fd)
    raise StoreError(f"could not lock {path}: it keeps being replaced")


def claim_lock(fd: int) -> None:
    """Write our PID into a lock file we hold, for a waiter's message (:func:`lock_holder`).
    Only for a holder that will work under the lock: probes (gc, sweeps) skip it, so an
    idle partial's files keep their age."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def lock_holder(path: Path) -> str:
    """'process 1234' as the lock file at ``path`` names its holder, else 'another
    process' (an older writer, or one that has not written its PID yet)."""
    try:
        with open(path, "rb") as f:
            text = f.read(32).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"process {text}" if text.isdigit() else "another process"


class TempFile:
    """A locked temp file in ``tmp_dir``, published durably onto a final name.

    Use as a context manager; leaving the block without :meth:`publish` deletes it.
    """

    def __init__(self, tmp_dir: Path, *, prefix: str = TEMP_PREFIX) -> None:
        for _ in range(_OPEN_RETRIES):
            path = tmp_dir / f"{prefix}{secrets.token_hex(12)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            # A sweeper may lock, unlink and release the new file before we lock it: the
            # lock then succeeds on a file with no name, so the name is checked after it.
            if try_lock_fd(fd) and _names(path, fd):
                self.path = path
                self.fd = fd
                self._done = False
                self._synced = False
                return
            os.close(fd)  # a sweeper got it first; start over with a new name
        raise StoreError(f"could not create a temp file in {tmp_dir}")

    def __enter__(self) -> TempFile:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()

    def sync(self, mode: int = 0o400) -> None:
        """Give the file its final ``mode`` and fsync it (publish does this if needed)."""
        os.fchmod(self.fd, mode)
        os.fsync(self.fd)
        self._synced = True

    def publish(self, target: Path, *, replace: bool, mode: int = 0o400) -> bool:
        """fsync, give ``mode``, and atomically put the file at ``target``.

        Returns True if this file is now at ``target``; False if ``replace`` is False and
        something already was there (it is kept; this temp is discarded).
        """
        if not self._synced:
            self.sync(mode)
        published = link_or_rename(self.path, target, replace=replace)
        if published:
            fsync_dir(target.parent)
        self.discard()
        return published

    def discard(self) -> None:
        """Delete the temp file (if still there) and release its lock. Idempotent."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)


def link_or_rename(source: Path, target: Path, *, replace: bool) -> bool:
    """Move ``source`` to ``target`` atomically; with ``replace=False`` never overwrite.

    Returns False (leaving ``source`` in place) if ``replace`` is False and ``target``
    exists. On file systems without hard links, falls back to an existence check plus
    rename, which can only lose to a concurrent writer of the same content-addressed name.
    """
    if replace:
        os.replace(source, target)
        return True
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _LINK_UNSUPPORTED:
            raise
        if target.exists():
            return False
        os.rename(source, target)
        return True
    os.unlink(source)
    return True


def write_file_atomic(
    target: Path,
    data: bytes,
    *,
    tmp_dir: Path | None = None,
    replace: bool,
    mode: int = 0o400,
) -> bool:
    """Durably write ``data`` at ``target`` (see :meth:`TempFile.publish`). Without
    ``tmp_dir`` (a file outside a store) the temp file is ``.NAME.tmp-*`` beside it."""
    prefix = TEMP_PREFIX if tmp_dir is not None else f".{target.name}.tmp-"
    with TempFile(tmp_dir or target.parent, prefix=prefix) as tmp:
        write_all(tmp.fd, data)
        return tmp.publish(target, replace=replace, mode=mode)


TRASH_PREFIX = "trash-"
"""Names in a temp directory that gc renamed there to delete outside the store lock."""


def delete_trash(path: str) -> None:
    """Delete what gc moved to the trash (a file or a directory); already gone is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def sweep_temp_dir(tmp_dir: Path) -> list[str]:
    """Delete temp files in ``tmp_dir`` that no live writer holds, and trash a gc left
    behind (killed between its rename and its delete). Returns their names."""
    removed: list[str] = []
    for entry in os.scandir(tmp_dir):
        if entry.name.startswith(TRASH_PREFIX) and entry.is_dir(follow_symlinks=False):
            delete_trash(entry.path)
            removed.append(entry.name)
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        except OSError:  # a directory or something odd: not ours to judge here
            continue
        try:
            if try_lock_fd(fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
        finally:
            os.close(fd)
    return removed
