"""A fetch stopped by a full disk finishes once space is freed.

The fetcher's store lives on a small tmpfs (mounted here, so the test needs root). The
disk fills while the fetch runs; the fetch stops (exit 5) with chunks written into its
partial that its bitmap may not name (writing the bitmap needs space too). Once the filler
is gone there is room for the rest of the blob but not for all of it again: a space
check that counted the whole blob less the verified chunks refused every retry, and only
``blob rm`` got out, losing what had arrived; and what had arrived is kept."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.p2p.conftest import Cluster, blob_cmd, last_json, random_file, run_blob, wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
SIZE = 16 * MiB
# Room for the blob and the store's own small files; less than the blob and what a
# stopped fetch already wrote.
DISK = SIZE + 2 * MiB
# The seeder's pace (MB/s): the fetch takes seconds, so the disk fills in the middle.
UPLOAD_LIMIT = "4"
# Written before the disk is filled: more than DISK - SIZE, so a check that ignored these
# blocks needs more than the freed disk holds.
WRITTEN_FIRST = 4 * MiB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _allocated(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _fill(disk: Path) -> Path:
    """Write a file until the disk is full."""
    filler = disk / "filler"
    block = b"\xff" * MiB
    with filler.open("wb") as out:
        try:
            while True:
                out.write(block)
                out.flush()
        except OSError:
            pass
    return filler


def test_fetch_stopped_by_a_full_disk_finishes_once_space_is_freed(
    cluster: Cluster, tmp_path: Path, small_disk: Path
) -> None:
    blob_id = cluster.put("seed", random_file(tmp_path / "ckpt.bin", SIZE, seed=5))
    seeder = cluster.serve("seed", "--upload-limit", UPLOAD_LIMIT)
    store = small_disk / "store"
    key = cluster.key("fetcher")
    key.parent.mkdir(parents=True, exist_ok=True)
    get = blob_cmd(store, key, "get", blob_id, "--peer", seeder.addr, "--json", "--no-upload")
    first = subprocess.Popen(get, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    data = store / "partial" / blob_id / "data"
    assert wait_until(lambda: _allocated(data) >= WRITTEN_FIRST, 60), "the fetch never began"
    filler = _fill(small_disk)
    _out, err = first.communicate(timeout=60)
    assert first.returncode == 5, err
    assert "space" in err, err

    filler.unlink()
    done = run_blob(store, key, "get", blob_id, "--peer", seeder.addr, "--json", check=False)
    assert done.returncode == 0, done.stderr
    assert run_blob(store, key, "verify", blob_id).returncode == 0
    # The chunks written before the disk filled were kept (hashed on reopen), not fetched
    # again, though the bitmap that should have named them could not be written.
    fetched = sum(p["bytes"] for p in last_json(done.stdout)["peers"].values())
    assert fetched <= SIZE - WRITTEN_FIRST // 2, f"fetched {fetched} of {SIZE} bytes again"
