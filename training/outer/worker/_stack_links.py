"""A worker's links to its run: announcements out, dials, pauses, and never going on alone
(points 1 and 6 of :mod:`training.outer.worker`).

1. An announcement is published when it is new or changed, then re-sent with back-off
   (``training.outer.announce.Announcer``) until dropped; a failed publish is only logged
   (the re-sends make up for it).
2. Every admitted peer heard of and not connected is dialled, with back-off
   (``PeerDialer``), at most ``MAX_CONCURRENT_DIALS`` at a time.
3. A pause (the event loop did not run for ``PAUSE_GAP``) makes every missing peer due
   at once and keeps live connections; only ``_redial`` (a state fetch that failed) drops
   them all.
4. Alone (trained with others, connected to none): the worker waits for a peer before it
   proposes or fetches a closure's blobs, and stops with an error after ``_alone_bound``.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from p2p.transport.meter import SAMPLE_INTERVAL
from training.outer.params import OuterNetError
from training.outer.worker._stack_blobs import WorkerBlobs
from training.outer.worker._stack_state import _say

# The dial loop looks for peers to dial this often (PeerDialer decides whom).
DIAL_TICK = 0.5
# Dials of one tick run at once, at most this many (a dead host's dial waits its timeout).
MAX_CONCURRENT_DIALS = 8
# An event loop that did not run for this long was stopped (SIGSTOP, a suspended laptop).
# A loaded 2-vCPU machine stalled a worker's loop for 5-6 s while torch was imported in a
# thread (the GIL); a false alarm only costs a redial. Stops shorter than this are caught
# by a fetch that fails (_catch_up redials then).
PAUSE_GAP = 7.0


class WorkerLinks(WorkerBlobs):
    """Announcements out, dials, pauses, never alone (see :mod:`training.outer.worker._stack_links`)."""

    async def _publish(self, data: bytes) -> None:
        self.pubsub_bytes[0] += len(data)
        try:
            await self.node.publish(self.topic, data)
        except Exception as exc:  # libp2p raises many types; announcements are re-sent
            _say(self.label, f"publish failed (will re-send): {exc!r}")

    async def _announce(self, name: str, data: bytes) -> None:
        if self.announcer.set(name, data, trio.current_time()):
            await self._publish(data)
            self.changed.set()

    async def _announce_loop(self) -> None:
        while True:
            with trio.move_on_at(self.announcer.next_due()):
                await trio.sleep_forever()
            for data in self.announcer.due(trio.current_time()):
                await self._publish(data)

    async def _meter_loop(self) -> None:
        """Sample the sockets' byte counts; after a pause, dial every peer not connected
        at once. Live connections are kept: dropping them all on waking lost the closure
        the others published meanwhile, and with the others finished the woken worker
        proposed a rival one alone (3 forks in 5 runs of bench/outer.py --churn 5). A
        connection that only looks alive is dropped when a fetch over it fails
        (_catch_up's _redial)."""
        last = trio.current_time()
        while True:
            self.meter.sample()
            await trio.sleep(SAMPLE_INTERVAL)
            now = trio.current_time()
            if now - last > PAUSE_GAP:
                _say(self.label, f"woke after {now - last:.0f}s without running")
                self.dialer.all_due(now)
            last = now

    async def _dial_loop(self) -> None:
        """Dial every admitted peer heard of and not connected (PeerDialer's back-off)."""
        limit = trio.Semaphore(MAX_CONCURRENT_DIALS)

        async def dial(peer: str, addrs: tuple[str, ...]) -> None:
            async with limit:
                ok = await self._dial(peer, addrs)
            if ok:
                self.dialer.succeeded(peer, trio.current_time())
            else:
                self.dialer.failed(peer, trio.current_time())

        while True:
            due = self.dialer.due(trio.current_time(), self.node.connected_peers())
            async with trio.open_nursery() as nursery:
                for peer, addrs in due:
                    if peer != self.peer:
                        nursery.start_soon(dial, peer, addrs)
            await trio.sleep(DIAL_TICK)

    async def _dial(self, peer: str, addrs: Sequence[str]) -> bool:
        from p2p.errors import P2PError

        # Node.connect lifts py-libp2p's 60 s negative dial cache; PeerDialer's back-off
        # governs these dials instead.
        for addr in addrs:
            try:
                await self.node.connect(addr)
                return True
            except P2PError:
                continue
        return False

    async def _redial(self) -> None:
        """Drop every connection; the dial loop makes new ones within a second. After this
        worker was paused (SIGSTOP, a laptop lid), connections its peers have long closed
        can linger here looking alive, so nobody answers its fetches and new dials to the
        same peers are refused; fresh connections fix that."""
        from libp2p.peer.id import ID

        for peer in self.node.connected_peers():
            with trio.move_on_after(5):
                try:
                    await self.node.host.disconnect(ID.from_base58(peer))
                except Exception as exc:  # libp2p raises many types; the dial loop retries
                    _say(self.label, f"disconnect {peer[-6:]} failed: {exc!r}")
        self.dialer.all_due(trio.current_time())
        _say(self.label, "dropped all connections to dial again")

    def _alone(self) -> bool:
        """Trained with others (applied an update of theirs) and connected to no admitted
        peer: a closure made now would agree with nobody (point 6)."""
        if not self.ever_admitted - {self.peer}:
            return False  # round 0, or nobody else's update applied: nobody to fork from
        peers = set(self.dialer.peers) - {self.peer}
        return not peers & set(self.node.connected_peers())

    async def _waited_for_peers(self, r: int, what: str = "not proposing alone") -> bool:
        """Point 6: before proposing for round ``r`` (or fetching a closure's blobs), wait
        while alone; False if there was no need. With nobody back within ``_alone_bound``
        it stops: every closure it made alone would be a fork of whatever the others
        agreed on, and a closure's blobs cannot come from nobody."""
        if not self._alone():
            return False
        _say(self.label, f"round {r}: no worker of the run connected; {what}")
        self.dialer.all_due(trio.current_time())  # the wait is for them: dial all now
        with trio.move_on_after(self._alone_bound()):
            # The dial loop connects; the node has no event for a new connection.
            while self._alone():  # noqa: ASYNC110
                await trio.sleep(DIAL_TICK)
            return True
        raise OuterNetError(
            f"round {r}: no worker of the run is reachable, so the run went on or ended "
            "without this worker (paused or cut off past the others' end); not closing "
            "rounds alone"
        )

    def _alone_bound(self) -> float:
        """How long a worker with no admitted peer connected waits for one (point 6): as
        long as a finished worker lingers for a missing final root."""
        return self._linger_bound()

    def _linger_bound(self) -> float:
        """How long a finished worker waits for the others' final roots (point 3)."""
        return self._fetch_bound()
