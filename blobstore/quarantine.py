"""Quarantine: rot is taken out of the published set, never served (invariant 8 of
:mod:`blobstore.store`).

1. A complete blob whose bytes fail a chunk hash (``verify``, a verifying read, or a
   caller such as a server) moves to ``quarantine/<id>/`` with its manifest and a
   one-line reason, under the store lock: unpublished at once; its tags stay.
2. Only the file whose bytes failed is quarantined: a reader that opened it before a
   repair leaves the repaired file alone (``read_from``).
3. Publishing the ID again repairs it and clears the quarantine; a repair download starts
   from the quarantined file's good chunks, unless that file is shared with a hard-linked
   export (then it is fetched whole).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from blobstore.durable import fsync_dir, os_errors, translate_os_error, write_file_atomic
from blobstore.errors import BlobQuarantined, StoreError
from blobstore.layout import FileModes, Layout, mkdir_in_store, same_file
from blobstore.manifest import parse_blob_id
from blobstore.manifests import Manifests
from blobstore.store_lock import StoreLock

_MAX_REASON = 500  # characters of a quarantine reason kept: one line of an error message


class Quarantine:
    """Taking rotten blobs of the store laid out as ``layout`` out of the published set,
    and repairing them. ``read_only``: another user's store, where nothing may move."""

    def __init__(
        self,
        layout: Layout,
        lock: StoreLock,
        manifests: Manifests,
        modes: FileModes,
        *,
        read_only: bool = False,
    ) -> None:
        self.layout = layout
        self.lock = lock
        self.manifests = manifests
        self.modes = modes
        self.read_only = read_only

    def quarantine(
        self, blob_id: str, reason: str, *, read_from: os.stat_result | None = None
    ) -> bool:
        """Take a complete blob found rotten out of the published set.

        Its data and manifest move to ``quarantine/<id>/`` with ``reason``: from then on
        ``has`` is False, it is not listed among complete blobs, readers and servers
        stop offering it, and reading it raises :class:`BlobQuarantined` (exit 4). Tags
        stay (the name still means that content). Publishing the ID again, by ``put`` of
        the same content or a fetched partial, repairs it and clears the quarantine; a
        fetch starts from the quarantined file, so only the rotten chunks are fetched.
        Returns False if the blob was not complete here (already quarantined, say).
        Safe from any thread; callers need not hold anything.

        ``read_from``: the ``fstat`` of the file whose bytes failed. A reader can find
        rot in a file that has since been quarantined and repaired (a new file with good
        bytes under the same name); then the published file is not the rotten one, and
        nothing is done (False).
        """
        parse_blob_id(blob_id)
        if self.read_only:
            raise StoreError(
                f"blob {blob_id[:12]} is corrupt in {self.layout.root}, which belongs to another "
                "user: ask its owner to run `blob verify` there"
            )
        with os_errors(f"quarantining blob {blob_id[:12]}"), self.lock.hold():
            data_path = self.layout.data_path(blob_id)
            if not data_path.exists():
                return False
            if read_from is not None and not same_file(data_path, read_from):
                return False  # the rotten file was replaced meanwhile (a repair)
            qdir = self.layout.quarantine_dir(blob_id)
            mkdir_in_store(qdir, self.modes)
            # The reason may quote a peer (its report of a bad chunk) and is printed in
            # error lines: one line of printable text, so no escape sequence rides along.
            words = " ".join(reason[:_MAX_REASON].split())
            one_line = "".join(c if c.isprintable() else "?" for c in words)
            write_file_atomic(
                qdir / "reason",
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {one_line}\n".encode(),
                tmp_dir=self.layout.tmp,
                replace=True,
                mode=self.modes.file,
            )
            manifest_path = self.layout.manifest_path(blob_id)
            with contextlib.suppress(FileExistsError):
                os.link(manifest_path, qdir / "manifest")  # before the data leaves
            os.replace(data_path, qdir / "data")  # unpublished from here on
            manifest_path.unlink(missing_ok=True)
            fsync_dir(qdir)
            fsync_dir(data_path.parent)
            self.manifests.forget(blob_id)
        return True

    def reason(self, blob_id: str) -> str | None:
        """Why the blob is quarantined ("<UTC time> <reason>"), or None if it is not."""
        parse_blob_id(blob_id)
        qdir = self.layout.quarantine_dir(blob_id)
        try:
            return (qdir / "reason").read_text(errors="replace").strip() or "no reason recorded"
        except FileNotFoundError:
            return "no reason recorded" if (qdir / "manifest").exists() else None
        except OSError as exc:
            raise translate_os_error(exc, f"reading the quarantine of {blob_id[:12]}") from exc

    def clear(self, blob_id: str) -> None:
        """Store lock held: the ID is published again with verified bytes."""
        qdir = self.layout.quarantine_dir(blob_id)
        if qdir.exists():
            shutil.rmtree(qdir, ignore_errors=True)
            fsync_dir(self.layout.quarantine)

    def seed_partial(self, blob_id: str, pdir: Path) -> None:
        """Store and partial locks held: a repair download starts from the rotten copy;
        the partial's reopen re-hashes every chunk and keeps only those that verify."""
        qdata = self.layout.quarantine_dir(blob_id) / "data"
        if (pdir / "data").exists() or not qdata.exists():
            return
        if os.stat(qdata).st_nlink > 1:  # shared with a hard-linked export: not ours to
            return  # rewrite (the user may have edited it); fetch the blob whole instead
        os.chmod(qdata, self.modes.file)
        os.rename(qdata, pdir / "data")
        fsync_dir(pdir)

    def on_read(self, blob_id: str, what: str, read_from: os.stat_result) -> str:
        """Quarantine a complete blob whose read of the file ``read_from`` (its fstat)
        just failed its hash; the message tail."""
        try:
            moved = self.quarantine(blob_id, what, read_from=read_from)
            if not moved and self.layout.has(blob_id):
                return "; the store's copy was replaced meanwhile: read it again"
        except StoreError as exc:
            return f"; could not quarantine it ({exc})"
        return (
            f"; quarantined it: fetch it again (blob get {blob_id} --peer ...) or put it "
            "again; links to it (blob export, get --link) dangle until then"
        )

    def refuse(self, blob_id: str) -> None:
        """BlobQuarantined if the blob is quarantined (its reason in the message)."""
        reason = self.reason(blob_id)
        if reason is not None:
            raise BlobQuarantined(
                f"blob {blob_id} is quarantined as corrupt ({reason}); fetch it again "
                f"(blob get {blob_id} --peer ...) or put the original again"
            )
