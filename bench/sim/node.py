"""A simulated node: the chunks it holds, and its server, deciding by the real serving rules.

What is the project's own code here, and what the shell does by hand:

- Real: the stream and send-buffer budgets with their reserve for light peers and the
  eviction of idle streams (``p2p.blob.server.ServingBudgets``, rules 2 and 9), the swarm
  book that answers `peers` and counts fellows (``p2p.blob.swarm.SwarmBook``, `listing`,
  ``FELLOW_WINDOW``), the upload limit (``p2p.blob.pacing.Pacer``) and the chunks in flight
  that `status` calls soon (the node's own downloads' ``Scheduler.in_flight``).
- By hand (the I/O of ``p2p.blob.server.BlobServer``): one request at a time per stream, in
  order (rule 1); a `get` holds a chunk-sized send buffer while it is answered (rule 2) and
  sends the chunks it holds, in order, then ``End`` with the ones it lacks; a `try_get`
  while others fetch the blob is declined (1.5.0); a gate answers `not_found` to peers not
  admitted; a busy stream gets `busy` (the stream budget: once, then closed; the send
  budget: the stream stays). An idle stream is evictable while it waits for its next
  request; one idle for ``IDLE_TIMEOUT`` is closed. Disk reads, hashing on read and
  quarantine are not simulated (a liar's chunks are simply wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench.sim.fluid import Host, Transfer, call_later
from p2p.blob.server import (
    HEADER_ROOM,
    ServerLimits,
    ServingBudgets,
    StreamSlot,
)
from p2p.blob.swarm import FELLOW_WINDOW, SwarmBook, listing
from p2p.fetch.sched_records import bitmap_of

if TYPE_CHECKING:
    from bench.sim.fetch import SimFetch
    from bench.sim.world import World

# A status or have answer's frame beyond its bitmaps, a manifest's beyond its hashes, a
# request's size: small messages, latency only (the network model's rule 5).
SMALL = 64


@dataclass(frozen=True)
class Blob:
    """A blob as the simulation needs it: an ID, its size and chunking."""

    blob_id: str
    size: int
    chunk: int

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.size // self.chunk))

    def length(self, i: int) -> int:
        return min(self.chunk, self.size - i * self.chunk)

    @property
    def manifest_bytes(self) -> int:
        return 32 * self.num_chunks + SMALL


@dataclass
class ServerStream:
    """The server's side of one stream: its slot, the requests queued on it, the one being
    answered."""

    client: Any  # bench.sim.fetch.Stream: where answers go
    slot: StreamSlot
    queue: list[Any] = field(default_factory=list)
    serving: Transfer | None = None
    serving_any: bool = False
    send_held: int = 0  # send-buffer bytes held for the `get` being answered
    idle_since: float = 0.0
    idle_timer: bool = False
    closed: bool = False
    refused: str | None = None  # the stream budget refused it: one busy answer, then closed


class SimNode:
    """One node: a host, what it holds of each blob, its server and its downloads."""

    def __init__(
        self,
        world: World,
        name: str,
        host: Host,
        *,
        liar: bool = False,
        limits: ServerLimits | None = None,
        upload_limit: float | None = None,
        admitted: Callable[[str], bool] | None = None,
    ) -> None:
        self.world = world
        self.name = name
        self.host = host
        self.liar = liar  # sends chunks that fail their hash
        self.limits = limits or ServerLimits()
        self.budgets = ServingBudgets(self.limits)
        self.swarm = SwarmBook()
        if upload_limit is not None:
            # An upload limit (p2p.blob.pacing) caps what the node sends: as a lower uplink.
            host.up.cap = min(host.up.cap, upload_limit)
        self.admitted = admitted
        self.holds: dict[str, bytearray] = {}
        self.held: dict[str, int] = {}
        self.fetches: dict[str, SimFetch] = {}
        self.asked: dict[str, float] = {}  # blob -> when a request about it last came
        self.connected: set[str] = set()
        self.lanes: dict[str, int] = {}  # extra connections this node dialled to each peer
        self.streams: dict[int, ServerStream] = {}
        self.client_streams: set[Any] = set()  # other nodes' streams to this one
        self.busy_answers = 0
        self.evictions = 0
        self.declined = 0
        self.left_at: float | None = None
        world.nodes[name] = self

    # --- what it holds --------------------------------------------------------------------

    def seed(self, blob: Blob) -> None:
        n = blob.num_chunks
        self.holds[blob.blob_id] = bytearray(bitmap_of(range(n), n))
        self.held[blob.blob_id] = n

    def has(self, blob: Blob, i: int) -> bool:
        bm = self.holds.get(blob.blob_id)
        return bm is not None and bool(bm[i >> 3] >> (i & 7) & 1)

    def add_chunk(self, blob: Blob, i: int) -> None:
        bm = self.holds.setdefault(blob.blob_id, bytearray((blob.num_chunks + 7) // 8))
        if not bm[i >> 3] >> (i & 7) & 1:
            bm[i >> 3] |= 1 << (i & 7)
            self.held[blob.blob_id] = self.held.get(blob.blob_id, 0) + 1

    def complete(self, blob: Blob) -> bool:
        return self.held.get(blob.blob_id, 0) == blob.num_chunks

    @property
    def alive(self) -> bool:
        return self.host.alive

    def leave(self) -> None:
        """The node goes away: its transfers stop, its connections close."""
        if not self.host.alive:
            return
        self.left_at = self.world.now
        self.world.net.kill(self.host)
        for fetch in list(self.fetches.values()):
            fetch.stop("left")
        for other in list(self.connected):
            peer = self.world.nodes[other]
            peer.connected.discard(self.name)
            peer.lost_peer(self.name)
        self.connected.clear()
        for ss in list(self.streams.values()):
            self._close(ss)
        # Streams of others to this node: their connection is reset (heard a one-way
        # delay later).
        for stream in list(self.client_streams):
            owner = stream.fetch.node
            if owner.alive:
                delay = self.world.net.owd(self.host, owner.host)
                call_later(self.world.env, delay, stream.closed_by_server)
        self.client_streams.clear()

    def lost_peer(self, name: str) -> None:
        """``name`` left: its streams here close."""
        for ss in list(self.streams.values()):
            if ss.slot.peer == name:
                self._close(ss)

    # --- the server -----------------------------------------------------------------------

    def open_stream(self, client: Any) -> ServerStream:
        """A stream from ``client.fetch.node`` opens (its first request is on the way)."""
        peer = client.owner
        slot = StreamSlot(peer, peer)  # one address per node
        ss = ServerStream(client, slot)
        reason = self.budgets.admit(peer, peer, self._evict)
        if reason is not None:
            slot.held = False
            ss.refused = reason
        self.streams[id(client)] = ss
        self._waiting(ss)
        return ss

    def _waiting(self, ss: ServerStream) -> None:
        """``ss`` waits for its next request: evictable, and closed if idle too long."""
        if ss.refused is None and not ss.closed:
            self.budgets.idle.wait(ss.slot, self.world.now, lambda: self._close(ss, tell=True))
            ss.idle_since = self.world.now
            if not ss.idle_timer:
                ss.idle_timer = True
                call_later(self.world.env, self.limits.idle_timeout, self._idle_check, ss)

    def _idle_check(self, ss: ServerStream) -> None:
        ss.idle_timer = False
        if ss.closed or ss.serving_any:
            return
        idle = self.world.now - ss.idle_since
        if idle >= self.limits.idle_timeout - 1e-9:
            self._close(ss, tell=True)
        else:
            ss.idle_timer = True
            call_later(self.world.env, self.limits.idle_timeout - idle, self._idle_check, ss)

    def _evict(self, victim: Any) -> None:
        self.evictions += 1
        victim.evict()

    def _release(self, ss: ServerStream) -> None:
        if ss.slot.held:
            ss.slot.held = False
            self.budgets.streams.release(ss.slot.peer, ss.slot.ip, 1)

    def _close(self, ss: ServerStream, *, tell: bool = False) -> None:
        """End a stream here (``tell``: the client hears it was closed)."""
        if ss.closed:
            return
        ss.closed = True
        self.budgets.idle.working(ss.slot)
        self._release(ss)
        if ss.serving is not None:
            self.world.net.cancel(ss.serving)
            ss.serving = None
        if ss.send_held:
            self.budgets.send_bytes.release(ss.slot.peer, ss.slot.ip, ss.send_held)
            ss.send_held = 0
        self.streams.pop(id(ss.client), None)
        if tell and self.alive:
            client = ss.client
            self.world.net.message(self.host, client.fetch.node.host, client.closed_by_server)

    def client_closed(self, client: Any) -> None:
        """The client reset or closed its stream."""
        ss = self.streams.get(id(client))
        if ss is not None:
            self._close(ss)

    def request(self, client: Any, req: Any) -> None:
        """A request arrives on ``client``'s stream (opened at the first one)."""
        if not self.alive:
            return
        ss = self.streams.get(id(client))
        if ss is None:
            ss = self.open_stream(client)
        if ss.closed:
            return
        ss.queue.append(req)
        if not ss.serving_any:
            self._next(ss)

    def _next(self, ss: ServerStream) -> None:
        if ss.closed or not ss.queue:
            ss.serving_any = False
            self._waiting(ss)
            return
        req = ss.queue.pop(0)
        ss.serving_any = True
        self.budgets.idle.working(ss.slot)
        if ss.refused is not None:
            self.busy_answers += 1
            self._answer(ss, req, "busy", ss.refused)
            self._close(ss)
            return
        now = self.world.now
        peer = ss.slot.peer
        blob: Blob = req.blob
        if self.admitted is not None and not self.admitted(peer):
            self._answer(ss, req, "not_found")
            self._done_answering(ss)
            return
        self.swarm.seen(blob.blob_id, peer, now)
        if req.kind not in ("peers", "manifest"):
            self.asked[blob.blob_id] = now
        held = self.holds.get(blob.blob_id)
        if held is None:
            self._answer(ss, req, "not_found")
            self._done_answering(ss)
            return
        if req.kind == "manifest":
            self._answer(ss, req, "manifest")
        elif req.kind in ("have", "status"):
            soon = None
            if req.kind == "status":
                soon = self._soon(blob)
            fellows = self.fellows(blob, peer) if req.fellows else None
            self._answer(ss, req, req.kind, bytes(held), soon, fellows)
        elif req.kind == "peers":
            listed = listing(self.swarm, blob.blob_id, peer, now, lambda p: (f"/ip4/{p}/tcp/1",))
            self._answer(ss, req, "peers", listed)
        elif req.tentative and self.fellows(blob, peer):
            self.declined += 1
            self._answer(ss, req, "end", ())
        else:
            self._get(ss, req, blob, held)
            return
        self._done_answering(ss)

    def _done_answering(self, ss: ServerStream) -> None:
        # The next request on the stream is read once this answer is out (rule 1).
        if ss.queue:
            call_later(self.world.env, 0.0, self._next, ss)
        else:
            ss.serving_any = False
            self._waiting(ss)

    def _answer(self, ss: ServerStream, req: Any, kind: str, *args: Any) -> None:
        client = ss.client
        self.world.net.message(
            self.host, client.fetch.node.host, client.answer, req, kind, *args, lane=client.lane
        )

    def _soon(self, blob: Blob) -> bytes | None:
        fetch = self.fetches.get(blob.blob_id)
        if fetch is None or fetch.scheduler is None:
            return None
        n = blob.num_chunks
        held = self.holds[blob.blob_id]
        bits = int.from_bytes(bitmap_of(fetch.scheduler.in_flight(), n), "little")
        bits &= ~int.from_bytes(held, "little")
        return bits.to_bytes((n + 7) // 8, "little")

    def fellows(self, blob: Blob, peer: str) -> int:
        return self.swarm.fellows(
            blob.blob_id, self.world.now, peer, FELLOW_WINDOW, lambda p: p in self.connected
        )

    def _get(self, ss: ServerStream, req: Any, blob: Blob, held: bytearray) -> None:
        peer = ss.slot.peer
        size = HEADER_ROOM + min(blob.chunk, blob.size)
        refused = self.budgets.send_bytes.acquire(
            peer, peer, size, heavy=self.budgets.streams.heaviness(peer, peer)
        )
        if refused is not None:
            self.busy_answers += 1
            self._answer(ss, req, "busy", refused)
            self._done_answering(ss)
            return
        ss.send_held = size
        indices = req.indices
        sending = [i for i in indices if held[i >> 3] >> (i & 7) & 1]
        missing = tuple(i for i in indices if not held[i >> 3] >> (i & 7) & 1)
        sizes = [blob.length(i) for i in sending]
        client = ss.client
        pipe = self.world.net.pipe(self.host, client.fetch.node.host, client.lane)

        def chunk(j: int) -> None:
            client.chunk(req, sending[j], sizes[j], self.liar)

        def sent() -> None:
            if ss.send_held:
                self.budgets.send_bytes.release(peer, peer, ss.send_held)
                ss.send_held = 0
            ss.serving = None
            self._next(ss)

        def end() -> None:
            client.answer(req, "end", missing)

        ss.serving = self.world.net.send(pipe, sizes, chunk, end, sent)
        if not sizes:
            ss.serving = None
