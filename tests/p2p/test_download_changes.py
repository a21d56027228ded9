"""What a download's idle tasks wait on (p2p.fetch.download_parts.Changes, idle_wait):
a notify wakes every waiter at once, a wait without one ends at its bound, and an idle
worker sleeps until the next request turns late, IDLE_WAKE_S at most (virtual time)."""

from __future__ import annotations

import trio
import trio.testing

from p2p.fetch.download_parts import IDLE_WAKE_S, Changes, idle_wait


async def test_a_notify_wakes_every_waiter_and_a_quiet_wait_ends_at_its_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changes = Changes()
    woken: list[float] = []

    async def waiter() -> None:
        await changes.wait(10.0)
        woken.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1.0)
        changes.notify()
    assert woken == [start + 1.0, start + 1.0]
    await changes.wait(2.0)  # nothing new since: the bound ends it
    assert trio.current_time() == start + 3.0


def test_an_idle_worker_sleeps_until_the_next_late_request_at_most_idle_wake() -> None:
    assert idle_wait(None, 5.0) == IDLE_WAKE_S
    assert idle_wait(5.25, 5.0) == 0.25
    assert idle_wait(5.0 + 10 * IDLE_WAKE_S, 5.0) == IDLE_WAKE_S
