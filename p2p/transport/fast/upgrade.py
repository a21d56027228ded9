"""Make a py-libp2p host build our muxer for `/yamux/1.0.0`.

py-libp2p 0.8.1's `MuxerMultistream.new_conn` constructs its own `Yamux` whenever the
negotiated protocol is `/yamux/1.0.0`, whatever class `muxer_opt` registered for it. `install`
swaps the host's muxer negotiator for `FastMuxerMultistream`, which builds the registered class,
but only over our `FastSecureConn`: any other secure channel gets py-libp2p's own Yamux. As the
dialler it also saves a round trip of the muxer's negotiation (`select_pipelined`), and
`FastSecurityMultistream` one of the security negotiation's. Over our own Noise the dialler
does not wait for the muxer's answer at all: it sends the proposal and starts the yamux
session, which checks the listener's echo before its first frame (a listener that refuses
yamux ends the connection). Nor does it wait for the answer to its security proposal:
Noise's first message follows it in the same write (`AnsweredFirst`). A dial so takes two
round trips (TCP, Noise), not four, and the first stream's request goes out with the
muxer proposal.

A socket we dialled but are told to answer on (`secure_inbound` of a raw connection that
is the initiator: py-libp2p's DCUtR upgrades the hole punch's own dials as the responder,
for a TCP simultaneous open) may have reached the peer's listener instead, when the peer
is reachable after all (the same LAN, a provider that only assumed it was private). Both
ends would then send multistream's header and wait for a proposal until the punch round
times out. A simultaneous dialler proposes right behind its header (or right after ours
arrives), so a peer that says nothing after its header for `SILENT_PEER_S` is a listener,
and we take the dialler's role (`answer_or_dial`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import IMuxedConn, ISecureConn
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import (
    MultiselectClientError,
    MultiselectCommunicatorError,
    MultiselectError,
)
from libp2p.protocol_muxer.multiselect_client import DEFAULT_NEGOTIATE_TIMEOUT
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.security.security_multistream import SecurityMultistream
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.utils import encode_delim

from .errors import LocalProtocolError, RemoteProtocolError
from .noise import FastNoiseTransport, FastSecureConn, socket_rtt, trio_socket_of
from .yamux import PROTOCOL_ID, FastYamuxConn

log = logging.getLogger(__name__)

MULTISTREAM = "/multistream/1.0.0"
# How long a dial made as the responder waits, after the peer's multistream header, for a
# proposal before it takes the dialler's role (the module docstring). A simultaneous
# dialler's proposal comes at most a round trip after its connect completes, which is
# about when ours did: 2 s is many times
# an intercontinental round trip, and well inside a hole-punch round (5 s). Waiting out
# the round instead costs more than the round: its closed socket sits in TIME_WAIT on the
# same two ports, and every later round's dial fails at once.
SILENT_PEER_S = 2.0
# Proposals a responder dial turns down before it gives up on the peer (we offer one).
MAX_PROPOSALS = 8


async def select_pipelined(conn: Any, protocol: TProtocol) -> TProtocol:
    """multistream-select as the dialler with a single proposal: the header and the
    proposal go out in one write, and the two answers are read after it (one round trip;
    py-libp2p's client waits for the header's answer first, two). A listener reads them
    one at a time either way, so this is the same conversation on the wire."""
    communicator = MultiselectCommunicator(conn)
    await conn.write(encode_delim(MULTISTREAM.encode()) + encode_delim(protocol.encode()))
    header = await communicator.read()
    if header != MULTISTREAM:
        raise MultiselectClientError(f"peer answered {header[:64]!r} to the header")
    answer = await communicator.read()
    if answer != protocol:
        raise MultiselectClientError(f"peer refused {protocol}: {answer[:64]!r}")
    return protocol


async def answer_or_dial(
    conn: Any, sock: Any, protocol: TProtocol, *, silent_s: float = SILENT_PEER_S
) -> bool:
    """multistream-select on a socket we dialled but were told to answer on (the module
    docstring): send the header, read the peer's; then, if a proposal follows within
    ``silent_s`` (`SILENT_PEER_S`), answer it (False: we are the responder, as asked); if
    the peer stays silent, it is a listener waiting for us (True: the caller proposes
    `protocol`, with no header, and continues as the dialler)."""
    communicator = MultiselectCommunicator(conn)
    await communicator.write(MULTISTREAM)
    header = await communicator.read()
    if header != MULTISTREAM:
        raise RemoteProtocolError(f"peer sent {header[:64]!r} for multistream's header")
    with trio.move_on_after(silent_s) as waiting:
        await trio.lowlevel.wait_readable(sock)  # reads nothing: the answer below does
    if waiting.cancelled_caught:
        log.debug("responder dial: the peer stayed silent %.1f s: dialling", silent_s)
        return True
    for _ in range(MAX_PROPOSALS):
        proposal = await communicator.read()
        if proposal == protocol:
            await communicator.write(protocol)
            return False
        await communicator.write("na")
    raise RemoteProtocolError(f"peer proposed {MAX_PROPOSALS} protocols, none of them {protocol}")


class AnsweredFirst:
    """A raw connection for a dialler that proposed a protocol without waiting for the
    answer: its first write goes out behind the proposal (one segment), and its first
    read takes the listener's answer off the wire, and checks it, before anything else.
    A listener that answers anything else (``na``) fails the read: it refused."""

    def __init__(self, conn: Any, protocol: TProtocol, *, header: bool = True) -> None:
        self._conn = conn
        self._protocol = protocol
        self._proposal: bytes | None = (
            encode_delim(MULTISTREAM.encode()) if header else b""
        ) + encode_delim(protocol.encode())
        self._expect = self._proposal

    @property
    def awaiting_answer(self) -> bool:
        return bool(self._expect)

    async def write(self, data: bytes) -> None:
        if self._proposal is not None:
            data, self._proposal = self._proposal + bytes(data), None
        await self._conn.write(data)

    async def read(self, n: int | None = None) -> bytes:
        while self._expect:
            got = await self._conn.read(len(self._expect))
            if not got:
                raise MultiselectClientError(
                    f"connection closed before {self._protocol} was answered"
                )
            if got != self._expect[: len(got)]:
                raise MultiselectClientError(f"peer refused {self._protocol}: {got[:64]!r}")
            self._expect = self._expect[len(got) :]
        data: bytes = await self._conn.read(n)
        return data

    async def close(self) -> None:
        await self._conn.close()


class FastSecurityMultistream(SecurityMultistream):
    """py-libp2p's security negotiator. As the dialler over our Noise it does not wait
    for the answer to its proposal: the proposal and Noise's first message leave in one
    write, and the answer is checked before Noise's second message is read
    (`AnsweredFirst`); so a dial takes two round trips before its first frame, not three.
    With another transport it proposes in one round trip (`select_pipelined`). Listening
    is unchanged, but for a dial made as the responder to a silent peer (the module
    docstring). ``on_dial`` (`on_tcp_dialled`) hears of each dial whose TCP connect has
    completed, with the kernel's RTT of it, before Noise begins. ``silent_peer_s``: how long
    such a responder dial waits for the peer's proposal (`SILENT_PEER_S`)."""

    on_dial: Callable[[ID, float | None], None] | None = None

    def __init__(self, *args: Any, silent_peer_s: float = SILENT_PEER_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.silent_peer_s = silent_peer_s

    def _noise(self) -> FastNoiseTransport | None:
        offered = list(self.transports)
        noise = self.transports[offered[0]] if len(offered) == 1 else None
        return noise if isinstance(noise, FastNoiseTransport) else None

    async def secure_inbound(self, conn: Any) -> ISecureConn:
        sock = trio_socket_of(conn)
        noise = self._noise()
        if not getattr(conn, "is_initiator", False) or sock is None or noise is None:
            return await super().secure_inbound(conn)
        protocol = next(iter(self.transports))
        try:
            with trio.fail_after(DEFAULT_NEGOTIATE_TIMEOUT):
                dialling = await answer_or_dial(conn, sock, protocol, silent_s=self.silent_peer_s)
        except (trio.TooSlowError, MultiselectCommunicatorError, RemoteProtocolError) as exc:
            raise MultiselectError(f"Failed to negotiate a security protocol: {exc}") from exc
        if not dialling:
            return await noise.secure_inbound(conn)
        # The peer is not checked here: DCUtR's responder dial checks it after the upgrade.
        return await self._secure_as_dialler(noise, conn, None, header=False)

    async def secure_outbound(self, conn: Any, peer_id: ID) -> ISecureConn:
        if self.on_dial is not None:
            self.on_dial(peer_id, socket_rtt(trio_socket_of(conn)))
        noise = self._noise()
        if noise is None:
            return await super().secure_outbound(conn, peer_id)
        return await self._secure_as_dialler(noise, conn, peer_id)

    async def _secure_as_dialler(
        self, noise: FastNoiseTransport, conn: Any, peer_id: ID | None, *, header: bool = True
    ) -> ISecureConn:
        offered = list(self.transports)
        checked = AnsweredFirst(conn, offered[0], header=header)
        try:
            with trio.fail_after(DEFAULT_NEGOTIATE_TIMEOUT):
                secure = await noise.secure_outbound_through(conn, checked, peer_id)
        except (trio.TooSlowError, MultiselectClientError, MultiselectCommunicatorError) as exc:
            raise MultiselectError(
                "Failed to negotiate a security protocol: no protocol selected"
            ) from exc
        if checked.awaiting_answer:  # Noise's reply came, so the answer before it did
            raise LocalProtocolError("the security answer was not read")
        secure.negotiated_security_protocol = str(offered[0])  # type: ignore[attr-defined]
        return secure

    async def select_transport_and_protocol(
        self, conn: Any, is_initiator: bool
    ) -> tuple[TProtocol, Any]:
        offered = list(self.transports)
        if not is_initiator or len(offered) != 1:
            return await super().select_transport_and_protocol(conn, is_initiator)
        try:
            with trio.fail_after(DEFAULT_NEGOTIATE_TIMEOUT):
                protocol = await select_pipelined(conn, offered[0])
        except (trio.TooSlowError, MultiselectClientError, MultiselectCommunicatorError) as exc:
            raise MultiselectError(
                "Failed to negotiate a security protocol: no protocol selected"
            ) from exc
        return protocol, self.transports[protocol]


class FastMuxerMultistream(MuxerMultistream):
    """A `MuxerMultistream` that honours `FastYamuxConn` for `/yamux/1.0.0`, and proposes
    it in one round trip as the dialler (`select_pipelined`)."""

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        offered = list(self.transports)
        fast_offer = (
            len(offered) == 1
            and self.transports[offered[0]] is FastYamuxConn
            and isinstance(conn, FastSecureConn)
        )
        if conn.is_initiator and fast_offer:
            # Optimistic: the session starts at once and checks the echoes when they come
            # (yamux_core invariant 9), so the first stream's request leaves in the same
            # flight as the proposal instead of a round trip later.
            expect = encode_delim(MULTISTREAM.encode()) + encode_delim(offered[0].encode())
            await conn.write(expect)
            muxed_fast = FastYamuxConn(
                conn, peer_id, expect=expect, echo_timeout=float(self.negotiate_timeout)
            )
            return self._annotate_connection(muxed_fast, conn, offered[0])
        if conn.is_initiator and len(offered) == 1:
            try:
                with trio.fail_after(self.negotiate_timeout):
                    protocol = await select_pipelined(conn, offered[0])
            except trio.TooSlowError:
                raise MultiselectClientError("muxer negotiation timed out") from None
            transport_class = self.transports[protocol]
        else:
            protocol, transport_class = await self._selector.select(
                conn, conn.is_initiator, self.negotiate_timeout
            )
        muxed: IMuxedConn
        fast = transport_class is FastYamuxConn and isinstance(conn, FastSecureConn)
        if protocol == PROTOCOL_ID and not fast:
            muxed = Yamux(conn, peer_id, is_initiator=conn.is_initiator)
        else:
            muxed = transport_class(conn, peer_id)
        return self._annotate_connection(muxed, conn, protocol)


def on_tcp_dialled(host: Any, callback: Callable[[ID, float | None], None]) -> bool:
    """Call ``callback(peer_id, rtt)`` whenever ``host`` (after `install`) has a dialled
    TCP connection up, before its Noise handshake: the caller learns the path's RTT a
    round trip before the connection is usable. False if ``host`` is not on our stack."""
    security = getattr(getattr(host.get_network(), "upgrader", None), "security_multistream", None)
    if not isinstance(security, FastSecurityMultistream):
        return False
    security.on_dial = callback
    return True


def install(host: Any) -> None:
    """Let `host` (from `libp2p.new_host`, not yet running) use our muxer. Idempotent."""
    upgrader = getattr(host.get_network(), "upgrader", None)
    current = getattr(upgrader, "muxer_multistream", None)
    if not isinstance(current, MuxerMultistream):
        raise LocalProtocolError("this host has no py-libp2p MuxerMultistream to replace")
    if not isinstance(current, FastMuxerMultistream):
        upgrader.muxer_multistream = FastMuxerMultistream(  # type: ignore[union-attr]
            dict(current.transports), current.negotiate_timeout
        )
    security = getattr(upgrader, "security_multistream", None)
    if isinstance(security, SecurityMultistream) and not isinstance(
        security, FastSecurityMultistream
    ):
        upgrader.security_multistream = FastSecurityMultistream(  # type: ignore[union-attr]
            dict(security.transports)
        )
