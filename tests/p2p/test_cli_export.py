"""`blob export` / `get -o`'s directory writer: only relative paths inside the
destination, links only to the store's own read-only files, and nothing half-made
visible (in-process, a real store on disk)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from blobstore import BadCollection, BlobNotFound, Store, StoreError
from blobstore.export import export_files, link_file


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "store")


def test_a_path_that_leaves_the_destination_is_refused_and_nothing_is_written(
    store: Store, tmp_path: Path
) -> None:
    blob = store.put_bytes(b"weights")
    out = tmp_path / "out"
    out.mkdir()
    for hostile in ("../escaped", "/tmp/absolute", "a/../../escaped", "a/./b", ""):
        with pytest.raises(BadCollection):
            export_files(store, [("ok.bin", blob), (hostile, blob)], out / "model", link=True)
    assert sorted(os.listdir(out)) == []  # no staging directory or stray file left
    assert not (tmp_path / "escaped").exists()


def test_links_point_at_the_stores_read_only_files(store: Store, tmp_path: Path) -> None:
    config, weights = store.put_bytes(b"{}"), store.put_bytes(b"\x00" * 100)
    files = [("config.json", config), ("sub/model.safetensors", weights)]
    export_files(store, files, tmp_path / "linked", link=True)
    store_root = (tmp_path / "store").resolve()
    for path, blob in files:
        link = tmp_path / "linked" / path
        assert link.is_symlink()
        target = link.resolve()
        assert target == store.path(blob).resolve() and target.is_relative_to(store_root)
        assert not target.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    export_files(store, files, tmp_path / "linked", link=True)  # the same again: a no-op
    # A link there that points anywhere else is not "the same export": refused, untouched.
    (tmp_path / "linked" / "config.json").unlink()
    (tmp_path / "linked" / "config.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StoreError, match="already exists"):
        export_files(store, files, tmp_path / "linked", link=True)
    assert os.readlink(tmp_path / "linked" / "config.json") == str(tmp_path / "elsewhere")


def test_a_missing_blob_fails_before_anything_is_made(store: Store, tmp_path: Path) -> None:
    present = store.put_bytes(b"here")
    with pytest.raises(BlobNotFound):
        export_files(store, [("a", present), ("b", "0" * 64)], tmp_path / "out", link=False)
    with pytest.raises(BlobNotFound):
        link_file(store, "0" * 64, tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_copies_are_the_blobs_bytes(store: Store, tmp_path: Path) -> None:
    blob = store.put_bytes(b"exact bytes")
    export_files(store, [("d/f.bin", blob)], tmp_path / "copied", link=False)
    copy = tmp_path / "copied" / "d" / "f.bin"
    assert not copy.is_symlink() and copy.read_bytes() == b"exact bytes"
    link_file(store, blob, tmp_path / "one.bin")
    link_file(store, blob, tmp_path / "one.bin")  # the same link again: a no-op
    assert (tmp_path / "one.bin").resolve() == store.path(blob).resolve()
