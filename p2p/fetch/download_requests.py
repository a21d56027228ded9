"""A provider's stream workers: sending ``get`` requests, reading and verifying chunks,
writing them, and what a failed request costs the peer (theory of operation 4, 9, 10)."""

from __future__ import annotations

import logging
from functools import partial as bind

import blake3
import trio

from blobstore import (
    CorruptChunk,
)
from p2p.blob import messages
from p2p.blob.shell import BlobClient, ProtocolRefused, StreamLost, reset_quietly
from p2p.fetch.download_parts import (
    HASH_ON_ARRIVAL,
    PIPELINE_DEPTH,
    BadChunk,
    BadDataAware,
    ObsoleteRequest,
    _RequestWrites,
)
from p2p.fetch.download_state import DownloadState
from p2p.fetch.scheduler import (
    RequestTicket,
)

log = logging.getLogger(__name__)


class DownloadRequests(DownloadState):
    """A provider's stream workers and the chunks they bring; the state lives on
    :class:`~p2p.fetch.downloader.Download`."""

    def _set_connections(self, peer: str) -> None:
        count = 1 if self.striped is None else self.striped.connection_count(peer)
        lanes = self.lane_load.setdefault(peer, [0])
        lanes.extend([0] * (count - len(lanes)))
        # Once striped, lane 0 is the control lane (rule 9): no bulk there.
        self.scheduler.set_connections(peer, count if count == 1 else count - 1, self._depth(peer))

    def _depth(self, peer: str) -> int:
        """Requests a stream worker keeps outstanding on its stream to ``peer`` (rule 10)."""
        lanes = self.lane_load.get(peer)
        if self.striped is None or lanes is None or len(lanes) <= 1 or peer in self.serial:
            return 1
        return PIPELINE_DEPTH

    @staticmethod
    def _quiet_lane(lanes: list[int]) -> int:
        """The bulk connection with the fewest workers' streams (the lowest on a tie),
        taken: lane 0 only while it is the only one."""
        first = 1 if len(lanes) > 1 else 0
        lane = min(range(first, len(lanes)), key=lambda i: (lanes[i], i))
        lanes[lane] += 1
        return lane

    def _peer_usable(self, peer: str) -> bool:
        return self.scheduler.still_used(peer)

    async def _stream_worker(
        self,
        peer: str,
        client: BlobClient | None,
        lane: int,
        outstanding: list[RequestTicket] | None = None,
    ) -> None:
        """Send ``peer`` requests on a stream over connection ``lane`` and read the answers
        in order: one at a time, or on a striped provider's bulk lane `_depth` at once.
        ``outstanding``: requests already sent on ``client`` (oldest first)."""
        pending = list(outstanding or [])  # sent, answers not yet read (oldest first)
        try:
            # Chunk writes run in this nursery, alongside the requests that received them.
            async with trio.open_nursery() as writers:
                while not self.scheduler.done and self._peer_usable(peer):
                    lanes = self.lane_load.get(peer)
                    if lane == 0 and lanes is not None and len(lanes) > 1 and not pending:
                        # Striped now: leave the control lane to control streams, for a
                        # bulk lane that lacks a worker (pipelined lanes want one each).
                        if client is not None:
                            await reset_quietly(client.stream)
                            client = None
                        if self._depth(peer) > 1 and min(lanes[1:]) > 0:
                            return
                        lanes[0] -= 1
                        lane = self._quiet_lane(lanes)
                    depth = 1 if lane == 0 else self._depth(peer)
                    # While a far provider's lanes are being dialled, the control lane
                    # takes one chunk at a time: a full batch there would hold a share
                    # of the blob (the alone budget's, say) meant for all the lanes.
                    most = 1 if lane == 0 and self._lanes_coming(peer) else None
                    while len(pending) < depth:
                        ticket = self.scheduler.next_request(
                            peer, trio.current_time(), max_chunks=most
                        )
                        if ticket is None:
                            break
                        client, sent = await self._send_ticket(
                            peer, client, ticket, lane, bool(pending)
                        )
                        if not sent:
                            break
                        pending.append(ticket)
                    if not pending:
                        await self._wait_change(self._idle_wait())
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
            lanes = self.lane_load.get(peer)
            if lanes is not None:
                lanes[lane] -= 1
            if client is not None:
                await reset_quietly(client.stream)

    def _lanes_coming(self, peer: str) -> bool:
        """Extra connections to ``peer`` are being dialled and none is up yet."""
        lanes = self.lane_load.get(peer)
        planned = 0 if self.probes is None else self.probes.planned_lanes(peer)
        return planned > 0 and (lanes is None or len(lanes) == 1)

    def _cancel(self, tickets: list[RequestTicket]) -> None:
        now = trio.current_time()
        for ticket in tickets:
            self.scheduler.cancel(ticket.request_id, now)
        if tickets:
            tickets.clear()
            self._notify()

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
                    pipelined = lane > 0 and self._depth(peer) > 1
                    if lane and self.striped is not None:
                        stream = await self.striped.open_blob_stream_on(
                            peer, lane, pipelined=pipelined
                        )
                    else:
                        stream = await self.network.open_blob_stream(peer)
                    version = messages.Version.V1_1 if pipelined else messages.Version.V1_0
                    client = BlobClient(
                        stream, self.chunk_length, version=version, pipelined=pipelined
                    )
                await client.send_get(self.blob_id, ticket.ranges)
        except (StreamLost, trio.TooSlowError, OSError) as exc:
            self._notify()
            if behind:
                self.scheduler.cancel(ticket.request_id, trio.current_time())
                return client, False
            log.info("request to %s failed: %r", peer, exc)
            self.scheduler.on_request_failed(ticket.request_id, trio.current_time(), repr(exc))
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
                    bind(self._on_chunk, ticket, writes, writers), buffers=self.buffers
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
            self._note_first_body(client)
        # The scheduler hears of the request only once each chunk it carried is verified
        # and written (or failed): it must not re-offer a chunk still being written.
        await writes.wait()
        if writes.error is not None:
            raise writes.error  # the store failed (disk full, I/O error): fatal
        if writes.bad_index is not None:
            failure = BadChunk(writes.bad_index)
        if isinstance(failure, BadChunk):
            log.warning("peer %s sent a corrupt chunk: banned for %s", peer, self.blob_id[:12])
            if isinstance(self.network, BadDataAware):
                self.network.bad_chunk(peer)
            self.scheduler.on_bad_chunk(ticket.request_id, failure.index, now())
            self._penalize(peer)
            self._notify()
            await self._drop(client)
            return None
        if isinstance(failure, ObsoleteRequest):
            self.scheduler.cancel(ticket.request_id, now())
            self._notify()
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
            self.serial.add(peer)
            self._set_connections(peer)
            self.scheduler.cancel(ticket.request_id, now())
            self._notify()
            await self._drop(client)
            return None
        if isinstance(failure, messages.RemoteProtocolError):
            log.warning("peer %s broke the protocol: %s", peer, failure)
            self.scheduler.on_protocol_error(ticket.request_id, now(), str(failure))
            self._penalize(peer)
            self._notify()
            await self._drop(client)
            return None
        if failure is not None:
            log.info("request to %s failed: %r", peer, failure)
            self.scheduler.on_request_failed(ticket.request_id, now(), repr(failure))
            self._notify()
            await self._drop(client)
            return None
        assert reply is not None
        if isinstance(reply, messages.ErrorResponse):
            if reply.code == messages.ErrorCode.BUSY:
                self.scheduler.on_request_busy(ticket.request_id, now())
                await trio.sleep(0.2)
            else:
                self.scheduler.on_request_done(ticket.request_id, now(), ticket.indices)
            self._notify()
            await self._drop(client)
            return None
        self.scheduler.on_request_done(ticket.request_id, now(), reply)
        self._notify()
        return client

    def _penalize(self, peer: str) -> None:
        """Remember beyond this download that ``peer`` sent bad data (once per download:
        one liar's many bad chunks are one offence)."""
        if self.scores is not None and peer not in self.penalized:
            self.penalized.add(peer)
            self.scores.penalize(peer, trio.current_time())

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
        if self.pacer is not None:
            await trio.sleep(self.pacer.delay(len(data), trio.current_time()))
        if not self.scheduler.expects(ticket.request_id, index):
            # The request was released meanwhile (its peer banned or dropped on another
            # stream); the protocol core already checked the index against the request.
            raise ObsoleteRequest
        on_arrival = self.config.hash_on_arrival
        hash_here = HASH_ON_ARRIVAL if on_arrival is None else on_arrival
        digest = blake3.blake3(data).digest() if hash_here else None
        while (busy := self.writing.get(index)) is not None:
            await busy.wait()  # another stream's copy is being written (endgame)
        if self.partial.has_chunk(index):
            self._count_chunk(ticket, index, len(data), duplicate=True)
            if self.scheduler.is_obsolete(ticket.request_id):
                raise ObsoleteRequest  # an endgame loser: stop this stream
            self.buffers.release(data)
            return
        self.writing[index] = trio.Event()
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
            await self.writer.write(index, data, digest)
        except CorruptChunk:
            writes.bad_index = index
        except Exception as exc:  # the store failed; _run_ticket re-raises it
            writes.error = exc
        else:
            self._count_chunk(ticket, index, len(data), duplicate=False)
        finally:
            self.buffers.release(data)
            self.writing.pop(index).set()
            writes.finish()

    def _note_first_body(self, client: BlobClient) -> None:
        at = client.first_body_at
        if at is not None and (self.first_body_at is None or at < self.first_body_at):
            self.first_body_at = at

    def _count_chunk(
        self, ticket: RequestTicket, index: int, length: int, *, duplicate: bool
    ) -> None:
        # Whoever wrote the chunk owns it: counting by the scheduler's answer instead
        # would let two racing streams both call it a duplicate.
        self.scheduler.on_chunk(ticket.request_id, index, length, trio.current_time())
        if duplicate:
            self.duplicate_bytes += length
            return
        self.new_bytes[ticket.peer] = self.new_bytes.get(ticket.peer, 0) + length
        growth = self.growth.get(ticket.peer)
        if growth is not None:
            growth.on_bytes(length, trio.current_time())
        self._report()
