"""PartialBlob's fast write path: O_DIRECT writes of aligned chunks, writers on several
threads at once, and a flush that persists only chunks written before its fsync began."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

import blobstore.partial as partial_mod
from blobstore import ChunkUnavailable, CorruptChunk, Manifest, PartialBlob, Store, StoreError
from blobstore import bitmap as bm
from blobstore.partial import read_bitmap

C = 64 * 1024  # the smallest chunk size: a multiple of the O_DIRECT alignment


def chunk_of(data: bytes, manifest: Manifest, index: int) -> bytes:
    offset, length = manifest.chunk_span(index)
    return data[offset : offset + length]


def aligned_copy(data: bytes) -> memoryview:
    """``data`` in a page-aligned anonymous mmap (what the downloader's pool hands out)."""
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[: len(data)] = data
    return memoryview(buf)[: len(data)]


def misaligned_copy(data: bytes) -> memoryview:
    """``data`` one byte past a page boundary: never acceptable to O_DIRECT."""
    buf = mmap.mmap(-1, len(data) + 1)
    buf[1:] = data
    return memoryview(buf)[1:]


needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def assert_published(store: Store, blob_id: str, data: bytes) -> None:
    """The blob is complete in the store, byte-identical, and verifies."""
    assert store.path(blob_id).read_bytes() == data
    assert store.verify(blob_id) == []


def require_o_direct(tmp_path: Path) -> None:
    """Skip unless tmp_path's file system takes an aligned O_DIRECT write."""
    probe = tmp_path / "o_direct_probe"
    probe.write_bytes(bytes(C))
    fd = partial_mod.open_direct(probe)
    if fd is None:
        pytest.skip("the file system under tmp_path refuses O_DIRECT")
    try:
        os.pwrite(fd, aligned_copy(os.urandom(C)), 0)
    except OSError as exc:
        pytest.skip(f"the file system under tmp_path refuses an aligned O_DIRECT write: {exc}")
    finally:
        os.close(fd)
        probe.unlink()


@dataclass
class Pwrite:
    fd: int
    offset: int
    length: int
    error: int | None  # errno when it raised


def record_pwrites(monkeypatch: pytest.MonkeyPatch) -> list[Pwrite]:
    """Every pwrite_all the partial makes, with the descriptor it used."""
    calls: list[Pwrite] = []
    real = partial_mod.pwrite_all

    def wrapper(fd: int, view: memoryview, offset: int) -> None:
        try:
            real(fd, view, offset)
        except OSError as exc:
            calls.append(Pwrite(fd, offset, len(view), exc.errno))
            raise
        calls.append(Pwrite(fd, offset, len(view), None))

    monkeypatch.setattr(partial_mod, "pwrite_all", wrapper)
    return calls


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- (a) O_DIRECT -------------------------------------------------------------------------


@needs_o_direct
def test_aligned_chunks_from_an_mmap_go_through_the_direct_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_o_direct(tmp_path)
    data = os.urandom(4 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    fds_before = open_fds()
    calls = record_pwrites(monkeypatch)
    partial = store.begin_partial(manifest)
    for i in (2, 0, 3, 1):
        assert partial.write_chunk(i, aligned_copy(chunk_of(data, manifest, i))) is True
    assert partial._direct_fd is not None
    direct = partial._direct_fd
    assert direct != partial._data_fd
    assert [(c.fd, c.offset, c.length, c.error) for c in calls] == [
        (direct, i * C, C, None) for i in (2, 0, 3, 1)
    ]
    # Read back through the ordinary descriptor: the direct writes are visible to it.
    assert b"".join(partial.read_chunk(i) for i in range(4)) == data
    blob_id = partial.publish()
    assert partial._direct_fd is None
    assert open_fds() == fds_before  # both descriptors closed on publish
    assert_published(store, blob_id, data)


@needs_o_direct
def test_unaligned_buffers_and_a_short_last_chunk_use_the_ordinary_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_o_direct(tmp_path)
    data = os.urandom(3 * C + 100)  # last chunk: 100 bytes, not a block multiple
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    calls = record_pwrites(monkeypatch)
    with store.begin_partial(manifest) as partial:
        assert partial.write_chunk(0, aligned_copy(chunk_of(data, manifest, 0)))
        direct, plain = partial._direct_fd, partial._data_fd
        assert direct is not None
        calls.clear()
        # One byte off a page: O_DIRECT refuses it (EINVAL), the plain descriptor takes it.
        assert partial.write_chunk(1, misaligned_copy(chunk_of(data, manifest, 1)))
        assert [(c.fd, c.error) for c in calls] == [(direct, errno.EINVAL), (plain, None)]
        calls.clear()
        # A bytes object: whichever descriptor ends up taking it, the last write succeeded.
        assert partial.write_chunk(2, chunk_of(data, manifest, 2))
        assert calls[-1].error is None
        assert calls[-1].offset == 2 * C
        calls.clear()
        # The short last chunk is not a block multiple: straight to the plain descriptor,
        # even from an aligned buffer.
        assert partial.write_chunk(3, aligned_copy(chunk_of(data, manifest, 3)))
        assert [(c.fd, c.offset, c.length, c.error) for c in calls] == [(plain, 3 * C, 100, None)]
        blob_id = partial.publish()
    assert_published(store, blob_id, data)


@needs_o_direct
def test_a_block_multiple_last_chunk_is_written_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_o_direct(tmp_path)
    data = os.urandom(2 * C + 8192)  # the last chunk is short but block aligned
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    calls = record_pwrites(monkeypatch)
    with store.begin_partial(manifest) as partial:
        for i in range(3):
            assert partial.write_chunk(i, aligned_copy(chunk_of(data, manifest, i)))
        assert {c.fd for c in calls} == {partial._direct_fd}
        assert calls[-1].length == 8192
        blob_id = partial.publish()
    assert_published(store, blob_id, data)


def test_without_o_direct_support_every_write_uses_the_plain_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmpfs and friends: open_direct gives None once, and is not asked again."""
    opens: list[Path] = []

    def no_direct(path: Path) -> int | None:
        opens.append(path)
        return None

    monkeypatch.setattr(partial_mod, "open_direct", no_direct)
    calls = record_pwrites(monkeypatch)
    data = os.urandom(3 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    with store.begin_partial(manifest) as partial:
        for i in range(3):
            assert partial.write_chunk(i, aligned_copy(chunk_of(data, manifest, i)))
        assert partial._direct_fd is None
        assert len(opens) == 1
        assert {c.fd for c in calls} == {partial._data_fd}
        blob_id = partial.publish()
    assert_published(store, blob_id, data)


def test_einval_from_the_direct_descriptor_falls_back_and_other_errors_surface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the kernel: EINVAL from a direct write is retried on the plain descriptor;
    any other error is the store's typed error and marks nothing."""
    data = os.urandom(2 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    fake_direct = os.open(tmp_path / "decoy", os.O_WRONLY | os.O_CREAT, 0o644)
    monkeypatch.setattr(partial_mod, "open_direct", lambda path: fake_direct)
    real = partial_mod.pwrite_all
    direct_error = [errno.EINVAL]
    used: list[int] = []

    def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
        used.append(fd)
        if fd == fake_direct:
            raise OSError(direct_error[0], os.strerror(direct_error[0]))
        real(fd, view, offset)

    monkeypatch.setattr(partial_mod, "pwrite_all", pwrite_all)
    with store.begin_partial(manifest) as partial:
        assert partial.write_chunk(0, aligned_copy(chunk_of(data, manifest, 0)))
        assert used == [fake_direct, partial._data_fd]
        assert partial.read_chunk(0) == chunk_of(data, manifest, 0)
        direct_error[0] = errno.EIO
        with pytest.raises(StoreError):
            partial.write_chunk(1, aligned_copy(chunk_of(data, manifest, 1)))
        assert not partial.has_chunk(1)
        assert partial.verified_count == 1
        partial._direct_fd = None  # the decoy is closed below, not by the partial
    os.close(fake_direct)


# --- (b) several writer threads ------------------------------------------------------------


def test_many_threads_write_distinct_and_duplicate_chunks(tmp_path: Path) -> None:
    n = 48
    data = os.urandom(n * C - 1000)  # a short last chunk too
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    threads = 8
    # Every chunk once, round robin; chunks 0..15 a second time from another thread.
    plans: list[list[int]] = [list(range(t, n, threads)) for t in range(threads)]
    for i in range(16):
        plans[(i + 3) % threads].append(i)
    results: dict[int, list[bool]] = {i: [] for i in range(n)}
    results_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    with store.begin_partial(manifest) as partial:

        def writer(plan: list[int], aligned: bool) -> None:
            try:
                start.wait(timeout=10)
                for i in plan:
                    body = chunk_of(data, manifest, i)
                    added = partial.write_chunk(i, aligned_copy(body) if aligned else body)
                    with results_lock:
                        results[i].append(added)
            except BaseException as exc:
                errors.append(exc)

        workers = [
            threading.Thread(target=writer, args=(plan, t % 2 == 0)) for t, plan in enumerate(plans)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        assert not any(w.is_alive() for w in workers)
        assert errors == []
        assert {i: sum(r) for i, r in results.items()} == dict.fromkeys(range(n), 1)
        assert all(len(results[i]) == 2 for i in range(16))
        assert partial.verified_count == n
        assert partial.is_complete
        assert partial.bitmap == bm.full_bitmap(n)
        blob_id = partial.publish()
    assert_published(store, blob_id, data)


def test_two_writers_racing_on_one_chunk_count_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both writers pass the early "already held?" check before either sets the bit (held
    apart inside pwrite by a barrier): exactly one of them gets True, and it counts once."""
    data = os.urandom(2 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    both_writing = threading.Barrier(2)
    real = partial_mod.pwrite_all

    def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
        real(fd, view, offset)
        if offset == C:
            both_writing.wait(timeout=10)

    monkeypatch.setattr(partial_mod, "pwrite_all", pwrite_all)
    results: list[bool] = []
    errors: list[BaseException] = []
    body = chunk_of(data, manifest, 1)

    with store.begin_partial(manifest) as partial:

        def writer(buf: bytes | memoryview) -> None:
            try:
                results.append(partial.write_chunk(1, buf))
            except BaseException as exc:
                errors.append(exc)

        workers = [
            threading.Thread(target=writer, args=(body,)),
            threading.Thread(target=writer, args=(aligned_copy(body),)),
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=20)
        assert errors == []
        assert sorted(results) == [False, True]
        assert partial.verified_count == 1
        assert partial.missing() == [0]
        # A third write of the held chunk is refused before any I/O.
        assert partial.write_chunk(1, body) is False
        assert partial.read_chunk(1) == body


def test_writing_a_held_chunk_returns_false_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(2 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    with store.begin_partial(manifest) as partial:
        assert partial.write_chunk(0, chunk_of(data, manifest, 0)) is True
        calls = record_pwrites(monkeypatch)
        assert partial.write_chunk(0, chunk_of(data, manifest, 0)) is False
        assert calls == []
        assert partial.verified_count == 1


# --- (c) flush ordering ---------------------------------------------------------------------


def persisted(partial: PartialBlob) -> list[int]:
    n = partial.manifest.num_chunks
    bits = read_bitmap(partial._dir / "bitmap", n)
    assert bits is not None
    return list(bm.set_indices(bits, n))


def test_a_chunk_written_during_a_flush_fsync_waits_for_the_next_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(4 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    late = 2
    with store.begin_partial(manifest) as partial:
        assert partial.write_chunk(0, chunk_of(data, manifest, 0))
        real_fsync = os.fsync
        landed: list[bool] = []

        def fsync(fd: int) -> None:
            # A worker thread's write returns while the flush's data fsync is under way.
            if fd == partial._data_fd and not landed:
                body = aligned_copy(chunk_of(data, manifest, late))
                landed.append(partial.write_chunk(late, body))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        partial.flush()
        assert landed == [True]
        assert partial.has_chunk(late)
        assert persisted(partial) == [0]
        # Another process's view (the persisted bitmap) does not offer the late chunk yet.
        with Store.open(tmp_path / "s").open_reader(manifest.blob_id) as reader:
            assert reader.read(0) == chunk_of(data, manifest, 0)
            with pytest.raises(ChunkUnavailable):
                reader.read(late)
        partial.flush()  # the late write left the partial dirty: this flush names it
        assert persisted(partial) == [0, late]
        with Store.open(tmp_path / "s").open_reader(manifest.blob_id) as reader:
            assert reader.read(late) == chunk_of(data, manifest, late)


def test_a_failed_flush_leaves_the_chunks_for_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(2 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    with store.begin_partial(manifest) as partial:
        assert partial.write_chunk(1, chunk_of(data, manifest, 1))
        real_fsync = os.fsync
        fail = [True]

        def fsync(fd: int) -> None:
            if fail[0]:
                fail[0] = False
                raise OSError(errno.EIO, "injected I/O error")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(StoreError):
            partial.flush()
        assert partial_mod.load_bitmap(partial._dir / "bitmap", 2) == bm.empty_bitmap(2)
        partial.flush()
        assert persisted(partial) == [1]


def test_a_corrupt_chunk_raises_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(2 * C)
    manifest = Manifest.of_bytes(data, chunk_size=C)
    store = Store.open(tmp_path / "s")
    calls = record_pwrites(monkeypatch)
    bad = bytearray(chunk_of(data, manifest, 1))
    bad[C // 2] ^= 0xFF
    with store.begin_partial(manifest) as partial:
        with pytest.raises(CorruptChunk, match="chunk 1"):
            partial.write_chunk(1, aligned_copy(bytes(bad)))
        with pytest.raises(CorruptChunk, match="expected"):
            partial.write_chunk(1, aligned_copy(chunk_of(data, manifest, 1)[:-4096]))
        assert calls == []
        assert not partial.has_chunk(1)
        assert partial.verified_count == 0
        assert (partial._dir / "data").read_bytes() == bytes(2 * C)  # still all holes
        # The genuine chunk is still accepted afterwards.
        assert partial.write_chunk(1, aligned_copy(chunk_of(data, manifest, 1)))
        assert partial.read_chunk(1) == chunk_of(data, manifest, 1)
