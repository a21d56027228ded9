"""Make a py-libp2p host build our muxer for `/yamux/1.0.0`.

py-libp2p 0.8.1's `MuxerMultistream.new_conn` constructs its own `Yamux` whenever the
negotiated protocol is `/yamux/1.0.0`, whatever class `muxer_opt` registered for it. `install`
swaps the host's muxer negotiator for `FastMuxerMultistream`, which builds the registered class,
but only over our `FastSecureConn`: any other secure channel gets py-libp2p's own Yamux.
"""

from __future__ import annotations

from typing import Any

from libp2p.abc import IMuxedConn, ISecureConn
from libp2p.peer.id import ID
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import Yamux

from .errors import LocalProtocolError
from .noise import FastSecureConn
from .yamux import PROTOCOL_ID, FastYamuxConn


class FastMuxerMultistream(MuxerMultistream):
    """A `MuxerMultistream` that honours `FastYamuxConn` for `/yamux/1.0.0`."""

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
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


def install(host: Any) -> None:
    """Let `host` (from `libp2p.new_host`, not yet running) use our muxer. Idempotent."""
    upgrader = getattr(host.get_network(), "upgrader", None)
    current = getattr(upgrader, "muxer_multistream", None)
    if not isinstance(current, MuxerMultistream):
        raise LocalProtocolError("this host has no py-libp2p MuxerMultistream to replace")
    if isinstance(current, FastMuxerMultistream):
        return
    upgrader.muxer_multistream = FastMuxerMultistream(  # type: ignore[union-attr]
        dict(current.transports), current.negotiate_timeout
    )
