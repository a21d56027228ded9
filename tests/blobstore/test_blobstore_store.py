"""Store behaviour in one process: round trips, partial blobs, names, gc, collections."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from blake3 import blake3

import blobstore.removal as removal_mod
from blobstore import (
    AmbiguousPrefix,
    BadCollection,
    BadTagName,
    BlobExists,
    BlobNotFound,
    ChunkUnavailable,
    CollectionEntry,
    CorruptChunk,
    Manifest,
    NoSpace,
    PartialBusy,
    PathNotFound,
    Store,
    StoreError,
    blob_id_of,
)
from blobstore.collection import decode_collection, encode_collection
from blobstore.layout import IO_BUFFER_SIZE
from blobstore.space import Space
from tests.blobstore.conftest import Parts

C = 64 * 1024
SIZES = [0, 1, C - 1, C, C + 1, 9 * C + 123]
Check = Callable[[Path], None]


def chunks_of(data: bytes, m: Manifest) -> list[bytes]:
    return [data[o : o + n] for o, n in (m.chunk_span(i) for i in range(m.num_chunks))]


def make_writable(path: Path) -> None:
    path.chmod(0o644)


def flip_byte(path: Path, offset: int) -> None:
    mode = path.stat().st_mode
    make_writable(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    path.chmod(mode & 0o777)


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("size", SIZES)
def test_put_round_trips(store: Store, tmp_path: Path, size: int, check_consistent: Check) -> None:
    data = os.urandom(size)
    expected = Manifest.of_bytes(data, C).blob_id
    src = tmp_path / "src"
    src.write_bytes(data)
    blocks = [data[i : i + 1000] for i in range(0, size, 1000)]  # sizes unaligned to chunks
    seen: list[int] = []
    assert blob_id_of(iter(blocks), chunk_size=C) == expected
    assert not store.has(expected)  # hashed, not stored
    assert store.put_path(src, chunk_size=C, progress=seen.append) == expected
    assert store.put_bytes(data, chunk_size=C) == expected
    assert store.put_blocks(iter(blocks), chunk_size=C) == expected
    assert src.read_bytes() == data  # copy mode leaves the source alone
    assert seen[-1:] == ([size] if size else [])
    assert store.has(expected)
    assert store.path(expected).read_bytes() == data
    assert store.path(expected).stat().st_mode & 0o777 == 0o400  # private by default
    m = store.manifest(expected)
    assert m == Manifest.of_bytes(data, C)
    assert b"".join(store.read_chunk(expected, i) for i in range(m.num_chunks)) == data
    assert b"".join(bytes(p) for p in store.iter_verified(expected)) == data
    assert store.chunk_bitmap(expected) == (b"\xff" * (m.num_chunks // 8)) + (
        bytes([(1 << (m.num_chunks % 8)) - 1]) if m.num_chunks % 8 else b""
    )
    assert store.verify(expected) == []
    out = tmp_path / "out"
    store.export(expected, out)
    assert out.read_bytes() == data
    assert [b.blob_id for b in store.list_blobs()] == [expected]
    check_consistent(store.root)


def test_put_existing_keeps_the_published_file(store: Store) -> None:
    """Regression: a second put of the same content must not replace the first file."""
    data = os.urandom(3 * C)
    blob_id = store.put_bytes(data, chunk_size=C)
    ino = store.path(blob_id).stat().st_ino
    old = time.time() - 10_000
    os.utime(store.path(blob_id), (old, old))
    assert store.put_bytes(data, chunk_size=C) == blob_id
    assert store.path(blob_id).stat().st_ino == ino
    assert store.path(blob_id).stat().st_mtime > old + 5000  # refreshed for gc's grace


def test_chunk_size_changes_the_id(store: Store) -> None:
    data = os.urandom(3 * C)
    assert store.put_bytes(data, chunk_size=C) != store.put_bytes(data, chunk_size=2 * C)


def test_move_links_the_file_in(store: Store, tmp_path: Path, check_consistent: Check) -> None:
    data = os.urandom(2 * C + 5)
    src = tmp_path / "big"
    src.write_bytes(data)
    ino = src.stat().st_ino
    blob_id = store.put_path(src, chunk_size=C, move=True)
    assert not src.exists()
    assert store.path(blob_id).stat().st_ino == ino  # no copy was made
    assert store.path(blob_id).read_bytes() == data
    check_consistent(store.root)


def test_move_of_hard_linked_file_copies(store: Store, tmp_path: Path) -> None:
    """A file with another hard link must not become the store's copy: the other name
    could modify the blob behind the store's back."""
    src = tmp_path / "a"
    src.write_bytes(os.urandom(C))
    os.link(src, tmp_path / "b")
    blob_id = store.put_path(src, chunk_size=C, move=True)
    assert not src.exists()
    assert store.path(blob_id).stat().st_ino != (tmp_path / "b").stat().st_ino


def test_move_of_existing_content_removes_source(store: Store, tmp_path: Path) -> None:
    data = os.urandom(C)
    blob_id = store.put_bytes(data, chunk_size=C)
    src = tmp_path / "again"
    src.write_bytes(data)
    assert store.put_path(src, chunk_size=C, move=True) == blob_id
    assert not src.exists()


def test_put_path_errors(store: Store, tmp_path: Path) -> None:
    with pytest.raises(PathNotFound, match="no such file"):
        store.put_path(tmp_path / "missing")
    with pytest.raises(StoreError, match="directory"):
        store.put_path(tmp_path)
    with pytest.raises(StoreError):
        store.put_bytes(b"x", chunk_size=3000)


def test_no_space_is_checked_before_copying(parts: Parts, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 * C))
    writer = parts.writer(space=Space(parts.layout, free_bytes=lambda: 1000))
    with pytest.raises(NoSpace) as info:
        writer.put_path(src, chunk_size=C)
    assert (info.value.needed, info.value.available) == (3 * C, 1000)
    assert "need 196608 bytes, 1000 available" in str(info.value)
    assert os.listdir(parts.layout.tmp) == []


def test_enospc_becomes_no_space(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(NoSpace, match="no space left"):
        store.put_bytes(os.urandom(C), chunk_size=C)
    monkeypatch.setattr(os, "write", real_write)
    assert os.listdir(store.root / "tmp") == []


def test_open_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a blobnet store"):
        Store.open(tmp_path / "home")
    assert os.listdir(tmp_path / "home") == ["notes.txt"]


def test_open_sweeps_dead_temp_files_but_not_live_ones(tmp_path: Path) -> None:
    import fcntl

    store = Store.open(tmp_path / "s")
    dead = store.root / "tmp" / "tmp-dead"
    dead.write_bytes(b"left by a crash")
    live = store.root / "tmp" / "tmp-live"
    live.write_bytes(b"a writer is on it")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        Store.open(tmp_path / "s")
        assert not dead.exists()
        assert live.exists()
    finally:
        os.close(fd)
    Store.open(tmp_path / "s")
    assert not live.exists()


def test_a_put_outlives_a_sweep_that_takes_its_new_temp_file_before_it_locks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's open sweeps ``tmp/`` while a put creates its temp file: between
    the put's create and its lock the sweeper can lock, unlink and release the file. The
    put's lock then succeeds on a nameless file, so it must notice and take a new name."""
    import blobstore.durable as durable

    store = Store.open(tmp_path / "s")
    real_lock = durable.try_lock_fd
    swept: list[str] = []
    sweeping = False

    def lock_after_a_sweep(fd: int) -> bool:
        nonlocal sweeping
        if sweeping:  # the sweeper's own lock
            return real_lock(fd)
        if not swept:
            sweeping = True
            swept.extend(durable.sweep_temp_dir(store.root / "tmp"))
            sweeping = False
        return real_lock(fd)

    monkeypatch.setattr(durable, "try_lock_fd", lock_after_a_sweep)
    blob_id = store.put_bytes(b"a put racing a sweep")
    assert len(swept) == 1  # the sweep did take the first temp file
    assert store.path(blob_id).read_bytes() == b"a put racing a sweep"


# ---------------------------------------------------------------- partial blobs
def test_partial_out_of_order_resume_and_publish(store: Store, check_consistent: Check) -> None:
    data = os.urandom(5 * C + 17)
    m = Manifest.of_bytes(data, C)
    parts = chunks_of(data, m)
    with store.begin_partial(m) as p:
        p.write_chunk(4, parts[4])
        p.write_chunk(1, parts[1])
        p.write_chunk(1, b"ignored: chunk 1 is already verified")
        assert p.missing() == [0, 2, 3, 5]
        assert store.chunk_bitmap(m.blob_id) == bytes([0b010010])  # live bitmap
        assert store.read_chunk(m.blob_id, 4) == parts[4]
        with pytest.raises(ChunkUnavailable):
            store.read_chunk(m.blob_id, 0)
        with pytest.raises(ChunkUnavailable, match="still missing"):
            p.publish()
    assert store.chunk_bitmap(m.blob_id) == bytes([0b010010])  # persisted bitmap
    assert store.partial_ids() == [m.blob_id]
    assert not store.has(m.blob_id)
    with pytest.raises(BlobNotFound):
        store.path(m.blob_id)
    with store.begin_partial(m) as p:
        assert p.verified_count == 2
        for i in p.missing():
            p.write_chunk(i, parts[i])
        assert p.is_complete
        assert p.publish() == m.blob_id
    assert store.path(m.blob_id).read_bytes() == data
    assert store.partial_ids() == []
    with pytest.raises(BlobExists):
        store.begin_partial(m)
    check_consistent(store.root)


def test_partial_rejects_bad_chunks_without_writing(store: Store) -> None:
    data = os.urandom(3 * C)
    m = Manifest.of_bytes(data, C)
    parts = chunks_of(data, m)
    with store.begin_partial(m) as p:
        bad = bytearray(parts[0])
        bad[100] ^= 1
        with pytest.raises(CorruptChunk, match="does not match"):
            p.write_chunk(0, bytes(bad))
        with pytest.raises(CorruptChunk, match="expected"):
            p.write_chunk(0, parts[0] + b"x")
        with pytest.raises(CorruptChunk):
            p.write_chunk(1, parts[0])  # right bytes, wrong index
        # A caller's digest is held to the manifest like a hash taken here.
        with pytest.raises(CorruptChunk, match="does not match"):
            p.write_chunk(0, bytes(bad), digest=blake3(bytes(bad)).digest())
        with pytest.raises(CorruptChunk, match="does not match"):
            p.write_chunk(1, parts[1], digest=blake3(parts[0]).digest())
        assert p.verified_count == 0
    raw = (store.root / "partial" / m.blob_id / "data").read_bytes()
    assert raw == bytes(3 * C)  # nothing was written


def test_partial_takes_a_callers_digest_of_the_chunk(store: Store) -> None:
    data = os.urandom(2 * C + 5)
    m = Manifest.of_bytes(data, C)
    parts = chunks_of(data, m)
    with store.begin_partial(m) as p:
        for i, part in enumerate(parts):
            assert p.write_chunk(i, part, digest=blake3(part).digest()) is True
        assert p.write_chunk(0, parts[0], digest=blake3(parts[0]).digest()) is False
        p.publish()
    assert store.path(m.blob_id).read_bytes() == data


def test_zero_size_partial_publishes(store: Store) -> None:
    m = Manifest.of_bytes(b"", C)
    with store.begin_partial(m) as p:
        assert p.is_complete
        p.publish()
    assert store.path(m.blob_id).read_bytes() == b""


def test_second_handle_is_busy(store: Store) -> None:
    m = Manifest.of_bytes(os.urandom(C), C)
    with store.begin_partial(m), pytest.raises(PartialBusy):
        store.begin_partial(m)
    store.begin_partial(m).close()  # released again


def test_corrupted_chunk_in_partial_is_dropped_on_reopen(store: Store) -> None:
    data = os.urandom(4 * C)
    m = Manifest.of_bytes(data, C)
    parts = chunks_of(data, m)
    with store.begin_partial(m) as p:
        for i in (0, 1, 2):
            p.write_chunk(i, parts[i])
    flip_byte(store.root / "partial" / m.blob_id / "data", C + 7)  # inside chunk 1
    with store.begin_partial(m) as p:
        assert p.missing() == [1, 3]
        p.write_chunk(1, parts[1])
        p.write_chunk(3, parts[3])
        p.publish()
    assert store.verify(m.blob_id) == []


def test_lost_bitmap_is_rebuilt_by_rehashing(store: Store) -> None:
    data = os.urandom(4 * C)
    m = Manifest.of_bytes(data, C)
    parts = chunks_of(data, m)
    with store.begin_partial(m) as p:
        p.write_chunk(0, parts[0])
        p.write_chunk(2, parts[2])
    bitmap = store.root / "partial" / m.blob_id / "bitmap"
    bitmap.write_bytes(b"garbage of the wrong length")
    with store.begin_partial(m) as p:
        assert p.missing() == [1, 3]


def test_partial_free_space_check(parts: Parts) -> None:
    m = Manifest.of_bytes(os.urandom(3 * C), C)
    full = parts.writer(space=Space(parts.layout, free_bytes=lambda: C))
    with pytest.raises(NoSpace, match="need 196608"):
        full.begin_partial(m)
    parts.writer().begin_partial(m).close()  # the lock was released by the failed attempt


# ---------------------------------------------------------------- corruption
def test_verify_and_read_find_a_flipped_byte(store: Store) -> None:
    data = os.urandom(3 * C)
    blob_id = store.put_bytes(data, chunk_size=C)
    flip_byte(store.path(blob_id), 2 * C + 5)
    assert store.read_chunk(blob_id, 0) == data[:C]
    with pytest.raises(CorruptChunk, match=r"chunk 2.*quarantined it"):
        store.read_chunk(blob_id, 2)
    assert not store.has(blob_id)  # found on read: no longer published
    assert store.verify(blob_id) == [2]  # the quarantined copy, still checkable
    with pytest.raises(CorruptChunk, match="quarantined"):
        store.export(blob_id, store.root.parent / "out")
    assert not (store.root.parent / "out").exists()


def test_truncated_blob_fails_verify(store: Store) -> None:
    blob_id = store.put_bytes(os.urandom(3 * C), chunk_size=C)
    path = store.path(blob_id)
    make_writable(path)
    os.truncate(path, 2 * C)
    assert store.verify(blob_id) == [2]


# ---------------------------------------------------------------- names
def test_resolve_full_prefix_and_tag(store: Store) -> None:
    blob_id = store.put_bytes(b"hello", chunk_size=C)
    assert store.resolve(blob_id) == blob_id
    assert store.resolve(blob_id[:8]) == blob_id
    assert store.resolve(blob_id[:8].upper()) == blob_id
    store.tag("model-v1", blob_id)
    assert store.resolve("model-v1") == blob_id
    assert store.tags() == {"model-v1": blob_id}
    with pytest.raises(BlobNotFound, match="at least 8"):
        store.resolve(blob_id[:7])
    with pytest.raises(BlobNotFound):
        store.resolve("0" * 64)
    with pytest.raises(BlobNotFound):
        store.resolve("no-such-tag")


def test_ambiguous_prefix(store: Store) -> None:
    shard = store.root / "blobs" / "ab"
    shard.mkdir()
    for tail in ("0", "1"):  # two names sharing 12 characters; resolve looks at names
        (shard / ("abcdef012345" + tail * 52)).write_bytes(b"")
    with pytest.raises(AmbiguousPrefix, match="matches 2 blobs"):
        store.resolve("abcdef01")
    assert store.resolve("abcdef0123450") == "abcdef012345" + "0" * 52


@pytest.mark.parametrize("name", ["", "-x", ".hidden", "a/b", "x" * 129, "deadbeef", "a b"])
def test_bad_tag_names(store: Store, name: str) -> None:
    blob_id = store.put_bytes(b"x", chunk_size=C)
    with pytest.raises(BadTagName):
        store.tag(name, blob_id)


def test_tag_unknown_blob_and_untag(store: Store) -> None:
    with pytest.raises(BlobNotFound):
        store.tag("t", "0" * 64)
    blob_id = store.put_bytes(b"x", chunk_size=C)
    store.tag("t", blob_id)
    store.untag("t")
    assert store.tags() == {}
    with pytest.raises(BlobNotFound, match="no tag"):
        store.untag("t")


def test_rm(store: Store, check_consistent: Check) -> None:
    blob_id = store.put_bytes(os.urandom(C), chunk_size=C)
    store.tag("t", blob_id)
    store.rm(blob_id)
    assert not store.has(blob_id)
    assert store.tags() == {}
    with pytest.raises(BlobNotFound):
        store.rm(blob_id)
    m = Manifest.of_bytes(os.urandom(C), C)
    store.begin_partial(m).close()
    store.rm(m.blob_id)
    assert store.partial_ids() == []
    check_consistent(store.root)


# ---------------------------------------------------------------- gc
def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t), follow_symlinks=False)


def test_gc_grace_and_tags(store: Store) -> None:
    keep = store.put_bytes(b"tagged", chunk_size=C)
    old = store.put_bytes(b"old", chunk_size=C)
    young = store.put_bytes(b"young", chunk_size=C)
    store.tag("keep", keep)
    age(store.path(keep), 7200)
    age(store.path(old), 7200)
    assert store.gc(3600) == [old]
    assert store.has(keep)
    assert store.has(young)
    assert not store.has(old)
    assert store.gc(0) == [young]
    store.untag("keep")
    assert store.gc(0) == [keep]
    assert store.list_blobs() == []


def test_gc_dry_run_lists_what_gc_deletes_and_deletes_nothing(store: Store) -> None:
    """``blob gc --dry-run`` is how a user sees what forgetting a run would free; a dry
    run that deleted, or listed other blobs than gc then takes, would mislead them."""
    old = store.put_bytes(b"old", chunk_size=C)
    idle = Manifest.of_bytes(os.urandom(C), C)
    store.begin_partial(idle).close()
    store.put_bytes(b"young", chunk_size=C)
    age(store.path(old), 7200)
    age(store.root / "partial" / idle.blob_id, 7200)
    listed = store.gc(3600, dry_run=True)
    assert listed == sorted([old, idle.blob_id])
    assert store.has(old) and store.partial_ids() == [idle.blob_id]
    assert store.gc(3600) == listed


def test_gc_partials(store: Store) -> None:
    held = Manifest.of_bytes(os.urandom(C), C)
    idle = Manifest.of_bytes(os.urandom(C), C)
    store.begin_partial(idle).close()
    with store.begin_partial(held):
        assert store.gc(0) == [idle.blob_id]  # a held partial is never collected
        assert store.partial_ids() == [held.blob_id]
    age(store.root / "partial" / held.blob_id, 10)
    assert store.gc(3600) == []  # idle but within the grace
    assert store.gc(5) == [held.blob_id]


def test_gc_deletes_outside_the_store_lock_and_a_killed_gcs_trash_is_swept(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing a large blob's space can take the filesystem seconds; a put waiting on the
    store lock meanwhile must not time out. So gc only renames under the lock, and a gc
    killed before its deletes leaves trash that the next open removes."""
    old = store.put_bytes(os.urandom(3 * C), chunk_size=C)
    age(store.path(old), 7200)
    other = Store.open(store.root, lock_timeout=0.5)
    put_while_deleting: list[str] = []
    real_delete = removal_mod.delete_trash

    def delete(path: str) -> None:
        put_while_deleting.append(other.put_bytes(b"arrives during the delete", chunk_size=C))
        real_delete(path)

    monkeypatch.setattr(removal_mod, "delete_trash", delete)
    assert store.gc(3600) == [old]
    assert len(put_while_deleting) == 1 and store.has(put_while_deleting[0])
    assert not store.has(old) and os.listdir(store.tmp_dir) == []

    # Killed between rename and delete: the trash (a partial's directory) stays in tmp/.
    monkeypatch.setattr(removal_mod, "delete_trash", lambda path: None)
    store.begin_partial(Manifest.of_bytes(os.urandom(C), C)).close()
    assert len(store.gc(0)) == 2
    assert len(os.listdir(store.tmp_dir)) == 2
    Store.open(store.root)
    assert os.listdir(store.tmp_dir) == []


def test_gc_keeps_children_of_tagged_collection(store: Store, tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "w.bin").write_bytes(os.urandom(C + 1))
    cid = store.put_dir(d, chunk_size=C)
    store.tag("model", cid)
    assert store.gc(0) == []
    store.untag("model")
    assert len(store.gc(0)) == 3


# ---------------------------------------------------------------- collections
def test_collection_round_trip(store: Store, tmp_path: Path, check_consistent: Check) -> None:
    src = tmp_path / "model"
    files = {
        "config.json": b'{"hidden": 8}',
        "empty": b"",
        "weights/model-00001.safetensors": os.urandom(3 * C + 9),
        "weights/sub/tokenizer.json": b"{}",
    }
    for rel, content in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(content)
    cid = store.put_dir(src, chunk_size=C)
    assert store.is_collection(cid)
    entries = store.read_collection(cid)
    assert [e.path for e in entries] == sorted(files)
    assert {e.path: e.size for e in entries} == {k: len(v) for k, v in files.items()}
    assert store.put_dir(src, chunk_size=C) == cid  # deterministic
    out = tmp_path / "restored"
    store.export(cid, out)
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert got == files
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    store.export(cid, out)  # again, identical content already there: nothing to do
    (out / "config.json").write_bytes(b'{"hidden": 9}')
    with pytest.raises(StoreError, match="already exists with other content"):
        store.export(cid, out)
    assert (out / "config.json").read_bytes() == b'{"hidden": 9}'  # never overwritten
    check_consistent(store.root)


def test_export_names_a_missing_child(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "a").write_bytes(b"aaa")
    (src / "b").write_bytes(b"bbb")
    cid = store.put_dir(src, chunk_size=C)
    child = store.read_collection(cid)[1]
    store.rm(child.blob_id)
    with pytest.raises(BlobNotFound, match="needs b"):
        store.export(cid, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_plain_blob_is_not_a_collection(store: Store) -> None:
    assert not store.is_collection(store.put_bytes(b"\x82\xaacollection"))  # short of the magic
    assert not store.is_collection(store.put_bytes(b""))
    assert not store.is_collection(store.put_bytes(b"plain bytes, any length"))


def test_collection_shaped_garbage_is_refused_not_passed_as_a_file(store: Store) -> None:
    """Someone meant it as a collection: say it is malformed (exit 4), do not guess."""
    blob_id = store.put_bytes(b"\x82\xaacollection\x01 but not really")
    with pytest.raises(BadCollection, match="malformed collection") as info:
        store.is_collection(blob_id)
    assert info.value.exit_code == 4


HOSTILE = [
    "../escape",
    "/etc/passwd",
    "a/../../b",
    "a//b",
    "./a",
    "a/.",
    "",
    "a\\..\\b",
    "a\x00b",
]


def _raw_collection(entries: list[list[object]]) -> bytes:
    out: bytes = msgpack.packb({"collection": 1, "entries": entries}, use_bin_type=True)
    return out


@pytest.mark.parametrize("path", HOSTILE)
def test_hostile_collection_paths_rejected(store: Store, tmp_path: Path, path: str) -> None:
    child = store.put_bytes(b"payload", chunk_size=C)
    data = _raw_collection([[path, child, 7]])
    with pytest.raises(BadCollection):
        decode_collection(data)
    with pytest.raises(BadCollection):
        encode_collection([CollectionEntry(path, child, 7)])
    blob_id = store.put_bytes(data, chunk_size=C)
    with pytest.raises(BadCollection, match="malformed collection"):
        store.is_collection(blob_id)
    dest = tmp_path / "inner" / "out"
    dest.parent.mkdir()
    with pytest.raises(BadCollection, match="malformed collection"):
        store.export(blob_id, dest)  # refused: not renamed, not written as a plain file
    outside = [p for p in tmp_path.rglob("*") if store.root not in (p, *p.parents)]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in outside) == ["inner"]


@pytest.mark.parametrize(
    "entries",
    [
        [["b", "0" * 64, 1], ["a", "0" * 64, 1]],  # unsorted
        [["a", "0" * 64, 1], ["a", "0" * 64, 1]],  # duplicate
        [["a", "0" * 64, 1], ["a/b", "0" * 64, 1]],  # file where a directory must be
        [["a", "0" * 63, 1]],  # bad ID
        [["a", "0" * 64, -1]],  # bad size
        [["a", "0" * 64]],  # short entry
    ],
)
def test_malformed_collections_rejected(entries: list[list[object]]) -> None:
    with pytest.raises(BadCollection):
        decode_collection(_raw_collection(entries))


def test_collection_good_form_decodes() -> None:
    """Guards the rejections above: a well-formed one passes the same decoder."""
    entries = [["a", "0" * 64, 1], ["b/c", "1" * 64, 2]]
    assert [e.path for e in decode_collection(_raw_collection(entries))] == ["a", "b/c"]


def test_io_buffer_is_a_chunk_multiple() -> None:
    assert IO_BUFFER_SIZE % C == 0
