"""`blob serve` and `blob get` as real processes on the emulated three-continent WAN with
0.1% loss: providers in eu and us, a fetcher in asia. A fetch from both arrives
byte-identical through the loss; a provider killed mid-fetch on the 200 ms path leaves
the fetch to finish from the other. The two share one testbed and its providers (the
kill comes last: it takes eu away)."""

from __future__ import annotations

import filecmp
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.wan import THREE_CONTINENTS, Testbed, unavailable_reason
from bench.wan.blobnodes import BlobNode, Served, put_all, serve_all, write_random_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(110)]

MiB = 1 << 20
SIZE = 16 * MiB  # enough that a kill after the first chunk lands mid-fetch at 200 ms
FETCH_TIMEOUT = 90.0
# With this seed the loss draws 218, 245 and 443 of the run fall under 0.1%: a run of
# thousands of packets is sure to lose some (the test checks it did).
LOSSY_SEED = 5


@dataclass
class Continents:
    tb: Testbed
    work: Path
    data: Path
    blob_id: str
    eu: Served
    us: Served


@pytest.fixture(scope="module")
def continents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Continents]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("continents")
    data = work / "blob.bin"
    write_random_file(data, SIZE, seed=SIZE)
    providers = [BlobNode(work / h, h) for h in ("eu", "us")]
    blob_id = put_all(providers, data)
    with Testbed(THREE_CONTINENTS, loss=0.001, seed=LOSSY_SEED) as tb:
        eu, us = serve_all(tb, providers)
        yield Continents(tb, work, data, blob_id, eu, us)


def test_three_host_fetch_through_loss_arrives_byte_identical(continents: Continents) -> None:
    c = continents
    asia = BlobNode(c.work / "asia-lossy", "asia")
    out = c.work / "lossy.bin"
    got = asia.start_get(c.tb, c.blob_id, [c.eu.addr, c.us.addr], "-o", str(out))
    result = got.wait(FETCH_TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sum(h["lost"] for h in c.tb.stats()["hosts"].values()) > 0  # it did lose packets
    assert filecmp.cmp(out, c.data, shallow=False)


def test_a_provider_killed_mid_fetch_leaves_the_fetch_to_the_other(
    continents: Continents,
) -> None:
    c = continents
    asia = BlobNode(c.work / "asia-kill", "asia")
    out = c.work / "kill.bin"
    getting = asia.start_get(c.tb, c.blob_id, [c.eu.addr, c.us.addr], "-o", str(out))
    deadline = time.monotonic() + FETCH_TIMEOUT
    while getting.first_chunk is None and getting.proc.poll() is None:
        assert time.monotonic() < deadline, "no chunk arrived"
        time.sleep(0.01)
    assert getting.proc.poll() is None, "the fetch ended before the kill"
    c.eu.proc.kill()  # the 200 ms provider dies mid-fetch
    got = getting.wait(FETCH_TIMEOUT)
    assert got.returncode == 0, got.stderr[-2000:]
    assert filecmp.cmp(out, c.data, shallow=False)
    delivered = {peer: s["bytes"] for peer, s in got.report["peers"].items()}
    assert delivered.get(c.us.peer_id, 0) > 0
    assert delivered.get(c.eu.peer_id, 0) < SIZE
