"""Watching a provider beside its stream workers: what a partial provider (a fellow
fetcher) holds, refreshed while it fetches, and whether a seeder serves anyone else
(``p2p.blob.swarm`` rules 4 and 6; theory of operation 8 of ``p2p.fetch.downloader``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from p2p.blob import messages
from p2p.blob.shell import BlobClient, StreamLost, reset_quietly
from p2p.fetch.download_parts import (
    ALONE_ANSWERS,
    CONTROL_TIMEOUT,
    HAVE_REFRESH_INTERVAL,
    Changes,
    Network,
)
from p2p.fetch.download_probes import HaveProbes, open_status_client
from p2p.fetch.scheduler import Scheduler

log = logging.getLogger(__name__)


class ProviderWatch:
    """The control streams a download keeps to its providers, beyond their workers'
    ``get``s: a partial provider's holdings and a seeder's count of other fetchers, each
    told to the scheduler (and to ``changes``). ``probes``: where an early count probe's
    answer and stream wait to be taken."""

    def __init__(
        self,
        network: Network,
        blob_id: str,
        num_chunks: int,
        chunk_length: Callable[[int], int],
        scheduler: Scheduler,
        changes: Changes,
        probes: HaveProbes | None = None,
    ) -> None:
        self._network = network
        self._blob_id = blob_id
        self._num_chunks = num_chunks
        self._chunk_length = chunk_length
        self._scheduler = scheduler
        self._changes = changes
        self._probes = probes

    async def refresh_have(self, peer: str) -> None:
        """Ask a partial provider what it holds every HAVE_REFRESH_INTERVAL while it may
        gain chunks we lack, on a stream of its own: 1.3.0's ``status`` (what it holds and
        what it is fetching now, p2p.blob.swarm rule 4) where the peer speaks it, else ``have``.
        Stops at the first failure (the peer's workers notice a lost peer by themselves)."""
        client = await open_status_client(self._network, peer, self._chunk_length)
        status = client is not None
        try:
            if client is None:
                client = BlobClient(await self._network.open_blob_stream(peer), self._chunk_length)
            answered = False
            while not self._scheduler.done and self._scheduler.still_used(peer):
                if answered or not status:
                    await trio.sleep(HAVE_REFRESH_INTERVAL)
                soon = None
                have: messages.HaveResponse | messages.ErrorResponse
                with trio.fail_after(CONTROL_TIMEOUT):
                    if status:
                        try:
                            reply = await client.status(self._blob_id)
                        except StreamLost:
                            if answered:
                                raise
                            # A server before 1.3.0 refuses the proposal: ask `have`.
                            await reset_quietly(client.stream)
                            stream = await self._network.open_blob_stream(peer)
                            client = BlobClient(stream, self._chunk_length)
                            status = False
                            continue
                        if isinstance(reply, messages.StatusResponse):
                            soon = reply.soon
                            have = messages.HaveResponse(reply.num_chunks, reply.bitmap)
                        else:
                            have = reply
                    else:
                        have = await client.have(self._blob_id)
                answered = True
                if isinstance(have, messages.ErrorResponse):
                    return
                if have.num_chunks != self._num_chunks:
                    return
                if not self._scheduler.still_used(peer):
                    return
                full = all(have.bitmap[i // 8] >> (i % 8) & 1 for i in range(have.num_chunks))
                self._scheduler.update_peer_bitmap(peer, None if full else have.bitmap, soon)
                self._changes.notify()
                if full:
                    return
        except (StreamLost, messages.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("provider %s: have refresh ended: %r", peer, exc)
        finally:
            # Claims nobody refreshes are void: a fellow that went away (or stopped
            # answering) must not keep chunks from the seeder; what it held stays, and
            # its workers find out by asking for it.
            self._scheduler.drop_claims(peer)
            self._changes.notify()
            if client is not None:
                await reset_quietly(client.stream)

    async def watch_alone(self, peer: str) -> None:
        """Ask a seeder whether anyone else fetches the blob from it (1.4.0's ``status``,
        p2p.blob.swarm rule 6), at once and then every HAVE_REFRESH_INTERVAL while it says
        nobody: meanwhile the swarm's opening caps are off for it (Scheduler.set_alone),
        within a share of the blob until the ALONE_ANSWERS-th such answer.
        The first answer that counts anyone, a server before 1.4.0, or any failure puts
        them back for the rest of the download."""
        probe = None if self._probes is None else await self._probes.take_count(peer)
        reply = None if probe is None else probe.status
        client = None if probe is None else probe.client
        if client is None:
            client = await open_status_client(self._network, peer, self._chunk_length, fellows=True)
        if client is None:
            return
        zeros = 0
        try:
            while not self._scheduler.done and self._scheduler.still_used(peer):
                if reply is None:
                    with trio.fail_after(CONTROL_TIMEOUT):
                        reply = await client.status(self._blob_id)
                if not (isinstance(reply, messages.StatusResponse) and reply.fellows == 0):
                    self._scheduler.set_alone(peer, False)
                    self._changes.notify()
                    return
                zeros += 1
                if zeros <= ALONE_ANSWERS:
                    self._scheduler.set_alone(peer, True, once=zeros < ALONE_ANSWERS)
                    self._changes.notify()
                reply = None
                await trio.sleep(HAVE_REFRESH_INTERVAL)
        except (StreamLost, messages.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("provider %s: no fetcher count: %r", peer, exc)
            self._scheduler.set_alone(peer, False)
            self._changes.notify()
        finally:
            await reset_quietly(client.stream)
