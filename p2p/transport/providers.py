"""Bounds on what other peers may store in this node's DHT provider records.

py-libp2p 0.8.1's Kademlia stores every ADD_PROVIDER it accepts for 48 h with all the
addresses the provider named (a 4 MiB message holds 400,000 of them), with no cap on keys,
records or bytes: 4 identities x 10 messages took a node from 94 to 1,847 MiB and kept it
there. ``ProviderGuard`` decides, before py-libp2p stores a record, what of it is kept.

Theory of operation (sans-IO: the caller passes the time and applies the decision):
1. A record keeps at most ``max_addrs_per_record`` of the provider's addresses, each a
   well-formed, dialable (``/ip4``, ``/ip6``, ``/dns*`` with ``/tcp`` or ``/udp``), routable
   (not unspecified, multicast or broadcast) address of at most ``max_addr_bytes``; a
   record left with none is refused.
2. One peer identity adds at most ``adds_per_minute`` records a minute (refreshes count)
   and holds at most ``max_records_per_peer``.
3. The store holds at most ``max_records`` records, ``max_keys`` keys and ``max_bytes``
   bytes (keys plus addresses plus ``RECORD_OVERHEAD`` each). When a new record does not
   fit, the oldest record of the identity holding the most is dropped, if that identity
   holds more than the newcomer; otherwise the new record is refused. Many free
   identities each holding a little can fill the store only as fast as rule 2 lets each
   of them, and a provider that refreshes its record keeps it.
4. Records expire ``record_ttl`` after their last refresh (py-libp2p's own 48 h): the
   guard forgets them then, as py-libp2p's clean-up does.
5. This node's own records (``local``) are never refused or dropped.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from multiaddr import Multiaddr

# A node names a few listen addresses (IPv4 and IPv6, TCP and QUIC, a relay circuit or
# two); 8 is room for all of them.
MAX_ADDRS_PER_RECORD = 8
# A relay circuit address (two peer IDs, an address) is about 90 bytes.
MAX_ADDR_BYTES = 128
# One node provides every complete blob it holds, and announces them again every 22 h:
# thousands of records from one busy node are normal.
MAX_RECORDS_PER_PEER = 8192
# Reprovides come in bursts (py-libp2p itself takes 10 ADD_PROVIDERs per 10 s per peer).
ADDS_PER_MINUTE = 120
# The whole store: 64 Ki records of at most 8 short addresses each stay well under
# MAX_BYTES; 32 MiB is what a serving node spends on other peers' provider records.
MAX_RECORDS = 65536
MAX_KEYS = 65536
MAX_BYTES = 32 * 1024 * 1024
# What a record costs beyond its bytes (Python objects, dict slots): a fair charge so the
# byte cap also bounds many tiny records.
RECORD_OVERHEAD = 256
RECORD_TTL = 48 * 3600.0
# Peers whose minute of adds is remembered; past it, windows older than a minute go.
MAX_RATE_WINDOWS = 4096

_DIALABLE_HOSTS = ("ip4", "ip6", "dns", "dns4", "dns6")
_DIALABLE_TRANSPORTS = ("tcp", "udp")


@dataclass(frozen=True)
class ProviderLimits:
    max_addrs_per_record: int = MAX_ADDRS_PER_RECORD
    max_addr_bytes: int = MAX_ADDR_BYTES
    max_records_per_peer: int = MAX_RECORDS_PER_PEER
    adds_per_minute: int = ADDS_PER_MINUTE
    max_records: int = MAX_RECORDS
    max_keys: int = MAX_KEYS
    max_bytes: int = MAX_BYTES
    record_ttl: float = RECORD_TTL


def usable_address(addr: Any, max_bytes: int = MAX_ADDR_BYTES) -> bool:
    """Rule 1 for one address: well formed, dialable, routable and short."""
    try:
        ma = addr if isinstance(addr, Multiaddr) else Multiaddr(addr)
        raw = ma.to_bytes()
        names = [p.name for p in ma.protocols()]
    except Exception:
        return False
    if len(raw) > max_bytes or len(names) < 2:
        return False
    if names[0] not in _DIALABLE_HOSTS or names[1] not in _DIALABLE_TRANSPORTS:
        return False
    if names[0] in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(ma.value_for_protocol(names[0]))
        except Exception:
            return False
        if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
            return False
    return True


@dataclass
class _Record:
    peer: str
    key: bytes
    size: int
    at: float


@dataclass
class Decision:
    """What to store: ``addrs`` (None: refuse, for ``reason``) and the records (key,
    peer) to drop first to make room."""

    addrs: list[Any] | None
    reason: str = ""
    drop: list[tuple[bytes, str]] = field(default_factory=list)


class ProviderGuard:
    """The provider store's bookkeeping (module theory of operation)."""

    def __init__(self, limits: ProviderLimits | None = None, *, local: str = "") -> None:
        self.limits = limits if limits is not None else ProviderLimits()
        self.local = local
        # Insertion order is refresh order: the first record is the oldest.
        self.records: dict[tuple[bytes, str], _Record] = {}
        self.by_peer: Counter[str] = Counter()
        self.by_key: Counter[bytes] = Counter()
        self.bytes = 0
        self._windows: dict[str, tuple[float, int]] = {}
        self.refused = 0
        self.dropped = 0

    def admit(self, key: bytes, peer: str, addrs: list[Any], now: float) -> Decision:
        limits = self.limits
        self.expire(now)
        if peer == self.local:
            self._put(key, peer, list(addrs), now)
            return Decision(list(addrs))
        kept = [a for a in addrs if usable_address(a, limits.max_addr_bytes)]
        kept = kept[: limits.max_addrs_per_record]
        if not kept:
            return self._refuse(f"none of {len(addrs)} addresses is usable")
        if not self._rate_ok(peer, now):
            return self._refuse(f"{peer} added {limits.adds_per_minute} records this minute")
        existing = self.records.get((key, peer))
        if existing is None and self.by_peer[peer] >= limits.max_records_per_peer:
            return self._refuse(f"{peer} holds {self.by_peer[peer]} records")
        size = _size(key, kept)
        drop: list[tuple[bytes, str]] = []
        while not self._fits(key, size, existing, drop):
            victim = self._victim(peer, drop)
            if victim is None:
                return self._refuse("the provider store is full")
            drop.append(victim)
        for victim in drop:
            self.forget(*victim)
        self.dropped += len(drop)
        self._put(key, peer, kept, now)
        return Decision(kept, drop=drop)

    def forget(self, key: bytes, peer: str) -> None:
        record = self.records.pop((key, peer), None)
        if record is None:
            return
        self.bytes -= record.size
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]
        self.by_key[key] -= 1
        if self.by_key[key] <= 0:
            del self.by_key[key]

    def expire(self, now: float) -> list[tuple[bytes, str]]:
        """Forget records not refreshed within ``record_ttl`` (rule 4); returns them."""
        gone = []
        for ident, record in self.records.items():
            if now - record.at < self.limits.record_ttl:
                break
            gone.append(ident)
        for ident in gone:
            self.forget(*ident)
        return gone

    def _refuse(self, reason: str) -> Decision:
        self.refused += 1
        return Decision(None, reason)

    def _rate_ok(self, peer: str, now: float) -> bool:
        start, count = self._windows.get(peer, (now, 0))
        if now - start >= 60.0:
            start, count = now, 0
        if count >= self.limits.adds_per_minute:
            return False
        if peer not in self._windows and len(self._windows) >= MAX_RATE_WINDOWS:
            self._windows = {p: w for p, w in self._windows.items() if now - w[0] < 60.0}
            if len(self._windows) >= MAX_RATE_WINDOWS:
                return False  # that many identities this minute: a flood, not providers
        self._windows[peer] = (start, count + 1)
        return True

    def _fits(
        self, key: bytes, size: int, existing: _Record | None, drop: list[tuple[bytes, str]]
    ) -> bool:
        limits = self.limits
        freed = sum(self.records[d].size for d in drop)
        records = len(self.records) - len(drop) + (0 if existing else 1)
        keys_dropped = sum(1 for d in drop if self.by_key[d[0]] == 1)
        new_key = 0 if self.by_key[key] else 1
        keys = len(self.by_key) - keys_dropped + new_key
        used = self.bytes - freed - (existing.size if existing else 0) + size
        return (
            records <= limits.max_records and keys <= limits.max_keys and used <= limits.max_bytes
        )

    def _victim(self, newcomer: str, drop: list[tuple[bytes, str]]) -> tuple[bytes, str] | None:
        """The oldest record of the identity holding the most, if it holds more than the
        newcomer (rule 3)."""
        holdings = Counter(self.by_peer)
        for _, peer in drop:
            holdings[peer] -= 1
        holdings.pop(self.local, None)
        if not holdings:
            return None
        greedy, held = holdings.most_common(1)[0]
        if held <= holdings[newcomer] + 1:
            return None
        for ident, record in self.records.items():
            if record.peer == greedy and ident not in drop:
                return ident
        return None

    def _put(self, key: bytes, peer: str, addrs: list[Any], now: float) -> None:
        self.forget(key, peer)  # a refresh moves the record to the end (newest)
        record = _Record(peer, key, _size(key, addrs), now)
        self.records[(key, peer)] = record
        self.bytes += record.size
        self.by_peer[peer] += 1
        self.by_key[key] += 1


def _size(key: bytes, addrs: list[Any]) -> int:
    total = len(key) + RECORD_OVERHEAD
    for addr in addrs:
        try:
            total += len(addr.to_bytes()) if isinstance(addr, Multiaddr) else len(str(addr))
        except Exception:
            total += MAX_ADDR_BYTES
    return total


def install_provider_guard(kad: Any, limits: ProviderLimits, *, local: str) -> ProviderGuard:
    """Guard ``kad``'s provider store (its records carry wall-clock times), and refuse its
    oversized requests before they are parsed (the guard's caps apply only after)."""
    import time

    from p2p.transport.patches import guard_provider_store, limit_kad_requests

    guard = ProviderGuard(limits, local=local)
    guard_provider_store(kad, guard, time.time)
    limit_kad_requests(kad)
    return guard
