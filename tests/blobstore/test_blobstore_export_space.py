"""An export checks free space where it writes, and a refused one leaves nothing there
(blobstore.exporting rules 1 and 5).

Each test mounts small tmpfs file systems of its own (root needed; skipped, saying so,
without) and unmounts them after.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from blobstore import Store
from blobstore.errors import NoSpace
from tests.blob_cli import blob_here

MiB = 1 << 20

Mount = Callable[[str, int], Path]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Mount]:
    """``small_fs(name, mib)``: a tmpfs of that size mounted at ``tmp_path / name``."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mounted: list[Path] = []

    def mount(name: str, mib: int) -> Path:
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in reversed(mounted):
            subprocess.run(["umount", str(where)], check=True, timeout=30)


def _put(store: Store, tmp_path: Path, name: str, size: int) -> str:
    source = tmp_path / name
    source.write_bytes(os.urandom(size))
    blob_id = store.put_path(source)
    source.unlink()
    return blob_id


def test_an_export_needs_room_where_it_writes_not_in_the_store(
    small_fs: Mount, tmp_path: Path
) -> None:
    """A store on a small file system holding a 6 MiB blob (2 MiB free there): an export
    to a roomy disk was refused, "need 6291456 bytes, 2084864 available under STORE"."""
    store = Store.open(small_fs("store-fs", 8) / "store")
    blob_id = _put(store, tmp_path, "big.bin", 6 * MiB)
    assert store.free_bytes() < 6 * MiB
    out = tmp_path / "out.bin"
    store.export(blob_id, out)
    assert out.read_bytes() == store.path(blob_id).read_bytes()


def test_an_export_that_does_not_fit_is_refused_before_writing_and_leaves_nothing(
    small_fs: Mount, tmp_path: Path
) -> None:
    """A target on a full file system passed the (store's) check and failed while writing:
    it is refused before a byte is written, naming the target's directory, and nothing is
    left there: a file, a collection whose files each fit but not all together, and a
    subset of a collection (`blob export --copy --include`)."""
    store = Store.open(tmp_path / "store")
    one = _put(store, tmp_path, "one.bin", 6 * MiB)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (model / name).write_bytes(os.urandom(3 * MiB))
    collection = store.put_dir(model)
    target = small_fs("target-fs", 4)

    for blob_id, dest in ((one, target / "out.bin"), (collection, target / "model")):
        with pytest.raises(NoSpace, match=f"available under {target}") as refused:
            store.export(blob_id, dest)
        assert refused.value.needed == 6 * MiB  # the whole export, checked before writing
        assert list(target.iterdir()) == []

    from blobstore.export import export_files, select_entries

    with pytest.raises(NoSpace, match=f"available under {target}"):
        export_files(store, select_entries(store, collection, []), target / "m", link=False)
    assert list(target.iterdir()) == []


def test_get_o_onto_a_full_file_system_is_one_line_and_leaves_nothing(
    small_fs: Mount, tmp_path: Path
) -> None:
    """The user's view: `blob get ID -o FULL/out` exits 5 with one line naming where."""
    store_root, key = tmp_path / "store", tmp_path / "k.key"
    blob_id = _put(Store.open(store_root), tmp_path, "w.bin", 6 * MiB)
    target = small_fs("target-fs", 4)
    argv = ["--store", str(store_root), "--key", str(key), "get", blob_id]
    done = blob_here([*argv, "-o", str(target / "out.bin")], code=5)
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert f"available under {target}" in done.stderr
    assert list(target.iterdir()) == []
