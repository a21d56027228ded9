"""The named providers of a fetch are dialled at once and join the download as each dial
succeeds: those connected when the download starts go in as its providers, every later
one through ``feed_dialled``. A dial that ends between the two (trio runs the tasks of one
batch in any order), or while the feed hands on another, must still reach the download:
such a provider was never asked, and a fetch from two named providers ended "none of 1
peer(s) asked holds" although the other held the blob."""

from __future__ import annotations

import trio
import trio.lowlevel

from p2p.node.fetching import Dials, feed_dialled


async def _fed(dials: Dials, sent: int, later: list[str]) -> list[str]:
    send, receive = trio.open_memory_channel[str](8)
    got: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed_dialled, dials, send, sent)
            for peer in later:  # dials that end while the feed waits
                await trio.lowlevel.checkpoint()
                dials.add(peer)
                dials.pending -= 1
                dials.wake()
            async with receive:
                got.extend([peer async for peer in receive])
    return got


async def test_a_dial_that_ends_before_the_feed_starts_is_handed_on() -> None:
    dials = Dials()
    dials.add("A")
    dials.pending = 1
    providers = list(dials.peers)  # what the download starts with
    dials.add("B")  # B's dial ends in the same batch, before the feed's first step
    dials.pending = 0
    assert await _fed(dials, len(providers), []) == ["B"]


async def test_dials_that_end_later_are_handed_on_in_order() -> None:
    dials = Dials()
    dials.add("A")
    dials.pending = 2
    assert await _fed(dials, 1, ["B", "C"]) == ["B", "C"]
