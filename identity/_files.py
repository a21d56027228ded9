"""Files of the identity package (keys, public keys, certificates, attestations).

Every one is written through the project's one durable-write helper
(:func:`blobstore.durable.write_file_atomic`): a temp file ``.NAME.tmp-*`` beside the
target, written, fsynced with its final mode, then published and the directory fsynced.
Key files are published without overwrite (``os.link``, which fails if the target
exists), so a key is never overwritten and a crash never leaves a half-written key under
the final name (the worst case is a stray temp file).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from blobstore.durable import write_file_atomic
from blobstore.errors import StoreError

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


def _exists(path: Path) -> KeyExists:
    return KeyExists(
        f"{path} already exists and is never overwritten; "
        "choose another path or move the old file away first"
    )


def write_file(path: Path, data: bytes, *, mode: int, overwrite: bool) -> None:
    """Write ``data`` to ``path`` durably with ``mode``.

    ``overwrite=False`` raises :class:`KeyExists` if ``path`` exists, atomically: two
    writers racing for the same path cannot both succeed.
    """
    directory = path.parent
    try:
        published = write_file_atomic(path, data, replace=overwrite, mode=mode)
    except OSError as exc:
        if exc.errno == errno.ENOENT and not directory.exists():
            raise KeyFileIOError(f"cannot write {path}: directory {directory} is missing") from exc
        raise KeyFileIOError(f"cannot write {path}: {exc.strerror or exc}") from exc
    except StoreError as exc:
        raise KeyFileIOError(f"cannot write {path}: {exc}") from exc
    if not published:
        raise _exists(path)
