"""The order of durable steps, checked call by call.

A crash test cannot see a missing fsync on a machine that does not lose power: the fault
tests pass with the data fsync before the bitmap write deleted. Here every
write, fsync and rename the store makes is recorded with the inode it touched, and the
rules of :mod:`blobstore.partial` and :mod:`blobstore.store` are checked on the trace:

* a bitmap is replaced only after every chunk written before it was fsynced (rule 2);
* a blob is linked into ``blobs/`` only after its bytes were fsynced (invariant 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from blobstore import Manifest, Store

C = 64 * 1024


@dataclass
class Trace:
    events: list[tuple[str, int, str]] = field(default_factory=list)  # (op, inode, name)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("write", "pwrite", "pwritev", "fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._on_fd(name, getattr(os, name)))
        for name in ("replace", "link", "rename"):
            monkeypatch.setattr(os, name, self._on_path(name, getattr(os, name)))

    def _on_fd(self, op: str, real: Callable[..., object]) -> Callable[..., object]:
        def wrapper(fd: int, *args: object, **kwargs: object) -> object:
            self.events.append((op, os.fstat(fd).st_ino, ""))
            return real(fd, *args, **kwargs)

        return wrapper

    def _on_path(self, op: str, real: Callable[..., object]) -> Callable[..., object]:
        def wrapper(src: object, dst: object, *args: object, **kwargs: object) -> object:
            ino = os.stat(src).st_ino  # type: ignore[arg-type]
            self.events.append((op, ino, str(dst)))
            return real(src, dst, *args, **kwargs)

        return wrapper

    def unsynced_before(self, index: int, ino: int) -> bool:
        """Whether inode ``ino`` had a write not followed by an fsync before ``index``."""
        dirty = False
        for op, i, _ in self.events[:index]:
            if i != ino:
                continue
            if op in ("write", "pwrite", "pwritev"):
                dirty = True
            elif op in ("fsync", "fdatasync"):
                dirty = False
        return dirty


def test_bitmap_is_replaced_only_after_the_data_is_fsynced(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(5 * C)
    m = Manifest.of_bytes(data, C)
    trace = Trace()
    trace.install(monkeypatch)
    with store.begin_partial(m) as partial:
        data_ino = os.stat(store.root / "partial" / m.blob_id / "data").st_ino
        for i in (0, 3):
            partial.write_chunk(i, data[i * C : (i + 1) * C])
        partial.flush()
        partial.write_chunk(1, data[C : 2 * C])
    monkeypatch.undo()
    bitmaps = [n for n, (op, _, dst) in enumerate(trace.events) if dst.endswith("/bitmap")]
    assert len(bitmaps) >= 2  # the explicit flush and the one on close
    wrote = [n for n, (op, ino, _) in enumerate(trace.events) if ino == data_ino and "write" in op]
    assert wrote, "the trace did not see the chunk writes"
    for n in bitmaps:
        assert not trace.unsynced_before(n, data_ino), (
            f"bitmap replaced at step {n} while chunk data written earlier was not fsynced"
        )
    with store.begin_partial(m) as partial:  # and what the bitmap claims is really there
        assert partial.missing() == [2, 4]


@pytest.mark.parametrize("how", ["put", "partial"])
def test_a_blob_is_linked_into_blobs_only_after_its_bytes_are_fsynced(
    store: Store, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    data = os.urandom(3 * C + 1)
    m = Manifest.of_bytes(data, C)
    trace = Trace()
    trace.install(monkeypatch)
    if how == "put":
        store.put_bytes(data, chunk_size=C)
    else:
        with store.begin_partial(m) as partial:
            for i in range(m.num_chunks):
                partial.write_chunk(i, data[i * C : min((i + 1) * C, len(data))])
            partial.publish()
    monkeypatch.undo()
    target = str(store.root / "blobs" / m.blob_id[:2] / m.blob_id)
    links = [(n, ino) for n, (op, ino, dst) in enumerate(trace.events) if dst == target]
    assert len(links) == 1
    n, ino = links[0]
    assert any(i == ino and "write" in op for op, i, _ in trace.events[:n])
    assert not trace.unsynced_before(n, ino), "blob published before its bytes were fsynced"
