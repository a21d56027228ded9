"""Fetching from a provider behind NAT: through its relay, upgraded to a direct
connection by hole punching (DCUtR), the blob itself over the direct connection.

Steps of :func:`fetch_through_relay` (each bounded; the outcome says which step ended it):

1. Dial the provider's circuit address (``p2p.relay.dial_via_relay``): TCP + Noise to the
   relay, ``CONNECT``, then Noise + yamux end to end through it.
2. Hole-punch (py-libp2p's ``DCUtRProtocol.initiate_hole_punch``): a direct dial first
   (the provider may be reachable after all), then up to three simultaneous-open rounds.
3. With a direct connection: close the relayed one (so no blob byte can take it) and
   fetch from the provider as a connected peer. Without one: say why in one line; fetch
   through the relay only when the caller allows it (and the relay's limits will cut a
   bulk transfer short unless it was configured with raised ones).

Reachability (:func:`reachability`): a node learns whether it is publicly reachable from
what its peers observed in identify. An observed address that is not one of its own
listen addresses means a NAT rewrote it: the node is private and should reserve on a
relay and advertise circuit addresses. py-libp2p's AutoNAT in 0.8.1 would answer the
same question by dial-back but needs several AutoNAT servers; a relay's observation is
enough to decide to reserve.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import trio
from libp2p.peer.id import ID

from p2p.relay import (
    RelayError,
    dial_via_relay,
    direct_connection,
    nat_services,
    parse_circuit_addr,
    present_certificate,
)

log = logging.getLogger(__name__)

# py-libp2p's DCUtR tries a direct dial (10 s cap), then three rounds of at most 5 s with
# 2 s pauses: 25 s is its worst case; a caller's timeout bounds the whole of it.
DEFAULT_PUNCH_TIMEOUT = 30.0


@dataclass
class NatOutcome:
    """What one fetch through a relay came to. ``path``: "direct" (hole punched),
    "relayed" (the user allowed it), or "failed" (``reason`` says why, one line)."""

    path: str
    reason: str = ""
    blob_id: str = ""
    relayed_s: float | None = None  # connected through the relay
    direct_s: float | None = None  # direct connection up
    first_byte_s: float | None = None  # first verified chunk
    done_s: float | None = None
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@asynccontextmanager
async def _dcutr(host: Any) -> AsyncIterator[Any]:
    existing = getattr(host, "_dcutr_protocol", None)
    if existing is not None:
        yield existing
        return
    async with nat_services(host) as dcutr:
        yield dcutr


async def close_relayed(host: Any, peer: ID) -> int:
    """Close every relayed connection to ``peer``; the number closed."""
    closed = 0
    for conn in list(host.get_network().get_connections(peer)):
        try:
            addrs = conn.get_transport_addresses()
        except Exception:  # cannot tell: leave it
            continue
        if addrs and all("/p2p-circuit" in str(a) for a in addrs):
            await conn.close()
            closed += 1
    return closed


async def upgrade_to_direct(host: Any, peer: ID, *, punch_timeout: float) -> str | None:
    """Hole-punch to ``peer`` (connected through a relay); None when a direct connection
    is up, else the one-line reason it is not."""
    async with _dcutr(host) as dcutr:
        with trio.move_on_after(punch_timeout):
            await dcutr.initiate_hole_punch(peer)
    if direct_connection(host, peer) is not None:
        return None
    return (
        f"hole punching to {peer} failed (no direct connection within {punch_timeout:.0f} s: "
        "a symmetric NAT on either side maps each connection to a new port)"
    )


async def fetch_through_relay(
    node: Any,
    blob_id: str,
    circuit_addr: str,
    *,
    certificate: bytes | None = None,
    allow_relayed: bool = False,
    punch_timeout: float = DEFAULT_PUNCH_TIMEOUT,
) -> NatOutcome:
    """Fetch ``blob_id`` from the NATed provider at ``circuit_addr`` (see the module
    docstring). Never raises for a network failure: the outcome carries the reason."""
    host = node.host
    t0 = time.monotonic()
    out = NatOutcome(path="failed", blob_id=blob_id)
    relay_addr, target = parse_circuit_addr(circuit_addr)
    peer = ID.from_base58(target)
    async with _dcutr(host):
        try:
            if certificate is not None:
                await node.connect(relay_addr)
                await present_certificate(
                    host, ID.from_base58(relay_addr.rsplit("/", 1)[1]), certificate
                )
            await dial_via_relay(host, circuit_addr)
        except (RelayError, Exception) as exc:  # one line, whoever failed
            out.reason = str(exc)
            return out
        out.relayed_s = time.monotonic() - t0
        reason = await upgrade_to_direct(host, peer, punch_timeout=punch_timeout)
        if reason is None:
            out.direct_s = time.monotonic() - t0
            await close_relayed(host, peer)
            out.path = "direct"
        elif allow_relayed:
            out.path = "relayed"
            out.reason = reason
        else:
            out.reason = reason
            return out

        def progress(p: Any) -> None:
            if out.first_byte_s is None and p.done_bytes > 0:
                out.first_byte_s = time.monotonic() - t0
            out.bytes = p.done_bytes

        try:
            await node.fetch(blob_id, progress=progress, announce=False)
        except Exception as exc:  # the fetch's own one-line error
            out.reason = f"{out.reason + '; ' if out.reason else ''}fetch failed: {exc}"
            out.path = "failed"
            return out
        out.done_s = time.monotonic() - t0
    return out
