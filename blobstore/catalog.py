"""What a store holds and what it is called: full IDs, ID prefixes, tags, listings.

1. A reference is a full ID, a unique prefix of at least :data:`MIN_PREFIX` hex
   characters, or a tag name; a tag name can never read as a prefix.
2. A tag is a file ``tags/<name>`` holding one ID, written through the durable-write
   helper under the store lock; a damaged tag file is skipped in listings and reported
   when used.
3. Listings cover complete, partial and quarantined blobs; only complete rows are
   published (served, advertised).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from blobstore import bitmap as bm
from blobstore.durable import fsync_dir, os_errors, write_file_atomic
from blobstore.errors import AmbiguousPrefix, BadBlobId, BadTagName, BlobNotFound, StoreCorrupt
from blobstore.layout import FileModes, Layout, is_blob_id
from blobstore.manifest import parse_blob_id
from blobstore.quarantine import Quarantine
from blobstore.reading import Reader
from blobstore.store_lock import StoreLock

MIN_PREFIX = 8
"""Shortest ID prefix accepted: 32 bits keeps accidental matches rare in a local store."""

TAG_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-fA-F]+")


@dataclass(frozen=True)
class BlobInfo:
    """One row of :meth:`Store.list_blobs`."""

    blob_id: str
    size: int
    chunk_size: int
    complete: bool
    verified_chunks: int
    tags: tuple[str, ...]
    quarantined: bool = False

    @property
    def num_chunks(self) -> int:
        return -(-self.size // self.chunk_size)


def check_tag_name(name: str) -> None:
    """Raise BadTagName unless ``name`` is usable as a tag."""
    if not isinstance(name, str) or TAG_NAME_RE.fullmatch(name) is None:
        raise BadTagName(
            f"bad tag name {name!r}: use 1-128 letters, digits and ._@+- "
            "(starting with a letter or digit)"
        )
    if len(name) >= MIN_PREFIX and _HEX_RE.fullmatch(name):
        raise BadTagName(f"bad tag name {name!r}: it would read as a blob ID prefix")


class Catalog:
    """Resolving references, tags and listings of the store laid out as ``layout``."""

    def __init__(
        self,
        layout: Layout,
        lock: StoreLock,
        modes: FileModes,
        *,
        reader: Reader,
        quarantine: Quarantine,
    ) -> None:
        self.layout = layout
        self.lock = lock
        self.modes = modes
        self.reader = reader
        self.quarantine = quarantine

    def resolve(self, ref: str) -> str:
        """A full ID, a unique prefix of 8+ hex characters, or a tag name -> blob ID."""
        if is_blob_id(ref):
            if self.layout.has(ref) or self.layout.has_partial(ref) or self.quarantine.reason(ref):
                return ref
            raise BlobNotFound(f"no blob {ref} in this store")
        with os_errors(f"looking up {ref!r}"):
            tag_file = self.layout.tags / ref
            if TAG_NAME_RE.fullmatch(ref) and tag_file.is_file():
                return self.read_tag(tag_file)
            lowered = ref.lower()
            if len(ref) >= MIN_PREFIX and _HEX_RE.fullmatch(ref) and len(ref) < 64:
                matches = sorted(
                    {i for i in self.layout.complete_ids(lowered[:2]) if i.startswith(lowered)}
                    | {i for i in self.layout.partial_ids() if i.startswith(lowered)}
                    | {i for i in self.layout.quarantined_ids() if i.startswith(lowered)}
                )
                if len(matches) == 1:
                    return matches[0]
                if matches:
                    shown = ", ".join(m[:16] for m in matches[:5])
                    raise AmbiguousPrefix(
                        f"prefix {ref} matches {len(matches)} blobs ({shown}...); "
                        "give more characters"
                    )
                raise BlobNotFound(f"no blob with ID prefix {ref} in this store")
        if len(ref) < MIN_PREFIX and _HEX_RE.fullmatch(ref):
            raise BlobNotFound(
                f"no tag named {ref!r}, and ID prefixes need at least {MIN_PREFIX} characters"
            )
        raise BlobNotFound(f"no blob or tag named {ref!r} in this store")

    def read_tag(self, path: Path) -> str:
        """The ID in tag file ``path`` (StoreCorrupt if it holds none)."""
        text = path.read_text(errors="replace").strip()
        try:
            return parse_blob_id(text)
        except BadBlobId:
            raise StoreCorrupt(f"tag file {path} is damaged; re-create the tag") from None

    def tag(self, name: str, blob_id: str) -> None:
        """Point tag ``name`` at ``blob_id`` (complete or partial), replacing any old one."""
        check_tag_name(name)
        parse_blob_id(blob_id)
        with os_errors(f"tagging {blob_id[:12]} as {name}"), self.lock.hold():
            if not (self.layout.has(blob_id) or self.layout.has_partial(blob_id)):
                raise BlobNotFound(f"no blob {blob_id} in this store")
            write_file_atomic(
                self.layout.tags / name,
                f"{blob_id}\n".encode(),
                tmp_dir=self.layout.tmp,
                replace=True,
                mode=self.modes.file,
            )

    def untag(self, name: str) -> None:
        check_tag_name(name)
        with os_errors(f"removing tag {name}"), self.lock.hold():
            try:
                (self.layout.tags / name).unlink()
            except FileNotFoundError:
                raise BlobNotFound(f"no tag named {name!r}") from None
            fsync_dir(self.layout.tags)

    def tags(self) -> dict[str, str]:
        """All tags: name -> blob ID (damaged tag files are skipped)."""
        out = {}
        with os_errors("reading tags"):
            for entry in os.scandir(self.layout.tags):
                if TAG_NAME_RE.fullmatch(entry.name) is None or not entry.is_file():
                    continue
                try:
                    out[entry.name] = self.read_tag(Path(entry.path))
                except (StoreCorrupt, FileNotFoundError):
                    continue
        return dict(sorted(out.items()))

    def blob_ids(self) -> list[str]:
        """IDs of every complete, partial and quarantined blob, sorted (even ones with
        damaged files)."""
        with os_errors("listing blobs"):
            layout = self.layout
            held = (*layout.complete_ids(), *layout.partial_ids(), *layout.quarantined_ids())
            return sorted(set(held))

    def list_blobs(self) -> list[BlobInfo]:
        """Every complete, partial and quarantined blob, sorted by ID (unreadable ones
        skipped). Only rows with ``complete`` set are published (served, advertised)."""
        by_blob: dict[str, list[str]] = {}
        for name, blob_id in self.tags().items():
            by_blob.setdefault(blob_id, []).append(name)
        rows = []
        with os_errors("listing blobs"):
            complete = set(self.layout.complete_ids())
            quarantined = set(self.layout.quarantined_ids()) - complete
            for blob_id in sorted({*complete, *self.layout.partial_ids(), *quarantined}):
                try:
                    manifest = self.reader.manifest(blob_id)
                    bits = self.reader.chunk_bitmap(blob_id)
                except (StoreCorrupt, BlobNotFound):
                    continue
                rows.append(
                    BlobInfo(
                        blob_id=blob_id,
                        size=manifest.size,
                        chunk_size=manifest.chunk_size,
                        complete=blob_id in complete,
                        verified_chunks=bm.count_bits(bits),
                        tags=tuple(by_blob.get(blob_id, ())),
                        quarantined=blob_id in quarantined,
                    )
                )
        return rows
