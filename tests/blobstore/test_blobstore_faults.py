"""Injected I/O failures: the k-th write, fsync or rename fails, for every k.

libtorrent-style: each operation is run once to count its calls, then once per k with
the k-th call raising EIO. Every failure must surface as a typed StoreError and leave
the store consistent (no temp files, no orphan manifests, no blob under a wrong ID);
repeating the operation afterwards must succeed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from blobstore import Manifest, Store, StoreError

C = 64 * 1024
Check = Callable[[Path], None]

# The syscalls the store's write paths use, by kind of fault.
KINDS = {
    "write": ("write", "pwrite"),
    "fsync": ("fsync",),
    "rename": ("link", "replace", "rename"),
}


class Injector:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> None:
        self.calls = 0
        self.fail_at = 0  # 0 = never
        for name in names:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._wrap(real))

    def _wrap(self, real: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            self.calls += 1
            if self.calls == self.fail_at:
                raise OSError(errno.EIO, "injected I/O error")
            return real(*args, **kwargs)

        return wrapper

    @contextmanager
    def failing(self, k: int) -> Iterator[None]:
        self.calls, self.fail_at = 0, k
        try:
            yield
        finally:
            self.fail_at = 0


def count_calls(inj: Injector, op: Callable[[], object]) -> int:
    with inj.failing(0):
        op()
        return inj.calls


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_put_fault_at_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, check_consistent: Check
) -> None:
    data = os.urandom(3 * C + 11)
    expected = Manifest.of_bytes(data, C).blob_id
    inj = Injector(monkeypatch, KINDS[kind])
    probe = Store.open(tmp_path / "probe")
    n = count_calls(inj, lambda: probe.put_bytes(data, chunk_size=C))
    assert n >= 2
    for k in range(1, n + 1):
        root = tmp_path / f"s{k}"
        with inj.failing(0):
            store = Store.open(root)
        with inj.failing(k), pytest.raises(StoreError):
            store.put_bytes(data, chunk_size=C)
        check_consistent(root)
        assert store.put_bytes(data, chunk_size=C) == expected  # repeatable
        assert store.verify(expected) == []
        check_consistent(root)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_move_fault_keeps_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, check_consistent: Check
) -> None:
    data = os.urandom(2 * C)
    inj = Injector(monkeypatch, KINDS[kind])

    probe = Store.open(tmp_path / "probe")
    probe_src = tmp_path / "probe.src"
    probe_src.write_bytes(data)
    n = count_calls(inj, lambda: probe.put_path(probe_src, chunk_size=C, move=True))
    failures = 0
    for k in range(1, n + 1):
        root = tmp_path / f"s{k}"
        src = root.parent / f"{root.name}.src"
        store = Store.open(root)
        src.write_bytes(data)
        os.chmod(src, 0o640)
        with inj.failing(k):
            try:
                store.put_path(src, chunk_size=C, move=True)
            except StoreError:
                failures += 1
                # the source is intact, with its mode, unless the store already has it
                expected = Manifest.of_bytes(data, C).blob_id
                if not store.has(expected):
                    assert src.read_bytes() == data
                    assert src.stat().st_mode & 0o777 == 0o640
        check_consistent(root)
    assert failures >= 1


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_partial_fault_at_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, check_consistent: Check
) -> None:
    data = os.urandom(4 * C + 1)
    m = Manifest.of_bytes(data, C)
    parts = [data[o : o + n] for o, n in (m.chunk_span(i) for i in range(m.num_chunks))]
    inj = Injector(monkeypatch, KINDS[kind])

    def download(store: Store) -> None:
        with store.begin_partial(m) as p:
            for i in reversed(p.missing()):
                p.write_chunk(i, parts[i])
                if i % 2:
                    p.flush()
            p.publish()

    probe = Store.open(tmp_path / "probe")
    n = count_calls(inj, lambda: download(probe))
    assert n >= 2
    for k in range(1, n + 1):
        root = tmp_path / f"s{k}"
        store = Store.open(root)
        with inj.failing(k), pytest.raises(StoreError):
            download(store)
        check_consistent(root)
        if not store.has(m.blob_id):  # resume from whatever was kept, then finish
            download(store)
        assert store.verify(m.blob_id) == []
        assert store.partial_ids() == []
        check_consistent(root)


def test_tag_fault_leaves_old_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.open(tmp_path / "s")
    a = store.put_bytes(b"a", chunk_size=C)
    b = store.put_bytes(b"b", chunk_size=C)
    store.tag("t", a)
    inj = Injector(monkeypatch, ("replace", "fsync", "write"))
    for k in (1, 2, 3):
        with inj.failing(k), pytest.raises(StoreError):
            store.tag("t", b)
        assert store.tags() in ({"t": a}, {"t": b})
        assert os.listdir(store.root / "tmp") == []


def test_chunks_written_but_never_marked_are_kept(tmp_path: Path) -> None:
    """The disk filled after chunks were written but before the bitmap naming them could
    be (writing it needs space too): the partial reopened with none of them verified and
    fetched them all again. Chunks holding data are hashed on reopen and kept if they
    verify; one that does not is left to fetch."""
    data = os.urandom(8 * C)
    m = Manifest.of_bytes(data, C)
    store = Store.open(tmp_path / "s")
    with store.begin_partial(m) as p:
        for i in (1, 2, 5):
            p.write_chunk(i, data[i * C : (i + 1) * C])
    pdir = tmp_path / "s" / "partial" / m.blob_id
    (pdir / "bitmap").write_bytes(b"\x00")  # the bitmap as it was before any chunk came
    with open(pdir / "data", "r+b") as f:  # and chunk 5's bytes rotted meanwhile
        f.seek(5 * C + 7)
        f.write(b"\x00")
    with store.begin_partial(m) as p:
        assert p.missing() == [0, 3, 4, 5, 6, 7]
