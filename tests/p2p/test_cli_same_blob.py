"""Two ``blob get`` of one blob into one store, as every local rank or job fetching the
same checkpoint does: the second waits for the first (saying so) and returns the blob,
and takes over from the partial if the first dies; it does not exit 5 within a second,
"being written by process N", whatever BLOBNET_LOCK_TIMEOUT says. And a fetch whose only
provider dies says that it went."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.p2p.conftest import Cluster, blob_cmd, last_json, random_file, wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
SIZE = 8 * MiB
# The seeder's pace (MB/s): the first fetch takes about 8 s, so the second starts
# while it runs.
UPLOAD_LIMIT = "1"


def _start_get(cluster: Cluster, blob_id: str, peer: str) -> subprocess.Popen[str]:
    cmd = blob_cmd(
        cluster.store("job"), cluster.key("job"), "get", blob_id, "--peer", peer, "--json"
    )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _writing(cluster: Cluster, blob_id: str) -> bool:
    lock = cluster.store("job") / "partial" / blob_id / "lock"
    return lock.exists() and lock.read_text().strip().isdigit()


@pytest.fixture
def seeded(cluster: Cluster, tmp_path: Path) -> tuple[str, str]:
    blob_id = cluster.put("seed", random_file(tmp_path / "ckpt.bin", SIZE, seed=3))
    seeder = cluster.serve("seed", "--upload-limit", UPLOAD_LIMIT)
    return blob_id, seeder.addr


def test_second_get_of_a_blob_waits_for_the_first(
    cluster: Cluster, seeded: tuple[str, str]
) -> None:
    blob_id, peer = seeded
    first = _start_get(cluster, blob_id, peer)
    assert wait_until(lambda: _writing(cluster, blob_id), 60), "the first get never began"
    second = _start_get(cluster, blob_id, peer)
    out2, err2 = second.communicate(timeout=90)
    out1, err1 = first.communicate(timeout=90)
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert last_json(out1)["id"] == last_json(out2)["id"] == blob_id
    assert "waiting for process" in err2


def test_second_get_takes_over_when_the_first_dies(
    cluster: Cluster, seeded: tuple[str, str]
) -> None:
    blob_id, peer = seeded
    first = _start_get(cluster, blob_id, peer)
    assert wait_until(lambda: _writing(cluster, blob_id), 60), "the first get never began"
    second = _start_get(cluster, blob_id, peer)
    assert second.stderr is not None
    said = second.stderr.readline()  # the wait's first line
    assert "waiting for process" in said, said
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    out2, err2 = second.communicate(timeout=90)
    assert second.returncode == 0, said + err2
    assert last_json(out2)["id"] == blob_id


def test_a_provider_that_dies_mid_fetch_is_named_as_gone(
    cluster: Cluster, seeded: tuple[str, str]
) -> None:
    """A provider killed mid-fetch ended in "79 of 128 chunks could not be fetched from
    1 peer(s)", which read like missing data: the error says the peer went, and that what
    arrived is kept."""
    blob_id, peer = seeded
    cmd = blob_cmd(
        cluster.store("job"), cluster.key("job"), "get", blob_id, "--peer", peer,
        "--discovery-timeout", "1",
    )  # fmt: skip
    get = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    data = cluster.store("job") / "partial" / blob_id / "data"
    assert wait_until(lambda: data.exists() and data.stat().st_blocks > 0, 60)
    cluster.nodes[0].kill()
    _out, err = get.communicate(timeout=60)
    assert get.returncode == 6, err
    assert "disconnected or stopped answering" in err and "resume" in err, err
