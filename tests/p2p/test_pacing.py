"""An upload limit (`--upload-limit`; `--no-upload` switches upload off): the server's
token bucket keeps what it sends within rate x time + one burst, and a real node with a
limit takes at least as long to serve a blob as the limit says."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from blobstore import Store
from p2p.blob.pacing import MIN_BURST_BYTES, MIN_UPLOAD_LIMIT, Pacer
from p2p.node.node import NodeConfig, open_node

MiB = 1 << 20
MIB_HALF = MiB // 2


def _sent_by(pacer: Pacer, chunk: int, until: float) -> int:
    """Bytes a sender that always has a chunk ready sends by ``until`` (seconds)."""
    now, sent = 0.0, 0
    for _ in range(100_000):  # bounded
        now += pacer.delay(chunk, now)
        if now > until:
            return sent
        sent += chunk
    raise AssertionError("the pacer never made the sender wait")


def test_a_busy_sender_keeps_to_the_rate_plus_one_burst() -> None:
    rate = 4e6
    for chunk in (64 * 1024, MiB, 4 * MiB):
        pacer = Pacer(rate, 0.0)
        for seconds in (1.0, 5.0, 20.0):
            sent = _sent_by(Pacer(rate, 0.0), chunk, seconds)
            assert sent <= rate * seconds + pacer.burst + chunk
            assert sent >= rate * seconds - chunk  # and it does use the rate


def test_a_quiet_sender_saves_at_most_one_burst() -> None:
    pacer = Pacer(1e6, 0.0)
    assert pacer.delay(MIB_HALF, 1000.0) == 0.0  # a long pause: full credit, no more
    assert pacer.delay(int(pacer.burst), 1000.0) == 0.0  # the rest of the burst, now in debt
    assert pacer.delay(1, 1000.0) == pytest.approx(MIB_HALF / 1e6)


def test_a_limit_below_what_a_fetcher_waits_for_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        Pacer(MIN_UPLOAD_LIMIT - 1, 0.0)
    assert Pacer(MIN_UPLOAD_LIMIT, 0.0).burst == MIN_BURST_BYTES


@pytest.mark.timeout(90)
async def test_a_node_with_an_upload_limit_serves_no_faster_than_it(tmp_path: Path) -> None:
    limit = 2e6  # bytes/s
    size = 6 * MiB  # 3.1 s at the limit, less the 1 MiB burst and one chunk: over 2 s
    store = Store.open(tmp_path / "seeder")
    blob_id = store.put_bytes(bytes(range(256)) * (size // 256))
    config = NodeConfig(dht=False, upload_limit=limit)
    async with (
        open_node(store, config=config) as seeder,
        open_node(tmp_path / "fetcher", dht=False) as fetcher,
    ):
        started = trio.current_time()
        with trio.fail_after(60):
            await fetcher.fetch(blob_id, providers=seeder.addrs, announce=False)
        took = trio.current_time() - started
    assert fetcher.store.has(blob_id)
    # The bucket lets through rate x time + one burst + one chunk (p2p.blob.pacing's rule).
    assert took >= (size - MIN_BURST_BYTES - MiB) / limit - 0.2, f"{size} bytes in {took:.2f} s"
