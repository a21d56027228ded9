"""Export: the same content twice is a success, and a fresh fetch is not hashed twice.

``blob get ID -o DIR`` run twice succeeds both times (no "already exists", exit 5), and
``-o`` right after a fetch does not copy and re-hash (seconds per GiB) what was just
verified.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blobstore import CorruptChunk, Store, StoreError

C = 64 * 1024


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Inode and mtime of every file: unchanged means nothing was rewritten."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def collection(store: Store, tmp_path: Path) -> str:
    src = tmp_path / "model"
    (src / "weights").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "weights" / "model.safetensors").write_bytes(os.urandom(3 * C + 1))
    return store.put_dir(src, chunk_size=C)


def test_exporting_a_collection_again_is_idempotent(
    store: Store, collection: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    store.export(collection, out)
    before = snapshot(out)
    store.export(collection, out)
    assert snapshot(out) == before  # succeeded without rewriting anything


@pytest.mark.parametrize("change", ["extra", "missing", "edited"])
def test_a_directory_with_other_content_is_refused(
    store: Store, collection: str, tmp_path: Path, change: str
) -> None:
    out = tmp_path / "out"
    store.export(collection, out)
    if change == "extra":
        (out / "notes.txt").write_text("mine")
    elif change == "missing":
        (out / "config.json").unlink()
    else:
        (out / "config.json").write_text('{"a": 2}')
    before = snapshot(out)
    with pytest.raises(StoreError, match="other content") as info:
        store.export(collection, out)
    assert info.value.exit_code == 5
    assert snapshot(out) == before


def test_exporting_a_file_again_does_not_rewrite_it(store: Store, tmp_path: Path) -> None:
    blob_id = store.put_bytes(os.urandom(2 * C), chunk_size=C)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "w.bin"
    store.export(blob_id, out)
    before = snapshot(out.parent)
    store.export(blob_id, out)
    assert snapshot(out.parent) == before


def test_hardlink_export_shares_the_store_file(
    store: Store, collection: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    store.export(collection, out, link="hardlink", verify=False)
    for e in store.read_collection(collection):
        exported = out.joinpath(*e.path.split("/"))
        assert exported.stat().st_ino == store.path(e.blob_id).stat().st_ino
    store.export(collection, out, link="hardlink")  # identical: recognised by inode


def test_export_without_verify_does_not_hash_again(
    store: Store, collection: str, tmp_path: Path
) -> None:
    """After a fetch every chunk was checked on arrival: export copies, nothing more. A
    child rotten on disk shows it: copied as it is, not found, not quarantined (while a
    verifying export finds it)."""
    entries = store.read_collection(collection)  # the listing itself is read and checked
    child = max(entries, key=lambda e: e.size)
    stored = store.path(child.blob_id)
    os.chmod(stored, 0o600)
    with open(stored, "r+b") as f:
        f.write(b"rot")
    os.chmod(stored, 0o400)
    for link in ("copy", "reflink"):
        out = tmp_path / f"out-{link}"
        store.export(collection, out, link=link, verify=False)  # type: ignore[arg-type]
        for e in entries:
            got = out.joinpath(*e.path.split("/")).read_bytes()
            assert got == store.path(e.blob_id).read_bytes()
            assert (
                out.joinpath(*e.path.split("/")).stat().st_ino
                != store.path(e.blob_id).stat().st_ino
            )
    assert store.has(child.blob_id)  # never hashed, so never found rotten
    with pytest.raises(CorruptChunk):
        store.export(collection, tmp_path / "out-verified")
    assert not store.has(child.blob_id)


def test_default_export_is_an_independent_verified_file(store: Store, tmp_path: Path) -> None:
    data = os.urandom(C + 3)
    blob_id = store.put_bytes(data, chunk_size=C)
    out = tmp_path / "copy.bin"
    store.export(blob_id, out)
    assert out.read_bytes() == data
    assert out.stat().st_ino != store.path(blob_id).stat().st_ino
    assert os.access(out, os.W_OK)  # the user's own copy, not the store's read-only file
