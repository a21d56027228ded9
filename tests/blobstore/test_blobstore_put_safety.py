"""What ``put`` refuses so that a blob always matches something the user meant to share.

``blob put DIR`` must not follow symlinks to files outside DIR (and so serve them), and a
``put`` of a file being modified must not publish a blob that matches no state of the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import blobstore.writing as writing_mod
from blobstore import FileChanged, Store, StoreError

C = 64 * 1024
HOUR_AGO = 3600


def published(store: Store) -> list[str]:
    return [r.blob_id for r in store.list_blobs() if r.complete]


@pytest.fixture
def model_with_a_link(tmp_path: Path) -> Path:
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").symlink_to(secret)
    return model


def test_put_dir_refuses_a_symlink_and_stores_nothing(
    store: Store, model_with_a_link: Path
) -> None:
    with pytest.raises(StoreError, match=r"tokenizer.json is a symbolic link \(to .*id_ed25519"):
        store.put_dir(model_with_a_link, chunk_size=C)
    assert published(store) == []


def test_put_dir_follows_symlinks_only_when_asked(store: Store, model_with_a_link: Path) -> None:
    cid = store.put_dir(model_with_a_link, chunk_size=C, follow_symlinks=True)
    entries = {e.path: e.size for e in store.read_collection(cid)}
    assert entries == {"config.json": 2, "tokenizer.json": 35}


def test_put_dir_refuses_a_symlinked_directory_and_a_loop(store: Store, tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "sub" / "w.bin").write_bytes(b"w")
    (model / "sub" / "again").symlink_to(model)
    with pytest.raises(StoreError, match="again is a symbolic link"):
        store.put_dir(model, chunk_size=C)
    with pytest.raises(StoreError, match="reached twice"):
        store.put_dir(model, chunk_size=C, follow_symlinks=True)
    assert published(store) == []


@pytest.mark.parametrize("move", [False, True], ids=["copy", "move"])
@pytest.mark.parametrize("change", ["rewrite", "append"])
def test_put_refuses_a_file_that_changes_while_it_is_read(
    store: Store, tmp_path: Path, move: bool, change: str
) -> None:
    """The writer touches the file after the first buffer is hashed: refused, exit 5,
    nothing stored, the user's file left where it was."""
    store = Store.open(store.root, io_buffer=C)  # several reads of a small file
    src = tmp_path / "checkpoint.bin"
    src.write_bytes(os.urandom(4 * C))
    old = src.stat().st_mtime - HOUR_AGO  # so a rewrite within one clock tick still shows
    os.utime(src, (old, old))
    calls = 0

    def writer_strikes(done: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            with open(src, "r+b" if change == "rewrite" else "ab") as f:
                f.write(b"new step")

    with pytest.raises(FileChanged, match="changed while it was being read") as info:
        store.put_path(src, chunk_size=C, move=move, progress=writer_strikes)
    assert info.value.exit_code == 5
    assert published(store) == []
    assert src.exists()
    assert os.listdir(store.root / "tmp") == []


def test_an_unchanged_file_is_put(store: Store, tmp_path: Path) -> None:
    """Guards the test above: the same read with no writer succeeds."""
    src = tmp_path / "checkpoint.bin"
    src.write_bytes(os.urandom(4 * C))
    blob_id = store.put_path(src, chunk_size=C)
    assert published(store) == [blob_id]


def test_a_move_written_after_its_last_check_is_given_back(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``put --move`` of a file another process still has open for writing: a write that
    lands after the hash and its check but before the link would leave the store naming
    bytes that are not the blob. It is caught once linked: unpublished, the file put back
    where it was with its mode, FileChanged."""
    src = tmp_path / "checkpoint.bin"
    src.write_bytes(os.urandom(4 * C))
    old = src.stat().st_mtime - HOUR_AGO
    os.utime(src, (old, old))
    os.chmod(src, 0o640)
    real_link = writing_mod.link_or_rename

    def late_writer(source: Path, target: Path, *, replace: bool) -> bool:
        os.pwrite(writer, b"late step", 0)
        return real_link(source, target, replace=replace)

    monkeypatch.setattr(writing_mod, "link_or_rename", late_writer)
    writer = os.open(src, os.O_WRONLY)  # the training job's descriptor, still open
    try:
        with pytest.raises(FileChanged, match="written while it was being moved"):
            store.put_path(src, chunk_size=C, move=True)
    finally:
        os.close(writer)
    assert published(store) == []
    assert src.read_bytes().startswith(b"late step")
    assert oct(src.stat().st_mode & 0o777) == oct(0o640)


def test_a_move_written_late_with_a_new_file_in_its_place_keeps_both(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the user already wrote a new file at the old name: the moved bytes
    cannot go back there, and are kept in quarantine rather than dropped."""
    src = tmp_path / "checkpoint.bin"
    src.write_bytes(os.urandom(4 * C))
    old = src.stat().st_mtime - HOUR_AGO
    os.utime(src, (old, old))
    real_link = writing_mod.link_or_rename

    def late_writer_and_new_file(source: Path, target: Path, *, replace: bool) -> bool:
        os.pwrite(writer, b"late step", 0)
        linked = real_link(source, target, replace=replace)
        source.write_bytes(b"the next checkpoint")
        return linked

    monkeypatch.setattr(writing_mod, "link_or_rename", late_writer_and_new_file)
    writer = os.open(src, os.O_WRONLY)
    try:
        with pytest.raises(FileChanged, match="moved bytes are kept in"):
            store.put_path(src, chunk_size=C, move=True)
    finally:
        os.close(writer)
    assert published(store) == []
    assert src.read_bytes() == b"the next checkpoint"
    (kept,) = store.quarantined_ids()
    assert (store.root / "quarantine" / kept / "data").read_bytes().startswith(b"late step")


def test_a_fifo_is_refused_before_its_open_waits_for_a_writer(tmp_path: Path) -> None:
    """``put`` of a FIFO is refused at once: opening one blocks until a writer comes, and
    the type check after the open must not wait for that."""
    import threading

    store = Store.open(tmp_path / "store")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def put() -> None:
        try:
            store.put_path(fifo)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=put, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # blocked in open(): give it its writer so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=10)
        pytest.fail("put of a FIFO waited for a writer")
    assert len(errors) == 1 and "not a regular file" in str(errors[0])
