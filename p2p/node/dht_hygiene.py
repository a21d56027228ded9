"""Keeping clients out of a DHT server's routing table once they are gone.

Kademlia's rule is that a node adds another to its routing table only if that one runs in
server mode. py-libp2p 0.8.1 adds every peer that opens a DHT stream to it, on the
assumption that only servers do (``KadDHT._do_handle_stream``); a client-mode fetcher (a
one-shot ``blob get``) that asks us for providers is therefore added too, and after it
exits stays in our table as a dead entry that we, and every peer we hand it to, dial in
vain. So: when a peer's last connection closes and it never said (in identify) that it
serves the DHT protocol, it is removed from the routing table. Servers that disconnect
stay, as Kademlia keeps them.
"""

from __future__ import annotations

import logging
from typing import Any

from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from multiaddr import Multiaddr

log = logging.getLogger(__name__)


class _ForgetClients(INotifee):
    def __init__(self, kad: Any) -> None:
        self.kad = kad

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer_id = conn.muxed_conn.peer_id
        try:
            others = [
                c
                for c in network.get_connections(peer_id)
                if c is not conn and not getattr(c, "is_closed", False)
            ]
            if others:
                return  # another connection to it is up
            protocols = network.peerstore.get_protocols(peer_id)
        except Exception:  # the peer is unknown to the peerstore: nothing says server
            protocols = []
        if str(KAD_PROTOCOL) in {str(p) for p in protocols}:
            return
        if self.kad.routing_table.remove_peer(peer_id):
            log.debug("DHT client %s left: removed from the routing table", peer_id)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


def forget_clients_on_disconnect(host: Any, kad: Any) -> None:
    host.get_network().register_notifee(_ForgetClients(kad))
