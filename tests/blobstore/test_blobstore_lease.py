"""gc against running gets and puts: leases protect what an operation still needs.

Without leases, ``gc --grace 0`` in a loop during ``blob get COLL -o out`` deletes the
published parent and children and the get exits 3; under the default grace a fetch that
outlasts an hour meets the same fate. Here gc runs (from another Store object, so through
its own file descriptors, as another process would) between every step of a collection
fetch and of a ``put`` of a directory, and nothing the operation needs disappears.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from blobstore import Manifest, Store

C = 64 * 1024
REPO = Path(__file__).resolve().parents[2]


def make_model(tmp_path: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"layers": 2}',
        "model-00001.safetensors": os.urandom(3 * C + 5),
        "model-00002.safetensors": os.urandom(2 * C),
    }
    for name, content in files.items():
        (tmp_path / "model" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "model" / name).write_bytes(content)
    return files


def copy_blob(source: Store, dest: Store, blob_id: str) -> None:
    """What the downloader does: a partial filled chunk by chunk, then published."""
    manifest = Manifest.decode(source.manifest(blob_id).encode())
    with dest.begin_partial(manifest) as partial:
        for i in range(manifest.num_chunks):
            partial.write_chunk(i, source.read_chunk(blob_id, i))
        partial.publish()


def test_gc_spares_leased_blobs_whatever_the_grace(store: Store) -> None:
    kept = store.put_bytes(b"needed by a running get", chunk_size=C)
    loose = store.put_bytes(b"nobody needs this", chunk_size=C)
    with store.lease([kept]) as lease:
        assert store.gc(0) == [loose]
        assert lease.ids == {kept}
    assert store.gc(0) == [kept]


def test_a_leased_collection_protects_its_children(store: Store, tmp_path: Path) -> None:
    make_model(tmp_path)
    cid = store.put_dir(tmp_path / "model", chunk_size=C)
    with store.lease([cid]):
        assert store.gc(0) == []
    assert len(store.gc(0)) == 4


def test_collection_fetch_survives_gc_between_every_step(tmp_path: Path) -> None:
    files = make_model(tmp_path)
    source = Store.open(tmp_path / "source")
    cid = source.put_dir(tmp_path / "model", chunk_size=C)
    fetcher = Store.open(tmp_path / "fetcher")
    collector = Store.open(tmp_path / "fetcher")  # `blob gc --grace 0` in a loop
    out = tmp_path / "out"
    with fetcher.lease([cid]):  # what node.fetch holds for the whole get
        collector.gc(0)
        copy_blob(source, fetcher, cid)
        collector.gc(0)
        for entry in fetcher.read_collection(cid):
            copy_blob(source, fetcher, entry.blob_id)
            assert collector.gc(0) == []
        fetcher.export(cid, out)
    got = {p.name: p.read_bytes() for p in out.iterdir()}
    assert got == files


def test_put_of_a_directory_survives_gc_between_its_files(store: Store, tmp_path: Path) -> None:
    """The children are published before the collection that names them exists: a gc
    with no grace run while each later file is read (its progress) removes none."""
    make_model(tmp_path)
    collector = Store.open(store.root)
    removed: list[str] = []
    collections = 0

    def collect(done: int) -> None:
        nonlocal collections
        collections += 1
        removed.extend(collector.gc(0))

    cid = store.put_dir(tmp_path / "model", chunk_size=C, progress=collect)
    assert collections >= len(store.read_collection(cid))  # once per file at least
    assert removed == []
    assert all(store.has(e.blob_id) for e in store.read_collection(cid))


def test_put_with_a_lease_is_protected_until_tagged(store: Store) -> None:
    with store.lease() as lease:
        blob_id = store.put_bytes(b"tag me", chunk_size=C, lease=lease)
        assert store.gc(0) == []
        store.tag("keep", blob_id)
    assert store.gc(0) == []


def test_a_dead_holders_lease_is_swept(store: Store) -> None:
    """Liveness is the holder's flock: a process that died without releasing protects
    nothing, and its lease file goes."""
    blob_id = store.put_bytes(b"held by a process that crashes", chunk_size=C)
    holder = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "from blobstore import Store\n"
            "Store.open(sys.argv[1]).lease([sys.argv[2]])\n"
            "os._exit(0)\n",
            str(store.root),
            blob_id,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert holder.returncode == 0, holder.stderr
    leases = [p for p in (store.root / "locks").iterdir() if p.name.startswith("lease-")]
    assert len(leases) == 1  # left behind by the crash
    assert store.gc(0) == [blob_id]
    assert not leases[0].exists()


def test_an_export_survives_gc_between_its_files(tmp_path: Path) -> None:
    """``blob get COLL -o out`` ends by exporting; a gc run (another process, grace 0)
    while the first file is written must not delete the untagged collection's other
    children before they are written."""
    files = make_model(tmp_path)
    store = Store.open(tmp_path / "store")
    collection = store.put_dir(tmp_path / "model", chunk_size=C)  # untagged, unleased
    other = Store.open(tmp_path / "store")
    collected: list[str] = []

    def gc_meanwhile(done: int) -> None:
        if not collected:
            collected.extend(other.gc(0) or ["nothing"])

    store.export(collection, tmp_path / "out", progress=gc_meanwhile)
    assert collected == ["nothing"]
    for name, content in files.items():
        assert (tmp_path / "out" / name).read_bytes() == content
