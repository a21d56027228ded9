"""What ``blob status`` shows of a running node, and the metrics read from it when scraped.

Both read the node's own state when asked (p2p.metrics rule 3): nothing here keeps a copy.
Peer and blob IDs appear in the status, never as metric labels (p2p.metrics rule 2).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from p2p.metrics import package_version

if TYPE_CHECKING:
    from p2p.node.node import Node

# Listing a large store reads a manifest per blob: a scrape every few seconds reuses the
# last count for this long.
STORE_SCAN_INTERVAL = 10.0
# Connections and transfers listed in one status: a daemon with more says how many it left
# out rather than answering megabytes.
MAX_LISTED = 512


@dataclass
class DaemonInfo:
    """What the daemon knows beside its node: its role, its start, how it is reached, the
    authorities it serves under, and hooks others add (an outer worker's round)."""

    role: str
    started_at: float = field(default_factory=time.time)
    reach: Any = None  # p2p.nat.punch.Reachable, when relays were asked
    authorities: tuple[str, ...] = ()
    relay: Any = None  # p2p.nat.relay.AdmittedRelay, on a relay: its byte count
    api_addr: str | None = None  # the local API's TCP listener (serve --api-listen)
    extra: dict[str, Callable[[], Any]] = field(default_factory=dict)


class StoreCount:
    """The store's blobs and bytes, counted at most every ``STORE_SCAN_INTERVAL``, and
    again as soon as one of the node's fetches has ended."""

    def __init__(self) -> None:
        self._at = -STORE_SCAN_INTERVAL
        self._fetches = 0
        self.blobs = 0
        self.bytes = 0

    def refresh(self, node: Node, now: float) -> StoreCount:
        fetches = sum(node.metrics.ended.values())
        if now - self._at >= STORE_SCAN_INTERVAL or fetches != self._fetches:
            self._fetches = fetches
            infos = node.store.list_blobs()
            self.blobs = sum(1 for i in infos if i.complete)
            self.bytes = sum(i.size for i in infos if i.complete)
            self._at = now
        return self


def connections(node: Node) -> list[dict[str, Any]]:
    """Each connected peer: direct or relayed, how many connections and lanes."""
    from libp2p.peer.id import ID

    from p2p.nat.relay import direct_connection

    out = []
    for peer in node.connected_peers()[:MAX_LISTED]:
        peer_id = ID.from_base58(peer)
        try:
            conns = node.host.get_network().get_connections(peer_id)
        except Exception:  # gone between the two calls
            continue
        out.append(
            {
                "peer": peer,
                "kind": "direct" if direct_connection(node.host, peer_id) else "relayed",
                "connections": len(conns),
                "lanes": node.connection_count(peer) - 1,
            }
        )
    return out


def observed_addrs(host: Any) -> list[str]:
    """Our addresses as peers see them: what their identify told us, once py-libp2p has
    it from enough distinct observers to add it to the host's own addresses (its
    ObservedAddrManager's threshold). Read from the host class's ``get_addrs``, since the
    node replaces the instance's (p2p.transport.patches.advertise_interfaces), less the
    addresses we listen on. Loopback observations never count (py-libp2p drops them)."""
    try:
        own = {str(a) for a in host.get_transport_addrs()}
        seen = [str(a).split("/p2p/")[0] for a in type(host).get_addrs(host)]
    except Exception:  # py-libp2p's host changed shape: no observations, no crash
        return []
    return [a for a in dict.fromkeys(seen) if a not in own][:MAX_LISTED]


def observed_reachability(listen: list[str], observed: list[str]) -> str | None:
    """What the observations say of reachability: ``public`` when a peer saw us at an
    address we listen on (no translation between), ``behind_nat`` when peers see us
    only elsewhere (a NAT rewrote the address), None without observations."""
    if not observed:
        return None
    ours = {_ip_port(a) for a in listen}
    return "public" if any(_ip_port(a) in ours for a in observed) else "behind_nat"


def _ip_port(addr: str) -> tuple[str, str]:
    parts = addr.split("/")
    return (parts[2], parts[4]) if len(parts) > 4 else (addr, "")


def dht_size(node: Node) -> int:
    table = getattr(node.dht, "routing_table", None)
    if table is None:
        return 0
    try:
        return len(table.get_peer_ids())
    except Exception:  # py-libp2p's table changed shape: no count, no crash
        return 0


def certificate_info(certificate: bytes | None, now: float) -> dict[str, Any] | None:
    if certificate is None:
        return None
    from identity import AdmissionCertificate

    cert = AdmissionCertificate.decode(certificate)
    return {
        "operator": cert.operator,
        "authority": cert.authority.hex(),
        "not_after": cert.not_after,
        "expires_in_s": round(cert.not_after - now),
    }


def node_status(node: Node, info: DaemonInfo, store_count: StoreCount) -> dict[str, Any]:
    """The status document (``API.md``, op ``status``)."""
    now = time.time()
    reach = info.reach
    if reach is not None and reach.reachability.public is not None:
        reachability = "public" if reach.reachability.public else "relayed"
    else:
        reachability = "unknown"
    if node.advertised:
        reachability = "relayed"
    listen = [str(a).split("/p2p/")[0] for a in node.host.get_addrs()]
    observed = observed_addrs(node.host)
    seen_as = observed_reachability(listen, observed)
    if reachability == "unknown" and seen_as is not None:
        reachability = seen_as
    conns = connections(node)
    count = store_count.refresh(node, _monotonic())
    transfers = [
        {
            "id": blob_id,
            "done_bytes": p.done_bytes,
            "total_bytes": p.total_bytes,
            "rate_bytes_per_s": round(p.rate_bytes_per_s),
            "peers": sorted(p.peers),
        }
        for blob_id, p in list(node.transfers.items())[:MAX_LISTED]
    ]
    status: dict[str, Any] = {
        "version": package_version(),
        "role": info.role,
        "peer_id": node.peer_id,
        "uptime_s": round(now - info.started_at, 1),
        "listen_addrs": [str(a) for a in node.host.get_addrs()],
        "addrs": node.reachable_addrs,
        "reachability": reachability,
        "reachability_detail": None if reach is None else reach.reachability.detail,
        "observed_addrs": observed,
        "observed_reachability": seen_as,
        "connections": conns,
        "connections_direct": sum(1 for c in conns if c["kind"] == "direct"),
        "connections_relayed": sum(1 for c in conns if c["kind"] == "relayed"),
        "certificate": certificate_info(node.config.certificate, now),
        "authorities": list(info.authorities),
        "store": {"root": str(node.store.root), "blobs": count.blobs, "bytes": count.bytes},
        "transfers": transfers,
        "serving": {
            "bytes_sent": node.server.stats.bytes_sent,
            "streams": dict(node.server.streams_per_peer),
            "refusals": node.server.stats.busy_rejections,
            "refusals_unadmitted": 0 if node.server.gate is None else node.server.gate.refused,
        },
        "names": names_served(node),
        "dht_peers": dht_size(node),
        "relayed_bytes": None if info.relay is None else info.relay.relayed_bytes,
        "api_tcp": info.api_addr,
        "bad_chunks_by_peer": dict(node.bad_chunks),
    }
    for key, read in info.extra.items():
        status[key] = read()
    return status


def names_served(node: Node) -> list[dict[str, Any]]:
    from p2p.names.service import service_of

    try:
        records = service_of(node).cache.by_publisher(node.peer_id)
    except Exception:  # names not installed on this node
        return []
    return [{"name": r.name, "id": r.blob_id, "seq": r.seq} for r in records[:MAX_LISTED]]


def _monotonic() -> float:
    return time.monotonic()


class NodeCollector(Collector):
    """The metrics read from the node when scraped (p2p.metrics rule 3)."""

    def __init__(self, node: Node, store_count: StoreCount, info: DaemonInfo) -> None:
        self.node = node
        self.store_count = store_count
        self.info = info

    def collect(self) -> Iterator[Any]:
        node = self.node
        stats = node.server.stats
        sent = CounterMetricFamily(
            "blobnet_bytes_sent", "Payload bytes sent, by protocol.", labels=["protocol"]
        )
        sent.add_metric(["blob"], stats.bytes_sent)
        yield sent
        bad = CounterMetricFamily(
            "blobnet_chunks_failed_verification",
            "Chunks received that failed their BLAKE3 hash (the sender is banned).",
        )
        bad.add_metric([], node.bad_chunks_total)
        yield bad
        refused = CounterMetricFamily(
            "blobnet_server_refusals",
            "Requests and streams the blob server refused, by reason.",
            labels=["reason"],
        )
        refused.add_metric(["busy"], stats.busy_rejections)
        refused.add_metric(["tentative_declined"], stats.tentative_declined)
        gate = node.server.gate
        refused.add_metric(["unadmitted"], 0 if gate is None else gate.refused)
        yield refused
        conns = connections(node)
        kinds = GaugeMetricFamily(
            "blobnet_connections", "Connected peers by path; lanes: extra striping connections.",
            labels=["kind"],
        )  # fmt: skip
        kinds.add_metric(["direct"], sum(1 for c in conns if c["kind"] == "direct"))
        kinds.add_metric(["relayed"], sum(1 for c in conns if c["kind"] == "relayed"))
        kinds.add_metric(["lane"], sum(c["lanes"] for c in conns))
        yield kinds
        tries = CounterMetricFamily("blobnet_holepunch_attempts", "Hole punches started.")
        tries.add_metric([], node.punches.attempts)
        yield tries
        wins = CounterMetricFamily(
            "blobnet_holepunch_successes", "Hole punches that ended in a direct connection."
        )
        wins.add_metric([], node.punches.successes)
        yield wins
        relay = CounterMetricFamily(
            "blobnet_relay_bytes", "Bytes this node relayed for others (a relay only)."
        )
        relay.add_metric([], 0 if self.info.relay is None else self.info.relay.relayed_bytes)
        yield relay
        count = self.store_count.refresh(node, _monotonic())
        store_bytes = GaugeMetricFamily("blobnet_store_bytes", "Bytes of complete blobs held.")
        store_bytes.add_metric([], count.bytes)
        yield store_bytes
        store_blobs = GaugeMetricFamily("blobnet_store_blobs", "Complete blobs held.")
        store_blobs.add_metric([], count.blobs)
        yield store_blobs
        flight = GaugeMetricFamily("blobnet_transfers_in_flight", "Fetches running now.")
        flight.add_metric([], len(node.transfers))
        yield flight
        dht = GaugeMetricFamily("blobnet_dht_peers", "Peers in the DHT routing table.")
        dht.add_metric([], dht_size(node))
        yield dht
