"""The one durable-write helper of the identity package (STYLE 7).

Every file we write (key, public key, certificate, attestation) goes through
:func:`write_file`: a temp file in the same directory created with ``O_EXCL`` and its
final mode, written, fsynced, then published and the directory fsynced. Key files are
published with ``os.link``, which fails if the target exists, so a key is never
overwritten and a crash never leaves a half-written key under the final name (the worst
case is a stray ``.NAME.tmp-*`` file, removed on the way out when we can).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from .errors import KeyExists, KeyFileIOError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PUBLIC_FILE_MODE = 0o644


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` and missing parents as 0700; existing ones are left alone."""
    missing: list[Path] = []
    d = directory
    while not d.exists():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue
        except OSError as exc:
            raise KeyFileIOError(f"cannot create directory {d}: {exc.strerror}") from exc
        os.chmod(d, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Filesystems without hard links (some FUSE and network mounts, vfat) answer link() with
# one of these; there we fall back to creating the final name with O_EXCL, which still
# never overwrites but can leave a short file if we crash mid-write.
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _exists(path: Path) -> KeyExists:
    return KeyExists(
        f"{path} already exists and is never overwritten; "
        "choose another path or move the old file away first"
    )


def _write_exclusive(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise _exists(path) from None
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, *, mode: int, overwrite: bool) -> None:
    """Write ``data`` to ``path`` durably with ``mode``.

    ``overwrite=False`` raises :class:`KeyExists` if ``path`` exists, atomically: two
    writers racing for the same path cannot both succeed.
    """
    directory = path.parent
    tmp = directory / f".{path.name}.tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # the creation mode is filtered by the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise _exists(path) from None
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                _write_exclusive(path, data, mode)
        _fsync_dir(directory)
    except OSError as exc:
        if exc.errno == errno.ENOENT and not directory.exists():
            raise KeyFileIOError(f"cannot write {path}: directory {directory} is missing") from exc
        raise KeyFileIOError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
