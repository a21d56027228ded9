"""Manifests and probes: asking providers for a blob's manifest (with the first chunk
riding along) and for what they hold (``HaveProbes``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import blake3
import trio
from libp2p.peer.id import ID

from blobstore import (
    Manifest,
)
from p2p.blob import messages
from p2p.blob.shell import BlobClient, ProtocolRefused, StreamLost, open_optimistic, reset_quietly
from p2p.fetch.download_parts import (
    CONTROL_TIMEOUT,
    MAX_REASON_CHARS,
    NO_ANSWER,
    SPECULATIVE_ANSWER_BYTES,
    SPECULATIVE_CHUNK,
    Network,
    RefusalAware,
    StripedNetwork,
    _Unanswered,
    path_rtt,
)
from p2p.fetch.striping import StripeConfig

log = logging.getLogger(__name__)


async def fetch_manifest(
    network: Network,
    blob_id: str,
    peer: str,
    unanswered: dict[str, str] | None = None,
    *,
    probes: HaveProbes | None = None,
) -> Manifest | None:
    """Ask one peer for the manifest; None if it has none or it does not match the ID.
    A peer that did not answer (timeout, lost stream, busy) is added to ``unanswered``,
    with what happened (``no_answer``, or the server's own busy reason).
    With ``probes``, the first peer a fetch asks is asked for the first chunk too, on the
    same stream (`_ask_speculating`); the stream goes to ``probes`` for that peer's task."""
    client = None
    try:
        if probes is not None and probes.may_speculate():
            try:
                reply, client = await _ask_speculating(network, blob_id, peer, probes.tentative)
            except ProtocolRefused as exc:
                # A server before 1.1.0 (or, for a `try_get`, before 1.5.0; whether it
                # pipelines, its bulk streams find out): ask the plain way.
                log.info("provider %s refused the first request's version: %s", peer, exc)
                if not probes.tentative:
                    probes.serial.add(peer)
                reply = await _ask_manifest(network, blob_id, peer)
        else:
            reply = await _ask_manifest(network, blob_id, peer)
        if isinstance(reply, messages.ErrorResponse) and isinstance(network, RefusalAware):
            network.refused(peer, reply.message)
        manifest = _checked_manifest(blob_id, peer, reply, unanswered)
        if client is not None and manifest is not None and manifest.num_chunks > 0:
            assert probes is not None
            probes.offer(peer, client)
            client = None
        return manifest
    except messages.ProtocolError as exc:
        log.info("manifest from %s failed: %r", peer, exc)
        return None
    finally:
        if client is not None:
            await reset_quietly(client.stream)


def _checked_manifest(
    blob_id: str,
    peer: str,
    reply: bytes | messages.ErrorResponse | _Unanswered,
    unanswered: dict[str, str] | None,
) -> Manifest | None:
    if isinstance(reply, _Unanswered):
        if unanswered is not None:
            unanswered[peer] = reply.why
        return None
    if isinstance(reply, messages.ErrorResponse) and reply.code == messages.ErrorCode.BUSY:
        if unanswered is not None:
            unanswered[peer] = f"was busy: {reply.message}"
        return None
    if isinstance(reply, messages.ErrorResponse):
        return None
    if blake3.blake3(reply).hexdigest() != blob_id:
        log.warning("peer %s sent a manifest that does not match %s", peer, blob_id)
        return None
    try:
        return Manifest.decode(reply)
    except Exception as exc:  # BadManifest: the ID matched, so the manifest is malformed
        log.warning("peer %s sent a malformed manifest: %s", peer, exc)
        return None


def _unanswered(exc: Exception) -> _Unanswered:
    """What a manifest request that ended in ``exc`` (a timeout or a transport error) says
    in a fetch's error."""
    if isinstance(exc, trio.TooSlowError):
        return _Unanswered(NO_ANSWER)
    said = f"{exc}"[:MAX_REASON_CHARS] or type(exc).__name__
    if isinstance(exc, StreamLost):
        return _Unanswered(f"closed or reset the stream unanswered ({said})")
    return _Unanswered(f"could not be asked ({type(exc).__name__}: {said})")


async def _ask_manifest(
    network: Network, blob_id: str, peer: str
) -> bytes | messages.ErrorResponse | _Unanswered:
    """One manifest request; `_Unanswered` if the peer did not answer it. A protocol
    breach is raised (ProtocolError): that peer is not asked again."""
    stream = None
    try:
        with trio.fail_after(CONTROL_TIMEOUT):
            stream = await network.open_blob_stream(peer)
            return await BlobClient(stream).manifest(blob_id)
    except (StreamLost, trio.TooSlowError, OSError) as exc:
        log.info("manifest from %s failed: %r", peer, exc)
        return _unanswered(exc)
    finally:
        if stream is not None:
            await reset_quietly(stream)


async def _ask_speculating(
    network: Network, blob_id: str, peer: str, tentative: bool = False
) -> tuple[bytes | messages.ErrorResponse | _Unanswered, BlobClient | None]:
    """The manifest request and a `get` of SPECULATIVE_CHUNK sent together on one
    ``/blobnet/blob/1.1.0`` stream (``tentative``: a `try_get` on a 1.5.0 one): the
    manifest's answer, and the client whose `get` is still to be read (None unless a
    manifest came). ProtocolRefused: the peer does not speak that version. The chunk is
    checked against the manifest when it is read, as any other."""
    assert isinstance(network, StripedNetwork)
    client = None
    try:
        with trio.fail_after(CONTROL_TIMEOUT):
            stream = await network.open_blob_stream_on(peer, 0, pipelined=True, tentative=tentative)
            version = messages.Version.V1_5 if tentative else messages.Version.V1_1
            client = BlobClient(stream, version=version, pipelined=True)
            await client.send_manifest(blob_id)
            span = ((SPECULATIVE_CHUNK, SPECULATIVE_CHUNK + 1),)
            await client.send_get(
                blob_id, span, answer_bytes=SPECULATIVE_ANSWER_BYTES, tentative=tentative
            )
            reply = await client.read_manifest()
        if not isinstance(reply, bytes):
            return reply, None
        kept, client = client, None
        return reply, kept
    except ProtocolRefused:
        raise
    except (StreamLost, trio.TooSlowError, OSError) as exc:
        if isinstance(exc, StreamLost) and client is not None and not client.negotiated:
            # A 1.0.0-only listener's reset can overtake its `na` (rule 10).
            raise ProtocolRefused(f"stream reset before the protocol echo: {exc}") from exc
        log.info("manifest from %s failed: %r", peer, exc)
        return _unanswered(exc), None
    finally:
        if client is not None:
            await reset_quietly(client.stream)


@dataclass
class _Asked:
    """A request sent to a provider before its task needs the answer (HaveProbes)."""

    done: trio.Event = field(default_factory=trio.Event)
    client: BlobClient | None = None  # the stream, kept for whoever takes the answer


@dataclass
class _Probe(_Asked):
    have: messages.HaveResponse | messages.ErrorResponse | None = None
    rtt: float = 0.0


@dataclass
class _CountProbe(_Asked):
    status: messages.StatusResponse | messages.ErrorResponse | None = None


_A = TypeVar("_A", bound=_Asked)


async def _take(table: dict[str, _A], peer: str) -> _A | None:
    """``peer``'s entry of ``table``, removed, once it has ended (None if there is none)."""
    asked = table.pop(peer, None)
    if asked is not None:
        await asked.done.wait()
    return asked


async def open_status_client(
    network: Network,
    peer: str,
    chunk_length: Callable[[int], int] | None = None,
    *,
    fellows: bool = False,
) -> BlobClient | None:
    """A ``/blobnet/blob/1.3.0`` stream to ``peer`` for ``status`` (1.4.0 with
    ``fellows``; proposed, not yet confirmed: the first answer tells), or None where the
    network has no libp2p host to open one on or the open fails."""
    host = getattr(network, "host", None)
    if host is None or not hasattr(host, "get_network"):
        return None
    version = messages.Version.V1_4 if fellows else messages.Version.V1_3
    try:
        stream = await open_optimistic(host, ID.from_base58(peer), version.protocol_id)
    except Exception as exc:  # libp2p raises many types for one failed open
        log.info("provider %s: no status stream: %r", peer, exc)
        return None
    return BlobClient(stream, chunk_length, version=version)


class HaveProbes:
    """``have`` asked of each provider while its manifest request is still out.

    Waiting for the manifest before asking ``have`` would cost one stream open and one
    round trip more before the first ``get``. A probe opens its own
    stream beside the manifest's and asks at once; the provider's task takes the answer,
    and the stream, for its first worker.

    With ``count_fellows`` (swarming), a probe also asks 1.4.0's ``status`` on a stream
    of its own, for the provider's count of other fetchers (p2p.blob.swarm rule 6): asked once
    the first ``get`` is out, the answer waited behind that request's chunks on a
    connection still in slow start (0.9 s at 200 ms, where a round trip is 0.2 s).

    With ``stripes`` (a striped network), a provider already connected across an ocean
    (``StripeConfig.early_lanes`` of its kernel RTT) gets its extra connections dialled
    now, beside the manifest, not once the manifest and ``have`` are in: the dials take
    two round trips, so the lanes are up about when the download starts."""

    def __init__(
        self,
        network: Network,
        blob_id: str,
        nursery: trio.Nursery,
        *,
        count_fellows: bool = False,
        stripes: StripeConfig | None = None,
    ) -> None:
        self._network = network
        self._blob_id = blob_id
        self._nursery = nursery
        self._count_fellows = count_fellows
        self._stripes = stripes if isinstance(network, StripedNetwork) else None
        self._probes: dict[str, _Probe] = {}
        self._counts: dict[str, _CountProbe] = {}
        self._dials: dict[str, trio.Event] = {}
        self._planned: dict[str, int] = {}  # bulk lanes being dialled, per provider
        # First-chunk `get`s sent with a manifest request, answers unread (fetch_manifest).
        # A `try_get` when swarming (count_fellows): a seeder that others fetch from
        # declines it, else it would send that one chunk N times (rule 11).
        self._speculations: dict[str, BlobClient] = {}
        self._speculated = not isinstance(network, StripedNetwork)
        self.tentative = count_fellows
        self.serial: set[str] = set()  # providers that refused 1.1.0 meanwhile

    def start(self, peer: str) -> None:
        if peer not in self._probes:
            probe = self._probes[peer] = _Probe()
            self._nursery.start_soon(self._ask, peer, probe)
        if self._count_fellows and peer not in self._counts:
            count = self._counts[peer] = _CountProbe()
            self._nursery.start_soon(self._ask_count, peer, count)
        if self._stripes is not None and peer not in self._dials:
            self._dials[peer] = trio.Event()
            self._nursery.start_soon(self._dial_lanes, peer, self._stripes, self._dials[peer])

    async def _dial_lanes(self, peer: str, config: StripeConfig, done: trio.Event) -> None:
        try:
            network = self._network
            assert isinstance(network, StripedNetwork)
            lanes = config.early_lanes(network.connection_rtt(peer))
            wait_lanes = getattr(network, "wait_lanes", None)
            if lanes and wait_lanes is not None and network.connection_count(peer) <= lanes:
                # Lanes the node began to dial when the first connection's TCP connect
                # showed a long path (p2p.node.node.Node.connect with ``lanes``).
                self._planned[peer] = lanes
                await wait_lanes(peer)
            more = lanes + 1 - network.connection_count(peer)  # and the control lane
            if lanes and more > 0:
                self._planned[peer] = lanes
                log.info("provider %s: %d connections at once (far away)", peer, more)
                async with trio.open_nursery() as dials:
                    for _ in range(more):
                        dials.start_soon(network.add_connection, peer)
        finally:
            done.set()

    def planned_lanes(self, peer: str) -> int:
        """Bulk lanes being dialled for ``peer`` at `start` (0: none)."""
        return self._planned.get(peer, 0)

    async def lanes_dialled(self, peer: str) -> None:
        """Until the extra connections dialled for ``peer`` at `start` are up or failed."""
        done = self._dials.get(peer)
        if done is not None:
            await done.wait()

    async def _ask_count(self, peer: str, count: _CountProbe) -> None:
        client = None
        try:
            with trio.fail_after(CONTROL_TIMEOUT):
                client = await open_status_client(self._network, peer, fellows=True)
                if client is not None:
                    count.status = await client.status(self._blob_id)
                    count.client = client
                    client = None
        except (StreamLost, messages.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("fetcher count from %s failed: %r", peer, exc)
        finally:
            if client is not None:
                await reset_quietly(client.stream)
            count.done.set()

    async def take_count(self, peer: str) -> _CountProbe | None:
        """The count probe of ``peer``, once it has ended (None if none was started)."""
        return await _take(self._counts, peer)

    async def _ask(self, peer: str, probe: _Probe) -> None:
        stream = None
        try:
            with trio.fail_after(CONTROL_TIMEOUT):
                stream = await self._network.open_blob_stream(peer)
                client = BlobClient(stream)
                asked = trio.current_time()
                probe.have = await client.have(self._blob_id)
                probe.rtt = path_rtt(trio.current_time() - asked, stream)
                probe.client = client
                stream = None
        except (StreamLost, messages.ProtocolError, trio.TooSlowError, OSError) as exc:
            log.info("have from %s failed: %r", peer, exc)
        finally:
            if stream is not None:
                await reset_quietly(stream)
            probe.done.set()

    async def take(self, peer: str) -> _Probe | None:
        """The probe of ``peer``, once it has ended (None if none was started)."""
        return await _take(self._probes, peer)

    def may_speculate(self) -> bool:
        """Whether this manifest request may carry the first chunk's `get` (the first
        one of the fetch does, on a network that pipelines)."""
        if self._speculated:
            return False
        self._speculated = True
        return True

    def offer(self, peer: str, client: BlobClient) -> None:
        """A stream with a `get` of SPECULATIVE_CHUNK outstanding, for ``peer``'s task."""
        self._speculations[peer] = client

    def take_speculation(self, peer: str) -> BlobClient | None:
        return self._speculations.pop(peer, None)

    async def close(self) -> None:
        """Reset the streams of probes nobody took."""
        asked: list[_Asked] = [*self._probes.values(), *self._counts.values()]
        clients = [e.client for e in asked if e.client is not None]
        for client in [*clients, *self._speculations.values()]:
            await reset_quietly(client.stream)
        self._probes.clear()
        self._counts.clear()
        self._speculations.clear()
