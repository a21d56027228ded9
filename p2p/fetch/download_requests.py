"""A provider's stream workers: sending ``get`` requests, reading and verifying chunks,
writing them, and what a failed request costs the peer (theory of operation 4, 9, 10 of
``p2p.fetch.downloader``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial as bind

import blake3
import trio

from blobstore import (
    CorruptChunk,
    PartialBlob,
)
from p2p.blob import messages
from p2p.blob.buffers import ChunkBuffers
from p2p.blob.shell import BlobClient, ProtocolRefused, StreamLost, reset_quietly
from p2p.fetch.chunk_writer import ChunkWriter
from p2p.fetch.download_lanes import Lanes
from p2p.fetch.download_parts import (
    HASH_ON_ARRIVAL,
    BadChunk,
    BadDataAware,
    Changes,
    Network,
    ObsoleteRequest,
    PacedNetwork,
    StripedNetwork,
    _RequestWrites,
    idle_wait,
)
from p2p.fetch.download_tally import Tally
from p2p.fetch.sched_records import RequestTicket, SchedulerConfig
from p2p.fetch.scheduler import Scheduler
from p2p.fetch.scores import PeerScores

log = logging.getLogger(__name__)


class Requests:
    """The stream workers of one download: each sends a provider the requests the
    scheduler hands it, reads the chunks, verifies and writes them (``writer`` into
    ``partial``, bodies in ``buffers``), and tells the scheduler, ``tally`` and ``lanes``
    what came of them. ``scores``: where a provider that sent bad data is remembered
    beyond this download."""

    def __init__(
        self,
        network: Network,
        blob_id: str,
        chunk_length: Callable[[int], int],
        scheduler: Scheduler,
        config: SchedulerConfig,
        *,
        lanes: Lanes,
        changes: Changes,
        tally: Tally,
        buffers: ChunkBuffers,
        writer: ChunkWriter,
        partial: PartialBlob,
        scores: PeerScores | None = None,
    ) -> None:
        self._network = network
        self._striped = network if isinstance(network, StripedNetwork) else None
        self._pacer = network.download_pacer if isinstance(network, PacedNetwork) else None
        self._blob_id = blob_id
        self._chunk_length = chunk_length
        self._scheduler = scheduler
        on_arrival = config.hash_on_arrival
        self._hash_on_arrival = HASH_ON_ARRIVAL if on_arrival is None else on_arrival
        self._lanes = lanes
        self._changes = changes
        self._tally = tally
        self._buffers = buffers
        self._writer = writer
        self._partial = partial
        self._scores = scores
        # Chunks being hashed and written now, each with an event set when its write ends.
        self._writing: dict[int, trio.Event] = {}
        # Peers penalized in `scores` by this download (once each).
        self._penalized: set[str] = set()

    async def stream_worker(
        self,
        peer: str,
        client: BlobClient | None,
        lane: int,
        outstanding: list[RequestTicket] | None = None,
    ) -> None:
        """Send ``peer`` requests on a stream over connection ``lane`` and read the answers
        in order: one at a time, or on a striped provider's bulk lane ``Lanes.depth`` at
        once. ``outstanding``: requests already sent on ``client`` (oldest first)."""
        scheduler, lanes, changes = self._scheduler, self._lanes, self._changes
        pending = list(outstanding or [])  # sent, answers not yet read (oldest first)
        try:
            # Chunk writes run in this nursery, alongside the requests that received them.
            async with trio.open_nursery() as writers:
                while not scheduler.done and scheduler.still_used(peer):
                    if lane == 0 and not pending and lanes.striped_now(peer):
                        # Striped now: leave the control lane to control streams, for a
                        # bulk lane that lacks a worker (pipelined lanes want one each).
                        if client is not None:
                            await reset_quietly(client.stream)
                            client = None
                        moved = lanes.leave_control_lane(peer)
                        if moved is None:
                            return
                        lane = moved
                    depth = 1 if lane == 0 else lanes.depth(peer)
                    # While a far provider's lanes are being dialled, the control lane
                    # takes one chunk at a time: a full batch there would hold a share
                    # of the blob (the alone budget's, say) meant for all the lanes.
                    most = 1 if lane == 0 and lanes.lanes_coming(peer) else None
                    while len(pending) < depth:
                        ticket = scheduler.next_request(peer, trio.current_time(), max_chunks=most)
                        if ticket is None:
                            break
                        client, sent = await self._send_ticket(
                            peer, client, ticket, lane, bool(pending)
                        )
                        if not sent:
                            break
                        pending.append(ticket)
                    if not pending:
                        now = trio.current_time()
                        await changes.wait(idle_wait(scheduler.next_late_at(now), now))
                        continue
                    ticket = pending.pop(0)
                    assert client is not None  # a request is outstanding on it
                    client = await self._read_ticket(peer, client, ticket, writers)
                    if client is None and pending:
                        # The stream is gone with answers still owed on it: those requests
                        # were never answered, through no fault of the peer's beyond the
                        # one already counted.
                        self._cancel(pending)
        finally:
            self._cancel(pending)
            lanes.release(peer, lane)
            if client is not None:
                await reset_quietly(client.stream)

    def _cancel(self, tickets: list[RequestTicket]) -> None:
        now = trio.current_time()
        for ticket in tickets:
            self._scheduler.cancel(ticket.request_id, now)
        if tickets:
            tickets.clear()
            self._changes.notify()

    async def _send_ticket(
        self,
        peer: str,
        client: BlobClient | None,
        ticket: RequestTicket,
        lane: int,
        behind: bool,
    ) -> tuple[BlobClient | None, bool]:
        """Send one request (opening the stream first if there is none); the client and
        whether the request went out. A request that did not is reported: as a failure
        when it was the stream's only one, else cancelled (``behind``: requests are
        outstanding on the stream, and reading their answers will tell what happened to
        it), and the stream is dropped only in the first case."""
        try:
            with trio.fail_at(ticket.deadline):
                if client is None:
                    pipelined = lane > 0 and self._lanes.depth(peer) > 1
                    if lane and self._striped is not None:
                        stream = await self._striped.open_blob_stream_on(
                            peer, lane, pipelined=pipelined
                        )
                    else:
                        stream = await self._network.open_blob_stream(peer)
                    version = messages.Version.V1_1 if pipelined else messages.Version.V1_0
                    client = BlobClient(
                        stream, self._chunk_length, version=version, pipelined=pipelined
                    )
                await client.send_get(self._blob_id, ticket.ranges)
        except (StreamLost, trio.TooSlowError, OSError) as exc:
            self._changes.notify()
            if behind:
                self._scheduler.cancel(ticket.request_id, trio.current_time())
                return client, False
            log.info("request to %s failed: %r", peer, exc)
            self._scheduler.on_request_failed(ticket.request_id, trio.current_time(), repr(exc))
            await self._drop(client)
            return None, False
        return client, True

    async def _read_ticket(
        self,
        peer: str,
        client: BlobClient,
        ticket: RequestTicket,
        writers: trio.Nursery,
    ) -> BlobClient | None:
        """Read the answer to one request sent on ``client``; return the client to reuse,
        or None if its stream is gone."""
        now = trio.current_time
        writes = _RequestWrites()
        reply: tuple[int, ...] | messages.ErrorResponse | None = None
        failure: Exception | None = None
        try:
            with trio.fail_at(ticket.deadline):
                reply = await client.read_get(
                    bind(self._on_chunk, ticket, writes, writers), buffers=self._buffers
                )
        except (
            BadChunk,
            ObsoleteRequest,
            messages.RemoteProtocolError,
            StreamLost,
            trio.TooSlowError,
            OSError,
        ) as exc:
            failure = exc
        finally:
            self._tally.note_first_body(client.first_body_at)
        # The scheduler hears of the request only once each chunk it carried is verified
        # and written (or failed): it must not re-offer a chunk still being written.
        await writes.wait()
        if writes.error is not None:
            raise writes.error  # the store failed (disk full, I/O error): fatal
        if writes.bad_index is not None:
            failure = BadChunk(writes.bad_index)
        if isinstance(failure, BadChunk):
            log.warning("peer %s sent a corrupt chunk: banned for %s", peer, self._blob_id[:12])
            if isinstance(self._network, BadDataAware):
                self._network.bad_chunk(peer)
            self._scheduler.on_bad_chunk(ticket.request_id, failure.index, now())
            self._penalize(peer)
            self._changes.notify()
            await self._drop(client)
            return None
        if isinstance(failure, ObsoleteRequest):
            self._scheduler.cancel(ticket.request_id, now())
            self._changes.notify()
            await self._drop(client)
            return None
        if client.pipelined and (
            isinstance(failure, ProtocolRefused)
            or (isinstance(failure, StreamLost) and not client.negotiated)
        ):
            # An older server that does not speak 1.1.0: no pipelining with it (rule 10),
            # and this request goes out again, one at a time, at no cost to the peer. Its
            # `na` may not be read: the listener takes the request that follows it for
            # another proposal and resets the stream, and the reset can overtake it.
            log.info("provider %s does not pipeline: %s", peer, failure)
            self._lanes.refused_pipelining(peer)
            self._scheduler.cancel(ticket.request_id, now())
            self._changes.notify()
            await self._drop(client)
            return None
        if isinstance(failure, messages.RemoteProtocolError):
            log.warning("peer %s broke the protocol: %s", peer, failure)
            self._scheduler.on_protocol_error(ticket.request_id, now(), str(failure))
            self._penalize(peer)
            self._changes.notify()
            await self._drop(client)
            return None
        if failure is not None:
            log.info("request to %s failed: %r", peer, failure)
            self._scheduler.on_request_failed(ticket.request_id, now(), repr(failure))
            self._changes.notify()
            await self._drop(client)
            return None
        assert reply is not None
        if isinstance(reply, messages.ErrorResponse):
            if reply.code == messages.ErrorCode.BUSY:
                self._scheduler.on_request_busy(ticket.request_id, now())
                await trio.sleep(0.2)
            else:
                self._scheduler.on_request_done(ticket.request_id, now(), ticket.indices)
            self._changes.notify()
            await self._drop(client)
            return None
        self._scheduler.on_request_done(ticket.request_id, now(), reply)
        self._changes.notify()
        return client

    def _penalize(self, peer: str) -> None:
        """Remember beyond this download that ``peer`` sent bad data (once per download:
        one liar's many bad chunks are one offence)."""
        if self._scores is not None and peer not in self._penalized:
            self._penalized.add(peer)
            self._scores.penalize(peer, trio.current_time())

    async def _drop(self, client: BlobClient | None) -> None:
        if client is not None:
            await reset_quietly(client.stream)

    async def _on_chunk(
        self,
        ticket: RequestTicket,
        writes: _RequestWrites,
        writers: trio.Nursery,
        index: int,
        data: memoryview,
    ) -> None:
        """A chunk body arrived (in a pooled buffer): start its write and return, so the
        stream receives the next one meanwhile. Raising leaves the buffer to the caller."""
        if writes.bad_index is not None:
            raise BadChunk(writes.bad_index)  # this peer already sent a corrupt chunk
        if self._pacer is not None:
            await trio.sleep(self._pacer.delay(len(data), trio.current_time()))
        if not self._scheduler.expects(ticket.request_id, index):
            # The request was released meanwhile (its peer banned or dropped on another
            # stream); the protocol core already checked the index against the request.
            raise ObsoleteRequest
        digest = blake3.blake3(data).digest() if self._hash_on_arrival else None
        while (busy := self._writing.get(index)) is not None:
            await busy.wait()  # another stream's copy is being written (endgame)
        if self._partial.has_chunk(index):
            self._count_chunk(ticket, index, len(data), duplicate=True)
            if self._scheduler.is_obsolete(ticket.request_id):
                raise ObsoleteRequest  # an endgame loser: stop this stream
            self._buffers.release(data)
            return
        self._writing[index] = trio.Event()
        writes.start()
        writers.start_soon(self._write, ticket, writes, index, data, digest)

    async def _write(
        self,
        ticket: RequestTicket,
        writes: _RequestWrites,
        index: int,
        data: memoryview,
        digest: bytes | None,
    ) -> None:
        try:
            # Not abandoned on cancel: the thread owns the buffer until it returns.
            await self._writer.write(index, data, digest)
        except CorruptChunk:
            writes.bad_index = index
        except Exception as exc:  # the store failed; _run_ticket re-raises it
            writes.error = exc
        else:
            self._count_chunk(ticket, index, len(data), duplicate=False)
        finally:
            self._buffers.release(data)
            self._writing.pop(index).set()
            writes.finish()

    def _count_chunk(
        self, ticket: RequestTicket, index: int, length: int, *, duplicate: bool
    ) -> None:
        # Whoever wrote the chunk owns it: counting by the scheduler's answer instead
        # would let two racing streams both call it a duplicate.
        now = trio.current_time()
        peer = ticket.peer
        self._scheduler.on_chunk(ticket.request_id, index, length, now)
        self._tally.on_chunk(peer, length, now, duplicate=duplicate)
        if not duplicate:
            self._lanes.on_bytes(peer, length, now)
