"""Free space: checked before a copy or a download claims it, so a full disk is a clear
NoSpace (exit 5) naming what is missing rather than a half-written file.

1. What is free is what this user may still allocate on the store's file system
   (``statvfs``: ``f_bavail``), or what the ``free_bytes`` given to :class:`Space` says.
2. A download still has to claim its size less what its partial's data file already
   occupies (:meth:`Space.to_finish`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from blobstore.durable import os_errors
from blobstore.errors import NoSpace
from blobstore.layout import Layout
from blobstore.manifest import Manifest


class Space:
    """The free space of the store laid out as ``layout``; ``free_bytes`` replaces the
    file system's count (a test's full disk)."""

    def __init__(self, layout: Layout, free_bytes: Callable[[], int] | None = None) -> None:
        self.layout = layout
        self._free_bytes = free_bytes

    def free_bytes(self) -> int:
        """Bytes available to this user on the store's file system."""
        if self._free_bytes is not None:
            return self._free_bytes()
        with os_errors("checking free space"):
            st = os.statvfs(self.layout.root)
        return st.f_bavail * st.f_frsize

    def check(self, needed: int, what: str) -> None:
        """NoSpace unless ``needed`` bytes are free to ``what`` (a phrase: "copy X")."""
        available = self.free_bytes()
        if needed > available:
            raise NoSpace(
                f"not enough disk space to {what}: need {needed} bytes, "
                f"{available} available under {self.layout.root}",
                needed=needed,
                available=available,
            )

    def to_finish(self, manifest: Manifest) -> int:
        """Disk space a download of ``manifest`` still has to claim: its size, less what
        its partial's data file already occupies. Not less the verified chunks only: the
        blocks of chunks written but not yet marked verified (after a disk-full stop, when
        the bitmap itself could not be written) take space too, and writing them again
        claims none, so counting them as missing would refuse the very retry that the
        freed space allows."""
        with os_errors(f"checking the partial blob {manifest.blob_id[:12]}"):
            try:
                st = os.stat(self.layout.partial_dir(manifest.blob_id) / "data")
            except FileNotFoundError:
                return manifest.size
        return max(0, manifest.size - min(manifest.size, st.st_blocks * 512))
