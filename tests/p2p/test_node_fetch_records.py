"""What a node's fetches leave for its operator (p2p.node.fetching.FetchRecords), built
without a node: bad chunks by sender and admission refusals, each bounded; the transfers
in flight and the received-bytes counter, kept by the progress reports."""

from __future__ import annotations

import trio
import trio.testing

from p2p.fetch.download_parts import Progress
from p2p.metrics import Metrics
from p2p.node.admission import UNADMITTED
from p2p.node.fetching import MAX_BAD_PEERS, MAX_REFUSALS, FetchRecords, Tally


def received(metrics: Metrics) -> float:
    return (
        metrics.registry.get_sample_value("blobnet_bytes_received_total", {"protocol": "blob"})
        or 0.0
    )


def test_bad_chunks_are_counted_and_only_the_latest_senders_named() -> None:
    records = FetchRecords(Metrics())
    records.bad_chunk("liar")
    records.bad_chunk("liar")
    assert records.bad_chunks == {"liar": 2}
    for n in range(MAX_BAD_PEERS):
        records.bad_chunk(f"p{n}")
    assert len(records.bad_chunks) == MAX_BAD_PEERS
    assert "liar" not in records.bad_chunks  # the oldest sender went first
    assert records.bad_chunks_total == 2 + MAX_BAD_PEERS


async def test_only_admission_refusals_are_kept_one_line_per_peer_and_bounded() -> None:
    records = FetchRecords(Metrics())
    records.refused("busy", "busy: 64 streams")
    assert records.refusals == {}
    woke: list[str] = []

    async def wait() -> None:
        await records.next_refusal()
        woke.append("refused")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        records.refused("gate", f"{UNADMITTED}: show a certificate")
    assert woke == ["refused"]
    lines = records.refusal_lines(["/ip4/1.2.3.4/tcp/1/p2p/gate", "/ip4/1.2.3.4/tcp/2/p2p/other"])
    assert lines == [f"gate refused us: {UNADMITTED}: show a certificate"]
    for n in range(MAX_REFUSALS):
        records.refused(f"p{n}", f"{UNADMITTED}: no")
    assert len(records.refusals) == MAX_REFUSALS
    assert "gate" not in records.refusals


def test_progress_keeps_the_transfers_in_flight_and_counts_each_byte_once() -> None:
    metrics = Metrics()
    records = FetchRecords(metrics)
    tally = Tally()
    seen: list[Progress] = []
    on_progress = records.counted(seen.append, tally)
    blob = "ab" * 32
    on_progress(Progress(blob, 100, 40, 0.0, 1.0, new_bytes={"p": 40}))
    on_progress(Progress(blob, 100, 70, 0.0, 2.0, new_bytes={"p": 40, "q": 30}))
    assert records.transfers[blob].done_bytes == 70
    assert received(metrics) == 70
    on_progress(Progress(blob, 100, 100, 0.0, 3.0, new_bytes={"p": 70, "q": 30}, finished=True))
    assert blob not in records.transfers
    assert received(metrics) == 100
    assert [p.done_bytes for p in seen] == [40, 70, 100]  # the caller's callback, each time
    other = "cd" * 32
    on_progress(Progress(other, 100, 10, 0.0, 1.0, new_bytes={"p": 10}))
    records.ended(tally, "cancelled", 1.0)  # a fetch that ends takes its transfers along
    assert records.transfers == {}
    assert metrics.ended == {"cancelled": 1}
