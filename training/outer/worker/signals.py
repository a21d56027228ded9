"""How a worker's parts tell the driver and the operator what happened.

1. :func:`say`: one line to stderr per event an operator follows (the tests grep these).
2. :class:`Changes`: any part sets it when something the driver acts on may have changed
   (an announcement heard or made, an update fetched, a verdict kept); the driver waits on
   it, with a deadline, and nothing else does.
3. :class:`Tasks`: the run's background tasks (replays, closure fetches, aggregates ahead
   of a closure) start in the run's nursery, once it is open; none is due before.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVarTuple, Unpack

import trio

_Args = TypeVarTuple("_Args")


def say(label: str, text: str) -> None:
    stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 10) % 10}"
    print(f"outer[{label}] {stamp} {text}", file=sys.stderr, flush=True)


def names(workers: Sequence[tuple[str, str]]) -> str:
    """Workers as a log names them: operator and short peer ID, from (peer, operator)."""
    return ", ".join(f"{operator} {peer[-6:]}" for peer, operator in workers)


class Changes:
    """The driver's wake-up (rule 2)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, deadline: float) -> None:
        """Until something changed since the last wait, or ``deadline``."""
        with trio.move_on_at(deadline):
            await self._event.wait()
        self._event = trio.Event()


class Tasks:
    """The run's background tasks (rule 3)."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None

    def open(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    @property
    def running(self) -> bool:
        """Whether tasks start (the run's nursery is open)."""
        return self._nursery is not None

    def start(self, fn: Callable[[Unpack[_Args]], Awaitable[object]], *args: *_Args) -> None:
        """Start ``fn(*args)`` in the run's nursery; nothing before it is open."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)
