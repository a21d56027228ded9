"""The store's error types.

Every class carries an ``exit_code`` (a :class:`blobstore.exitcodes.ExitCode`: the ``blob``
program's documented exit status for it) and a message meant for a person: what happened,
and what to do about it. ``OSError`` from the operating system is translated into these at
one boundary (:func:`blobstore.durable.os_errors`), never passed through raw.
"""

from __future__ import annotations

from blobstore.exitcodes import ExitCode


class StoreError(Exception):
    """Base class of every error the store raises on purpose. Local I/O trouble."""

    exit_code = ExitCode.LOCAL_IO


class BlobNotFound(StoreError):
    """No blob, prefix or tag by that name in this store."""

    exit_code = ExitCode.NOT_FOUND


class AmbiguousPrefix(StoreError):
    """An ID prefix matches more than one blob."""

    exit_code = ExitCode.NOT_FOUND


class PathNotFound(StoreError):
    """A file or directory named by the user does not exist."""

    exit_code = ExitCode.NOT_FOUND


class BadBlobId(StoreError):
    """Text that should be a blob ID (64 lowercase hex characters) is not one."""

    exit_code = ExitCode.USAGE


class BadTagName(StoreError):
    """A tag name that the store refuses (see ``blobstore.store.TAG_NAME_RE``)."""

    exit_code = ExitCode.USAGE


class BadManifest(StoreError):
    """Manifest bytes that are not a canonical, in-limits manifest."""

    exit_code = ExitCode.BAD_DATA


class BadCollection(StoreError):
    """A collection blob whose content is malformed or names hostile paths."""

    exit_code = ExitCode.BAD_DATA


class CorruptChunk(StoreError):
    """Chunk bytes that do not hash to the manifest's entry (or have the wrong length)."""

    exit_code = ExitCode.BAD_DATA


class BlobQuarantined(CorruptChunk):
    """The blob was found rotten and taken out of the published set until repaired."""


class ChunkUnavailable(StoreError):
    """The chunk is not (yet) held and verified in this store."""

    exit_code = ExitCode.NOT_FOUND


class BlobExists(StoreError):
    """The blob is already complete in this store."""

    exit_code = ExitCode.LOCAL_IO


class PartialBusy(StoreError):
    """Another process or handle is writing this partial blob (``blob_id``, when known)."""

    exit_code = ExitCode.LOCAL_IO

    def __init__(self, message: str, blob_id: str | None = None) -> None:
        super().__init__(message)
        self.blob_id = blob_id


class FileChanged(StoreError):
    """A file given to ``put`` changed while it was being read (local trouble: exit 5)."""

    exit_code = ExitCode.LOCAL_IO


class StoreBusy(StoreError):
    """Another process has held the store lock for longer than the store waits."""

    exit_code = ExitCode.LOCAL_IO


class NoSpace(StoreError):
    """Not enough free disk space for the operation."""

    exit_code = ExitCode.LOCAL_IO

    def __init__(self, message: str, *, needed: int | None = None, available: int | None = None):
        super().__init__(message)
        self.needed = needed
        self.available = available


class StoreCorrupt(StoreError):
    """A check found stored data that does not match its ID."""

    exit_code = ExitCode.REJECTED
