"""The connections one local-API listener holds, sans-IO (the server does the reading).

Rules
1. Each listener (the Unix socket, the TCP port) has budgets of its own: nothing done on one
   takes the other's room, so tokenless TCP connections never crowd out the owner's
   requests on the socket.
2. A connection is *pending* from its accept until its request line is read (within the
   server's ``REQUEST_TIMEOUT``). At most ``max_pending`` are pending per listener; a
   newcomer beyond that ends the one pending longest. A client sends its line at once, so a
   flood of silent connections holds only the oldest places, and a new connection is always
   read.
3. A connection is a *client* once its request is decoded (on TCP, its token checked first):
   at most ``max_clients`` per listener; one more is answered ``busy``, and the command
   runs on its own node instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable


class ListenerSlots:
    """The pending connections and clients of one listener (the module's rules)."""

    def __init__(self, name: str, *, max_pending: int, max_clients: int) -> None:
        self.name = name
        self.max_pending = max_pending
        self.max_clients = max_clients
        self.clients = 0
        self.evicted = 0  # pending connections ended to make room (rule 2)
        self._pending: dict[int, Callable[[], None]] = {}  # oldest first
        self._keys = itertools.count()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def arrive(self, drop: Callable[[], None]) -> int:
        """A new connection, pending until ``read``; ``drop`` ends it if it must make room
        for a newer one. Returns its key."""
        while len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending))
            self._pending.pop(oldest)()
            self.evicted += 1
        key = next(self._keys)
        self._pending[key] = drop
        return key

    def read(self, key: int) -> None:
        """The connection ``key`` is no longer pending (its line arrived, or it ended)."""
        self._pending.pop(key, None)

    def take(self) -> bool:
        """Whether a decoded request may be served now (rule 3); if so it holds a place
        until ``leave``."""
        if self.clients >= self.max_clients:
            return False
        self.clients += 1
        return True

    def leave(self) -> None:
        self.clients -= 1
