"""A download's tally (p2p.fetch.download_tally), built alone over a real scheduler: bytes
counted per provider and as endgame duplicates, reports at most every PROGRESS_INTERVAL
unless forced, and rates from the bytes this run fetched (a resumed blob's verified
chunks are not this run's)."""

from __future__ import annotations

import pytest

from blobstore import Manifest
from p2p.fetch.download_parts import PROGRESS_INTERVAL, Progress
from p2p.fetch.download_tally import Tally
from p2p.fetch.scheduler import Scheduler

CHUNK = 64 * 1024
MANIFEST = Manifest.of_bytes(bytes(10 * CHUNK + 4), chunk_size=CHUNK)  # 11 chunks


def scheduler(verified: set[int] = frozenset()) -> Scheduler:  # type: ignore[assignment]
    return Scheduler(MANIFEST.num_chunks, lambda i: MANIFEST.chunk_span(i)[1], verified)


def verify(sched: Scheduler, peer: str, now: float) -> int:
    """Have ``peer`` deliver one chunk to ``sched``; its length."""
    ticket = sched.next_request(peer, now, max_chunks=1)
    assert ticket is not None
    (index,) = ticket.indices
    length = MANIFEST.chunk_span(index)[1]
    sched.on_chunk(ticket.request_id, index, length, now)
    sched.on_request_done(ticket.request_id, now, ticket.indices)
    return length


def test_reports_are_rate_limited_and_count_new_and_duplicate_bytes() -> None:
    sched = scheduler()
    sched.add_peer("a", 0.0)
    reports: list[Progress] = []
    tally = Tally(MANIFEST, sched, reports.append, now=10.0)
    tally.on_chunk("a", verify(sched, "a", 10.0), 10.0, duplicate=False)
    assert len(reports) == 1  # the first report goes out at once
    tally.on_chunk("a", verify(sched, "a", 10.1), 10.1, duplicate=False)
    tally.on_chunk("b", 500, 10.1, duplicate=True)
    assert len(reports) == 1  # within PROGRESS_INTERVAL of the last
    assert tally.new_bytes == {"a": 2 * CHUNK} and tally.duplicate_bytes == 500
    tally.report(10.0 + PROGRESS_INTERVAL)
    assert len(reports) == 2
    last = reports[-1]
    assert last.new_bytes == {"a": 2 * CHUNK} and last.duplicate_bytes == 500
    assert last.done_bytes == 2 * CHUNK and not last.finished
    assert last.rate_bytes_per_s == pytest.approx(2 * CHUNK / PROGRESS_INTERVAL)
    tally.report(10.0 + PROGRESS_INTERVAL + 0.01, force=True)
    assert len(reports) == 3


def test_a_resumed_blob_counts_only_this_runs_bytes_and_the_transfer_rate_waits_for_a_body() -> (
    None
):
    sched = scheduler(verified={0, 1, 2})
    sched.add_peer("a", 0.0)
    reports: list[Progress] = []
    tally = Tally(MANIFEST, sched, reports.append, now=0.0)
    tally.on_chunk("a", verify(sched, "a", 1.0), 1.0, duplicate=False)
    first = reports[-1]
    assert first.done_bytes == 4 * CHUNK  # three resumed, one fetched
    assert first.rate_bytes_per_s == pytest.approx(CHUNK / 1.0)
    assert first.transfer_rate_bytes_per_s == 0.0  # no body seen yet
    tally.note_first_body(0.5)
    tally.note_first_body(None)  # a stream that got no body changes nothing
    tally.note_first_body(0.75)  # a later first body does not move it
    tally.report(2.0, force=True)
    assert reports[-1].transfer_rate_bytes_per_s == pytest.approx(CHUNK / 1.5)


def test_without_a_callback_bytes_are_counted_and_nothing_is_reported() -> None:
    sched = scheduler()
    sched.add_peer("a", 0.0)
    tally = Tally(MANIFEST, sched, None, now=0.0)
    tally.on_chunk("a", verify(sched, "a", 1.0), 1.0, duplicate=False)
    tally.report(5.0, force=True)
    assert tally.new_bytes == {"a": CHUNK} and tally.done_bytes() == CHUNK
