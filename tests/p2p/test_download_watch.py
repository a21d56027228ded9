"""A provider's control streams beside its workers (p2p.fetch.download_watch), built alone
over a real scheduler and in-memory streams with a real ServerConnection behind them
(virtual time): a partial provider's holdings reach the scheduler as it gains chunks, the
refresh ends once it holds them all, and one that speaks of another blob is left alone."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing
from fake_stream import FakeStream

from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.fetch.download_parts import HAVE_REFRESH_INTERVAL, Changes
from p2p.fetch.download_watch import ProviderWatch
from p2p.fetch.sched_records import bitmap_of
from p2p.fetch.scheduler import Scheduler

BLOB = "ab" * 32
N = 8


class Fellow:
    """A fellow fetcher's `have` answers, one per ask, on a stream of its own (no libp2p
    host here, so no `status`: the refresh asks `have`)."""

    def __init__(self, holdings: list[set[int]], num_chunks: int = N) -> None:
        self.holdings = holdings
        self.num_chunks = num_chunks
        self.asked: list[float] = []

    async def open_blob_stream(self, peer: str) -> Any:
        await trio.lowlevel.checkpoint()
        return FakeStream(self.serve)

    def serve(self, server: proto.ServerConnection, req: messages.Request) -> tuple[bytes, bool]:
        assert isinstance(req, messages.HaveRequest)
        self.asked.append(trio.current_time())
        bits = bitmap_of(self.holdings.pop(0), self.num_chunks)
        return server.send_response(messages.HaveResponse(self.num_chunks, bits)), False


def watch(network: Fellow, scheduler: Scheduler) -> ProviderWatch:
    return ProviderWatch(network, BLOB, N, lambda i: 1 << 16, scheduler, Changes())


def offered(scheduler: Scheduler) -> set[int]:
    ticket = scheduler.next_request("fellow", trio.current_time())
    return set() if ticket is None else set(ticket.indices)


async def test_a_partial_providers_new_chunks_reach_the_scheduler_until_it_holds_all(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler = Scheduler(N, lambda i: 1 << 16)
    scheduler.add_peer("fellow", 0.0, bitmap_of({0}, N))
    fellow = Fellow([{0, 1}, {0, 1, 2}, set(range(N))])
    start = trio.current_time()
    with trio.fail_after(10):
        await watch(fellow, scheduler).refresh_have("fellow")
    # Asked every HAVE_REFRESH_INTERVAL (its task asked `have` just now); the full answer
    # ends the refresh.
    assert fellow.asked == [start + k * HAVE_REFRESH_INTERVAL for k in (1, 2, 3)]
    assert offered(scheduler) == set(range(N))


async def test_a_provider_that_counts_other_chunks_is_left_to_its_workers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler = Scheduler(N, lambda i: 1 << 16)
    scheduler.add_peer("fellow", 0.0, bitmap_of({0}, N))
    fellow = Fellow([set(range(N + 1))], num_chunks=N + 1)
    with trio.fail_after(10):
        await watch(fellow, scheduler).refresh_have("fellow")
    assert len(fellow.asked) == 1
    assert offered(scheduler) == {0}  # what it claimed first, nothing of the odd answer
