"""The store's layout (blobstore.layout.Layout), built without a Store."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from blobstore.layout import SHARED_MODES, Layout

ID_A = "a" * 64
ID_B = "ab" + "c" * 62


def test_make_dirs_gives_exact_modes_whatever_the_umask(tmp_path: Path) -> None:
    """Shared: the blob directories are 0755, but tmp/ and locks/ stay 0700."""
    layout = Layout(tmp_path / "s")
    layout.root.mkdir()
    old = os.umask(0o077)
    try:
        layout.make_dirs(SHARED_MODES)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in layout.root.iterdir()}
    assert modes == {
        "blobs": 0o755,
        "partial": 0o755,
        "tags": 0o755,
        "quarantine": 0o755,
        "tmp": 0o700,
        "locks": 0o700,
    }


def test_listings_name_only_blob_ids_that_still_have_a_manifest(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "s")
    layout.root.mkdir()
    layout.make_dirs(SHARED_MODES)
    for name, manifest in ((ID_A, True), (ID_B, False), ("not-an-id", True)):
        (layout.partial / name).mkdir()
        if manifest:
            (layout.partial / name / "manifest").write_bytes(b"m")
    shard = layout.blobs / ID_B[:2]
    shard.mkdir()
    (shard / ID_B).write_bytes(b"data")
    (shard / (ID_B + ".manifest")).write_bytes(b"m")
    (shard / "stray").write_bytes(b"?")
    assert layout.partial_ids() == [ID_A]
    assert layout.quarantined_ids() == []
    assert layout.complete_ids() == [ID_B]
    assert layout.has(ID_B) and not layout.has(ID_A)
    assert layout.has_partial(ID_A) and not layout.has_partial(ID_B)
