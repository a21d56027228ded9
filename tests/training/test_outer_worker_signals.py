"""What a worker's parts share (training.outer.worker.signals, signing, faults), built
alone: the driver's wake-up, the run's task starter, one signature at a time, and the
faults a test injects."""

from __future__ import annotations

import threading
import time

import trio
import trio.testing

from tests.training.worker_parts import machine
from training.outer.worker.faults import NO_FAULTS, Faults
from training.outer.worker.signals import Changes, Tasks
from training.outer.worker.signing import Signing


async def test_the_driver_wakes_on_a_change_or_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changes = Changes()
    changes.set()  # a change before the wait is not lost
    await changes.wait(trio.current_time() + 10.0)
    assert trio.current_time() == 0.0
    await changes.wait(trio.current_time() + 10.0)  # nothing since: the deadline
    assert trio.current_time() == 10.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 1.0)
        nursery.start_soon(lambda: _set_after(changes, 3.0))
        await changes.wait(trio.current_time() + 10.0)
    assert trio.current_time() == 13.0


async def _set_after(changes: Changes, delay: float) -> None:
    await trio.sleep(delay)
    changes.set()


async def test_tasks_start_only_once_the_runs_nursery_is_open() -> None:
    tasks = Tasks()
    ran: list[int] = []

    async def task(i: int) -> None:
        ran.append(i)

    tasks.start(task, 1)
    assert not tasks.running
    async with trio.open_nursery() as nursery:
        tasks.open(nursery)
        assert tasks.running
        tasks.start(task, 2)
    assert ran == [2]


async def test_one_signature_at_a_time() -> None:
    """A TPM serves one session at a time: signatures run in threads, never two at once."""
    me = machine()
    signing = Signing(me.signer, me.cert)
    busy = threading.Lock()
    overlapped: list[bool] = []

    def sign() -> bytes:
        overlapped.append(not busy.acquire(blocking=False))
        time.sleep(0.05)
        busy.release()
        return b"signed"

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(signing.sign, sign)
    assert overlapped == [False] * 4


def test_faults_stall_and_cheat_only_where_asked() -> None:
    assert not NO_FAULTS.stalls(0) and not NO_FAULTS.cheats(5) and NO_FAULTS.proposes
    cheat = Faults(cheat_from_round=2)
    assert [cheat.cheats(r) for r in range(4)] == [False, False, True, True]
    assert not cheat.proposes  # a test cheater never proposes
    assert Faults(stall_round=3).stalls(3) and not Faults(stall_round=3).stalls(2)
