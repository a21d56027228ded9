"""Writing fetched blobs out of the store: a subset of a collection's files
(``--include``), and directories of links into the store instead of copies (``--link``).

A linked export is a directory whose files are symlinks to the store's read-only blob
files, so ``transformers``' ``from_pretrained(DIR)`` or ``safetensors`` memory-map the
verified bytes in place: nothing is copied or hashed again. The links live as long as the
blobs do, so ``blob export`` pins what it links with a tag (``export_tag``, or one the user
names) that ``blob gc`` respects and ``blob untag`` removes with the export.

Like ``Store.export``, the directory is built under a temporary name beside ``dest`` and
renamed into place, so a half-made export is never visible under ``dest``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

from blobstore.collection import check_relpath
from blobstore.errors import BlobNotFound, PathNotFound, StoreError
from blobstore.store import Store


class NothingMatches(BlobNotFound):
    """No file of a collection matches the ``--include`` patterns."""


def check_output(dest: Path) -> None:
    """What can be checked of an output path before any download: its directory exists
    and is writable."""
    parent = dest.expanduser().absolute().parent
    if not parent.is_dir():
        raise PathNotFound(f"cannot write {dest}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise StoreError(f"cannot write {dest}: directory {parent} is not writable")


def select_entries(
    store: Store, collection_id: str, patterns: Sequence[str]
) -> list[tuple[str, str]]:
    """``(path, blob_id)`` of the collection's files matching any of ``patterns``
    (``fnmatch`` on the collection's ``/``-separated paths; all files without patterns)."""
    entries = store.read_collection(collection_id)
    chosen = [
        (e.path, e.blob_id)
        for e in entries
        if not patterns or any(fnmatch.fnmatchcase(e.path, p) for p in patterns)
    ]
    if not chosen:
        shown = ", ".join(e.path for e in entries[:8]) + (" ..." if len(entries) > 8 else "")
        raise NothingMatches(
            f"no file of collection {collection_id[:12]} matches "
            f"{' or '.join(repr(p) for p in patterns)}; it holds: {shown or 'nothing'}"
        )
    return chosen


def export_files(store: Store, files: Sequence[tuple[str, str]], dest: Path, *, link: bool) -> None:
    """Make directory ``dest`` holding ``files`` (``(relative path, blob_id)``, each blob
    complete in ``store``): symlinks into the store with ``link``, else verified copies.
    ``dest`` must not exist, or be an empty directory. Each path must be a collection's
    kind of path (relative, no ``..``): nothing is ever written outside ``dest``."""
    dest = dest.expanduser()
    check_output(dest)
    for path, _ in files:
        # A decoded collection's paths are checked already; a caller's list may not be, and
        # an absolute or ".." path would be written outside ``dest`` (BadCollection).
        check_relpath(path)
    sources = {}
    for path, blob_id in files:  # BlobNotFound before anything is written
        try:
            sources[path] = store.path(blob_id)
        except BlobNotFound:
            raise BlobNotFound(
                f"{path} (blob {blob_id[:12]}) is not in this store; fetch it first "
                f"(blob get COLLECTION --include {path!r})"
            ) from None
    if link and _same_links(dest, sources):
        return  # the same export again: nothing to do
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StoreError(f"{dest} already exists; give a new path or an empty directory")
    if not link:
        total = sum(store.manifest(blob_id).size for _path, blob_id in files)
        store.check_export_space(dest.absolute().parent, total, f"export {len(files)} file(s)")
    staging = dest.absolute().parent / f".{dest.name}.blobnet-{secrets.token_hex(6)}"
    try:
        staging.mkdir()
        for path, blob_id in files:
            target = staging.joinpath(*path.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            if link:
                target.symlink_to(sources[path].resolve())
            else:
                store.export(blob_id, target)
        if dest.exists():
            dest.rmdir()  # empty, checked above
        os.rename(staging, dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise StoreError(f"cannot export to {dest}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _same_links(dest: Path, sources: dict[str, Path]) -> bool:
    """Whether ``dest`` is already exactly this linked export (and nothing more)."""
    if not dest.is_dir() or dest.is_symlink():
        return False
    found = {
        str(path.relative_to(dest)).replace(os.sep, "/"): path
        for path in dest.rglob("*")
        if not path.is_dir() or path.is_symlink()
    }
    if set(found) != set(sources):
        return False
    return all(
        found[name].is_symlink() and found[name].resolve() == sources[name].resolve()
        for name in sources
    )


def present_entries(
    store: Store, files: Sequence[tuple[str, str]]
) -> tuple[list[tuple[str, str]], list[str]]:
    """``files`` split into those complete in ``store`` and the paths of the others (a
    collection fetched with ``--include`` holds only some of its files)."""
    present = [(path, blob_id) for path, blob_id in files if store.has(blob_id)]
    missing = [path for path, blob_id in files if not store.has(blob_id)]
    return present, missing


def export_tag(dest: Path) -> str:
    """The tag that pins a linked export at ``dest``: its name, and a digest of its
    absolute path so that two exports of one name elsewhere do not share (and unpin)
    one tag."""
    where = str(dest.expanduser().absolute())
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in dest.name)[:40]
    return f"export-{name or 'dir'}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


def link_file(store: Store, blob_id: str, dest: Path) -> None:
    """``dest`` becomes a symlink to the blob's read-only file in the store."""
    dest = dest.expanduser()
    check_output(dest)
    source = store.path(blob_id).resolve()
    if dest.is_symlink() and dest.resolve() == source:
        return  # the same link again: nothing to do
    if dest.exists() or dest.is_symlink():
        raise StoreError(f"{dest} already exists; give a new path")
    staging = dest.absolute().parent / f".{dest.name}.blobnet-{secrets.token_hex(6)}"
    try:
        staging.symlink_to(source)
        os.rename(staging, dest)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise StoreError(f"cannot link {dest}: {exc.strerror or exc}") from None
