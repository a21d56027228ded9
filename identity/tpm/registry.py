"""The authority's TPM registry file: read, changed and written under one lock.

Two authority commands on one registry (two challenges issued at once, an answer while a
challenge is issued) must not lose each other's writes, so every read-change-write holds
an exclusive ``flock`` on ``REGISTRY.lock`` for its whole length. The write itself is the
identity package's one durable write (:func:`identity._files.write_file`: temp file,
fsync, rename, fsync of the directory), mode 0600: the registry is the authority's own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .._files import PRIVATE_FILE_MODE, write_file
from ..errors import BadTpmData, KeyFileIOError
from .admission import MAX_REGISTRY_SIZE, Registry


class RegistryFile:
    """The registry as read under the lock; :meth:`save` writes a new one."""

    def __init__(self, path: Path, registry: Registry) -> None:
        self.path = path
        self.registry = registry

    def save(self, registry: Registry) -> None:
        write_file(self.path, registry.encode(), mode=PRIVATE_FILE_MODE, overwrite=True)
        self.registry = registry


@contextlib.contextmanager
def open_registry(path: Path) -> Iterator[RegistryFile]:
    """Lock the registry at ``path`` (created empty on first use) for one change."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        raise KeyFileIOError(f"cannot open {lock_path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_REGISTRY_SIZE + 1)
        except FileNotFoundError:
            registry = Registry()
        except OSError as exc:
            raise KeyFileIOError(f"cannot read {path}: {exc.strerror}") from exc
        else:
            if len(data) > MAX_REGISTRY_SIZE:
                raise BadTpmData(f"{path} is larger than {MAX_REGISTRY_SIZE} bytes")
            registry = Registry.decode(data, source=str(path))
        yield RegistryFile(path, registry)
    finally:
        os.close(fd)  # releases the lock
