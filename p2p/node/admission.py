"""Serving only admitted peers (``blob serve --authority KEY``): the gate and its client.

Rules
1. A node started with authorities serves blobs, names and status only to peers that
   presented an admission certificate from one of them on ``ADMIT_PROTOCOL``, checked
   against the peer ID that Noise authenticated (``p2p.nat.relay.AdmissionBook``, as the
   relay does), and only until the certificate expires.
2. A client presents its certificate once per connection, right after connecting
   (``Node.connect``), when it has one. The exchange is one varint-prefixed certificate
   (possibly empty: a question) and one varint-prefixed answer: ``ok``, ``open`` (this
   node admits everyone) or the reason it refuses, with which certificate would do.
3. The blob server answers an unadmitted peer's first request ``not_found`` with a message
   beginning ``unadmitted:`` that names the authorities (every protocol version knows that
   code, so older clients move on at once). A blobnet fetcher remembers that line
   (``Node.refused``), ends a fetch at once when every provider it can reach refused it,
   and puts the line in its error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from identity import MAX_CERTIFICATE_SIZE, TrustStore
from p2p.nat.relay import AdmissionBook

log = logging.getLogger(__name__)

ADMIT_PROTOCOL = TProtocol("/blobnet/admit/1.0.0")
# One exchange is a round trip and a signature check: a few RTTs at most.
EXCHANGE_TIMEOUT = 5.0
# The answer is "ok", "open" or a one-line reason.
MAX_ANSWER = 512
UNADMITTED = "unadmitted"


def refusal(authorities: Sequence[str]) -> str:
    """What an unadmitted peer is told: which certificate would admit it (rule 2)."""
    names = ", ".join(a[:16] for a in authorities) or "?"
    return (
        f"{UNADMITTED}: this node serves only peers admitted by authority {names}; "
        "pass --certificate FILE with an admission certificate from it"
    )


class Gate:
    """The admitted peers of one serving node (rule 1). Time is ``time.time()`` at the
    edges: certificates carry wall-clock validity."""

    def __init__(self, trust: TrustStore) -> None:
        self.book = AdmissionBook(trust)
        self.authorities = tuple(sorted(key.hex() for key in trust.authorities))
        self.message = refusal(self.authorities)
        self.refused = 0

    def admitted(self, peer: str) -> bool:
        ok = self.book.admitted(peer, time.time())
        if not ok:
            self.refused += 1
        return ok

    def answer(self, peer: str, certificate: bytes) -> str:
        if not certificate:
            return self.message
        reason = self.book.present(peer, certificate, time.time())
        return "ok" if reason is None else f"{self.message} ({reason})"

    async def handle(self, stream: Any) -> None:
        peer = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                cert = await read_varint_prefixed_bytes_limited(stream, MAX_CERTIFICATE_SIZE)
                answer = self.answer(peer, cert)
                await stream.write(encode_varint_prefixed(answer.encode()[:MAX_ANSWER]))
            await stream.close()
        except Exception as exc:  # a peer's broken exchange ends only that exchange
            log.info("admission exchange with %s failed: %r", peer, exc)
            try:
                await stream.reset()
            except Exception:  # already gone
                pass


def install_gate(host: Any, trust: TrustStore) -> Gate:
    gate = Gate(trust)
    host.set_stream_handler(ADMIT_PROTOCOL, gate.handle)
    return gate


def open_answer(host: Any) -> None:
    """A node without authorities answers ``open`` (rule 2), so a client's presentation
    is never a failed protocol negotiation."""

    async def handle(stream: Any) -> None:
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                await read_varint_prefixed_bytes_limited(stream, MAX_CERTIFICATE_SIZE)
                await stream.write(encode_varint_prefixed(b"open"))
            await stream.close()
        except Exception:  # the peer's problem; nothing to keep
            try:
                await stream.reset()
            except Exception:
                pass

    host.set_stream_handler(ADMIT_PROTOCOL, handle)


async def present(host: Any, peer: str, certificate: bytes | None) -> str | None:
    """Present ``certificate`` (None: ask) to ``peer``; its answer, or None if it gave
    none (an older node, a broken connection)."""
    try:
        with trio.fail_after(EXCHANGE_TIMEOUT):
            stream = await host.new_stream(ID.from_base58(peer), [ADMIT_PROTOCOL])
            await stream.write(encode_varint_prefixed(certificate or b""))
            answer = await read_varint_prefixed_bytes_limited(stream, MAX_ANSWER)
            await stream.close()
    except Exception as exc:  # libp2p raises many types for one failed exchange
        log.debug("admission exchange with %s: %r", peer, exc)
        return None
    return bytes(answer).decode(errors="replace")


AdmittedPredicate = Callable[[str], bool]
