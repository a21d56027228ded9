"""Bit rot found on read quarantines the blob; publishing the same ID again repairs it.

The store side of rot: a flipped byte in a provider's blob file must neither be served
silently nor stay advertised as complete, and a re-``put`` of the original must really
repair it. Whoever finds a chunk that fails its hash (``verify``, a verifying read, a
server's ``--verify-reads``) moves the blob to ``quarantine/``: ``has`` is False,
listings show it as quarantined, reads refuse it. A ``put`` of the same content, or a
fetched partial published for the ID, repairs it, and a fetch starts from the rotten copy
so only the bad chunks cross the network.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blobstore import BlobQuarantined, ChunkUnavailable, CorruptChunk, Manifest, Store

C = 64 * 1024


def rot(store: Store, blob_id: str, chunk: int) -> None:
    """Flip one byte of a stored chunk, as a failing disk would."""
    path = store.path(blob_id)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(chunk * C + 7)
        byte = f.read(1)
        f.seek(chunk * C + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    os.chmod(path, 0o400)


@pytest.fixture
def rotten(store: Store) -> tuple[str, bytes]:
    data = os.urandom(4 * C + 100)
    blob_id = store.put_bytes(data, chunk_size=C)
    store.tag("model", blob_id)
    rot(store, blob_id, 2)
    return blob_id, data


def assert_unpublished(store: Store, blob_id: str) -> None:
    assert not store.has(blob_id)
    assert blob_id not in store.layout.complete_ids()
    assert store.chunk_bitmap(blob_id) == bytes(len(store.chunk_bitmap(blob_id)))
    row = next(r for r in store.list_blobs() if r.blob_id == blob_id)
    assert (row.complete, row.quarantined, row.tags) == (False, True, ("model",))
    with pytest.raises(BlobQuarantined, match="quarantined as corrupt"):
        store.path(blob_id)
    with pytest.raises(ChunkUnavailable):
        store.read_chunk(blob_id, 0)
    assert store.resolve("model") == blob_id  # the name still means that content


def test_verify_quarantines_what_it_finds_rotten(store: Store, rotten: tuple[str, bytes]) -> None:
    blob_id, _ = rotten
    assert store.verify(blob_id) == [2]
    assert_unpublished(store, blob_id)
    reason = store.quarantine_reason(blob_id)
    assert reason is not None and "1 corrupt chunk(s): 2" in reason
    assert store.quarantined_ids() == [blob_id]
    assert store.verify(blob_id) == [2]  # the quarantined copy can still be checked


def test_a_verifying_reader_quarantines_on_the_bad_chunk(
    store: Store, rotten: tuple[str, bytes]
) -> None:
    """The server's path: a chunk read with verify fails; the blob stops being offered."""
    blob_id, data = rotten
    with store.open_reader(blob_id) as reader:
        assert reader.read(1) == data[C : 2 * C]
        with pytest.raises(CorruptChunk, match="quarantined it"):
            reader.read(2)
    assert_unpublished(store, blob_id)
    with pytest.raises(BlobQuarantined):
        store.open_reader(blob_id)


def test_a_reader_of_the_rotten_file_never_quarantines_its_repaired_successor(
    store: Store, rotten: tuple[str, bytes]
) -> None:
    """A server's reader opened the rotten file; meanwhile ``verify`` quarantined it and
    a ``put`` repaired it. When the old reader then hits the bad chunk, it must not take
    the good, repaired copy out of the published set."""
    blob_id, data = rotten
    with store.open_reader(blob_id) as reader:
        assert store.verify(blob_id) == [2]
        assert store.put_bytes(data, chunk_size=C) == blob_id  # the repair
        with pytest.raises(CorruptChunk, match="replaced meanwhile"):
            reader.read(2)
    assert store.has(blob_id)
    assert store.quarantine_reason(blob_id) is None
    assert store.verify(blob_id) == []


def test_export_and_cat_quarantine_on_the_bad_chunk(
    store: Store, rotten: tuple[str, bytes], tmp_path: Path
) -> None:
    blob_id, _ = rotten
    with pytest.raises(CorruptChunk, match=r"chunk 2.*quarantined it"):
        store.export(blob_id, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert_unpublished(store, blob_id)


def test_explicit_quarantine_is_idempotent(store: Store, rotten: tuple[str, bytes]) -> None:
    blob_id, _ = rotten
    assert store.quarantine(blob_id, "peer 12D3KooW... reported chunk 2 bad") is True
    assert store.quarantine(blob_id, "again") is False
    assert "reported chunk 2 bad" in (store.quarantine_reason(blob_id) or "")
    assert_unpublished(store, blob_id)


def test_a_peer_quoted_in_the_reason_cannot_reach_the_terminal(
    store: Store, rotten: tuple[str, bytes]
) -> None:
    blob_id, _ = rotten
    store.quarantine(blob_id, "peer says \x1b]0;pwned\x07 chunk 2\nis bad" + "x" * 900)
    reason = store.quarantine_reason(blob_id) or ""
    assert "\x1b" not in reason and "\x07" not in reason and "\n" not in reason
    assert "chunk 2 is bad" in reason and len(reason) < 600


def test_put_of_the_original_repairs_it(store: Store, rotten: tuple[str, bytes]) -> None:
    blob_id, data = rotten
    store.verify(blob_id)
    assert store.put_bytes(data, chunk_size=C) == blob_id
    assert store.has(blob_id)
    assert store.verify(blob_id) == []
    assert store.quarantine_reason(blob_id) is None
    assert store.quarantined_ids() == []
    assert store.tags() == {"model": blob_id}


def test_a_fetched_partial_repairs_it_fetching_only_the_rotten_chunk(
    store: Store, rotten: tuple[str, bytes]
) -> None:
    blob_id, data = rotten
    store.verify(blob_id)
    m = Manifest.decode(Manifest.of_bytes(data, C).encode())
    with store.begin_partial(m) as partial:
        assert partial.missing() == [2]  # the good chunks came from the quarantined copy
        partial.write_chunk(2, data[2 * C : 3 * C])
        partial.publish()
    assert store.has(blob_id)
    assert store.verify(blob_id) == []
    assert store.quarantine_reason(blob_id) is None
    assert store.path(blob_id).read_bytes() == data


def test_gc_collects_an_untagged_quarantine_but_keeps_a_tagged_one(
    store: Store, rotten: tuple[str, bytes]
) -> None:
    blob_id, _ = rotten
    store.verify(blob_id)
    assert store.gc(0) == []  # tagged: kept for repair
    store.untag("model")
    assert store.gc(3600) == []  # within the grace
    assert store.gc(0) == [blob_id]
    assert store.quarantined_ids() == []


def test_gc_stops_rather_than_guess_a_quarantined_collections_children(
    store: Store, tmp_path: Path
) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(C))
    cid = store.put_dir(src, chunk_size=C)
    store.tag("m", cid)
    child = store.read_collection(cid)[0].blob_id
    store.quarantine(cid, "test")
    with pytest.raises(Exception, match="gc stopped"):
        store.gc(0)
    assert store.has(child)


def test_rm_removes_a_quarantined_blob(store: Store, rotten: tuple[str, bytes]) -> None:
    blob_id, _ = rotten
    store.verify(blob_id)
    store.rm(blob_id)
    assert store.quarantined_ids() == [] and store.tags() == {}


def test_a_repair_never_writes_into_a_hard_linked_export(
    store: Store, rotten: tuple[str, bytes], tmp_path: Path
) -> None:
    """A blob exported with link="hardlink" shares its inode with the user's file; if
    the user edited it, the store sees rot. The repair fetches the blob whole rather
    than rewrite the user's file in place."""
    blob_id, data = rotten
    mine = tmp_path / "mine.bin"
    os.link(store.path(blob_id), mine)  # what export(link="hardlink") leaves behind
    edited = mine.read_bytes()
    store.verify(blob_id)
    m = Manifest.of_bytes(data, C)
    with store.begin_partial(m) as partial:
        assert partial.missing() == list(range(m.num_chunks))
        for i in partial.missing():
            partial.write_chunk(i, data[i * C : (i + 1) * C])
        partial.publish()
    assert store.verify(blob_id) == []
    assert mine.read_bytes() == edited
