"""Peer exchange: fetchers of one blob find each other through its providers.

Theory of operation
1. A server (``p2p.blob.server.BlobServer``) remembers, per blob, the peers that asked it
   ``manifest``, ``have``, ``get`` or ``peers`` for that blob recently: a `SwarmBook`.
   It is bounded in blobs (``MAX_SWARM_BLOBS``, least recently asked dropped first) and in
   peers per blob (``MAX_SWARM_PEERS``, least recently seen dropped first), and an entry
   expires ``SWARM_EXPIRY`` seconds after the peer last asked.
2. A ``peers`` request (``/blobnet/blob/1.2.0``, PROTOCOL.md section 5.3) is answered
   with the most recently seen of them, the asker left out, each with its dialable
   listen addresses from the server's peerstore (what identify told it), peers with
   none left out, at most ``MAX_PEERS_LISTED``. A wildcard address is not dialable and
   not listed: a node listening on every interface tells identify each interface's
   address instead (``p2p.node.node``).
3. A fetcher (``p2p.node.node.Node``) asks each provider of a download ``peers`` at most once
   per ``PEX_INTERVAL`` (per source, doubling up to ``PEX_MAX_INTERVAL`` while its answers
   name nobody new, once it has named somebody), dials at most ``MAX_SWARM_DIALS`` of the
   peers it learns per download (``PEX_DIAL_PARALLELISM`` at a time) and hands each one it
   reaches to the download as a provider: a fellow fetcher is a partial provider, whose
   ``have`` the download asks again as its chunks arrive
   (``p2p.fetch.download_parts.HAVE_REFRESH_INTERVAL``). Everything a fellow sends is verified
   like any other provider's data; a liar is banned.
   `PexBook` is that bookkeeping, sans-IO.
4. Chunks in flight are visible (``/blobnet/blob/1.3.0``'s ``status``): a download posts
   the chunks it has requested and not yet verified on its node's `FetchingBoard`; the
   server answers ``status`` with them as ``soon`` beside the held ones. A fellow that
   learns a chunk is soon at a peer leaves it to that peer (``p2p.fetch.scheduler``'s claims)
   instead of asking the seeder for it too: each chunk then crosses the seeder's uplink
   about once, not once per fetcher that wanted it in the same half second.
5. A swarming one-shot fetch (``SchedulerConfig.linger_while_asked``, for `blob get`)
   that is complete stays until its fellows are done with it: it returns
   once the node's server has had no request about the blob for ``LINGER_QUIET`` seconds
   (``FetchingBoard.last_asked``), at most ``LINGER_MAX`` after completion. A one-shot
   ``blob get`` that left at once took the chunks it got last with it, and its fellows
   had to ask the seeder for them again.

6. A seeder counts who fetches from it (``/blobnet/blob/1.4.0``'s ``status``): the peers
   other than the asker that asked it about the blob within ``FELLOW_WINDOW``
   (`SwarmBook.fellows`) and are still connected to it: a fetch that ended and left is
   not counted, or back-to-back fetches of one blob would each hear the last one. A
   fetcher that its seeder calls alone, and that knows no fellow, drops the swarm's
   opening caps there (``p2p.fetch.scheduler``'s ``set_alone``): a lone fetch across a
   continent needs many requests in flight at once to fill its striped connections, and
   the caps cost it a quarter of its rate (bench/figures/wan-opening-caps.md). Until the
   seeder has said so twice in a row (``p2p.fetch.download_parts.ALONE_ANSWERS``,
   ``HAVE_REFRESH_INTERVAL`` apart) it is owed at most an eighth of the blob at a time
   (``p2p.fetch.sched_records.ALONE_ONCE_SHARE``): of fetchers that start together the first to
   ask hears "alone" once, and uncapped on that answer it took a small blob nearly whole
   from the seeder before the next answer counted the others. It keeps asking every
   ``HAVE_REFRESH_INTERVAL`` and keeps the caps for good from the first answer that
   counts anyone.

All time is the ``now`` argument (seconds, monotonic); nothing here does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from p2p.blob.messages import MAX_ADDR_LEN, MAX_ADDRS_PER_PEER, MAX_PEER_ID_LEN, MAX_PEERS_LISTED

# One entry of a `peers` answer: a peer ID and its addresses.
Listed = tuple[str, tuple[str, ...]]

# Blobs a server keeps a swarm list for: a node serves a handful of blobs at once; 256
# lists of MAX_SWARM_PEERS short entries are a few MiB at most.
MAX_SWARM_BLOBS = 256
# Peers remembered per blob: four times what one answer lists, so that the answer can
# leave the asker out and still prefer the most recently seen.
MAX_SWARM_PEERS = 4 * MAX_PEERS_LISTED
# A peer that has not asked about a blob for this long has finished or gone: a fetch of
# a large blob asks `get` every few seconds, so 5 minutes spans any pause in one.
SWARM_EXPIRY = 300.0

# A fellow is counted (rule 6) while it asked about the blob this recently: a fetch asks
# its providers something at least every PEX_MAX_INTERVAL (`peers`), and far more often
# while it fetches from them (`get`, `status`); one that finished is soon not counted.
FELLOW_WINDOW = 10.0
# A fetcher asks one provider `peers` at most this often: fellows join a swarm over the
# first seconds, and one small request per second per provider costs nothing.
PEX_INTERVAL = 1.0
# ... and at most this seldom once its answers stopped naming anyone new: every fetcher
# asks every fellow it reached, so at 1 s a 16-worker swarm answered ~240 `peers` a second
# (each listing its fellows' addresses) for nothing after the first few rounds.
PEX_MAX_INTERVAL = 8.0
# Providers asked `peers` per round: the swarm's lists overlap, a few sources suffice.
MAX_PEX_SOURCES = 8
# Fellow fetchers dialled per download: BitTorrent keeps ~30-50 connections; a blob
# fetch from a handful of fellows already spreads the seeder's upload.
MAX_SWARM_DIALS = 16
# Dials in progress at once per download.
PEX_DIAL_PARALLELISM = 4
# A fellow asks a partial peer `status` every 0.5 s and a complete one for chunks as it
# needs them: 0.75 s without any request means nobody is fetching from us any more (the
# last fetcher of a swarm waits this long for nothing, so no longer).
LINGER_QUIET = 0.75
# However busy the fellows are, a fetch returns this long after its blob is complete: they
# have the seeder and each other.
LINGER_MAX = 10.0


def usable_addrs(addrs: Iterable[str]) -> tuple[str, ...]:
    """The addresses worth listing for a peer: TCP ones, not wildcard, within the
    protocol's bounds, at most MAX_ADDRS_PER_PEER, in order, without repeats."""
    out: list[str] = []
    for addr in addrs:
        if "/tcp/" not in addr or "/ip4/0.0.0.0/" in addr or "/ip6/::/" in addr:
            continue
        addr = addr.split("/p2p/")[0]
        if len(addr.encode()) > MAX_ADDR_LEN or not addr.isprintable() or addr in out:
            continue
        out.append(addr)
        if len(out) == MAX_ADDRS_PER_PEER:
            break
    return tuple(out)


class SwarmBook:
    """Per blob, the peers that asked for it recently (server side, bounded)."""

    def __init__(
        self,
        *,
        max_blobs: int = MAX_SWARM_BLOBS,
        max_peers: int = MAX_SWARM_PEERS,
        expiry: float = SWARM_EXPIRY,
    ) -> None:
        self.max_blobs = max_blobs
        self.max_peers = max_peers
        self.expiry = expiry
        # blob ID -> (peer ID -> last seen), least recently used first.
        self._blobs: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()

    def seen(self, blob_id: str, peer: str, now: float) -> None:
        """``peer`` asked about ``blob_id`` at ``now``."""
        if len(peer) > MAX_PEER_ID_LEN:
            return
        peers = self._blobs.pop(blob_id, None)
        if peers is None:
            peers = OrderedDict()
        self._blobs[blob_id] = peers
        peers.pop(peer, None)
        peers[peer] = now
        while len(peers) > self.max_peers:
            peers.popitem(last=False)
        while len(self._blobs) > self.max_blobs:
            self._blobs.popitem(last=False)

    def peers(self, blob_id: str, now: float, exclude: str = "") -> list[str]:
        """Peers of ``blob_id`` seen within the expiry, most recent first, ``exclude``
        left out. Expired entries are dropped."""
        peers = self._blobs.get(blob_id)
        if peers is None:
            return []
        while peers and next(iter(peers.values())) < now - self.expiry:
            peers.popitem(last=False)
        if not peers:
            del self._blobs[blob_id]
            return []
        return [p for p in reversed(peers) if p != exclude]

    def fellows(
        self,
        blob_id: str,
        now: float,
        exclude: str,
        window: float,
        connected: Callable[[str], bool] = lambda peer: True,
    ) -> int:
        """How many peers other than ``exclude`` asked about ``blob_id`` within the last
        ``window`` seconds and are ``connected`` still (a 1.4.0 `status` answer's count,
        rule 6): a fetch that has ended and gone fetches nothing any more."""
        peers = self._blobs.get(blob_id)
        if peers is None:
            return 0
        count = 0
        for peer, seen in reversed(peers.items()):  # most recent first
            if seen < now - window:
                break
            count += peer != exclude and connected(peer)
        return count

    def __len__(self) -> int:
        return len(self._blobs)


class PexBook:
    """One download's peer exchange (fetcher side): whom to ask, whom to dial."""

    def __init__(
        self,
        own_peer: str,
        *,
        interval: float = PEX_INTERVAL,
        max_dials: int = MAX_SWARM_DIALS,
        max_sources: int = MAX_PEX_SOURCES,
    ) -> None:
        self.own_peer = own_peer
        self.interval = interval
        self.max_dials = max_dials
        self.max_sources = max_sources
        self.known: set[str] = {own_peer}
        self.dialled = 0
        self._asked: dict[str, float] = {}
        # Each source's own interval: doubles (to PEX_MAX_INTERVAL) while its answers name
        # nobody new, back to ``interval`` when one does (rule 3).
        self._every: dict[str, float] = {}
        self._named: set[str] = set()  # sources that named someone (rule 3)
        self._sources: list[str] = []

    def add_source(self, peer: str) -> None:
        """``peer`` is a provider of the download (ask it ``peers``)."""
        self.known.add(peer)
        if peer not in self._sources:
            self._sources.append(peer)

    def due(self, now: float) -> list[str]:
        """Sources to ask ``peers`` now (each at most once per interval; none once the
        dial budget is spent); marks them asked."""
        if self.dialled >= self.max_dials:
            return []
        out = []
        for peer in self._sources:
            every = self._interval(peer)
            if now - self._asked.get(peer, -every) >= every:
                self._asked[peer] = now
                out.append(peer)
                if len(out) == self.max_sources:
                    break
        return out

    def next_wake(self, now: float) -> float:
        """When a source is next due (``now + interval`` when none is known yet)."""
        if not self._sources:
            return now + self.interval
        # A source never asked is due now.
        return min(
            self._asked.get(p, now - self._interval(p)) + self._interval(p) for p in self._sources
        )

    def to_dial(self, listed: Iterable[Listed]) -> list[Listed]:
        """Of the peers a source listed, those to dial: new ones, within the dial budget;
        they count as known (never dialled twice) and against the budget."""
        out = []
        for peer, addrs in listed:
            if peer in self.known or not addrs:
                continue
            if self.dialled >= self.max_dials:
                break
            self.known.add(peer)
            self.dialled += 1
            out.append((peer, addrs))
        return out

    def answered(self, source: str, new: int, listed: int | None = None) -> None:
        """``source`` answered ``peers``, naming ``new`` peers that `to_dial` took (of
        ``listed`` it named; None: not said, taken as some). A source that has named nobody
        yet is asked again at the first interval: the first fetcher to reach a seeder asks
        before its fellows have, so an empty first answer is no sign that none will come
        (backed off, that fetcher would fetch alone from a seeder its fellows share)."""
        if listed is None or listed:
            self._named.add(source)
        every = self._interval(source)
        if new or source not in self._named:
            self._every[source] = self.interval
        else:
            self._every[source] = min(PEX_MAX_INTERVAL, 2 * every)

    def _interval(self, source: str) -> float:
        return self._every.get(source, self.interval)


def listing(
    book: SwarmBook,
    blob_id: str,
    asker: str,
    now: float,
    addrs_of: Callable[[str], Iterable[str]],
) -> tuple[Listed, ...]:
    """The ``peers`` answer for ``asker``: up to MAX_PEERS_LISTED peers of ``blob_id``
    with usable addresses (``addrs_of`` reads them from the peerstore)."""
    out: list[Listed] = []
    for peer in book.peers(blob_id, now, exclude=asker):
        addrs = usable_addrs(addrs_of(peer))
        if addrs:
            out.append((peer, addrs))
            if len(out) == MAX_PEERS_LISTED:
                break
    return tuple(out)


# What a download has in flight now: the indices it requested and has not verified.
InFlight = Callable[[], Iterable[int]]


class FetchingBoard:
    """The chunks a node's downloads are fetching now, by blob ID
    (what a ``status`` answer calls ``soon``). One download posts per blob at a time; a
    second one of the same blob (another task) shares the board entry, newest first."""

    def __init__(self) -> None:
        self._posts: dict[str, list[InFlight]] = {}
        # When the server last answered anyone about each blob (bounded like SwarmBook).
        self._asked: OrderedDict[str, float] = OrderedDict()

    def asked(self, blob_id: str, now: float) -> None:
        """The node's server got a request about ``blob_id`` at ``now``."""
        self._asked.pop(blob_id, None)
        self._asked[blob_id] = now
        while len(self._asked) > MAX_SWARM_BLOBS:
            self._asked.popitem(last=False)

    def last_asked(self, blob_id: str) -> float | None:
        return self._asked.get(blob_id)

    @contextmanager
    def posting(self, blob_id: str, in_flight: InFlight) -> Iterator[None]:
        """Post ``in_flight`` (called on each ``status``) for the ``with`` block."""
        self._posts.setdefault(blob_id, []).insert(0, in_flight)
        try:
            yield
        finally:
            posts = self._posts.get(blob_id, [])
            if in_flight in posts:
                posts.remove(in_flight)
            if not posts:
                self._posts.pop(blob_id, None)

    def soon(self, blob_id: str, num_chunks: int, held: bytes) -> bytes:
        """The ``soon`` bitmap of ``blob_id``: chunks in flight, less those ``held``."""
        bits = 0
        for in_flight in self._posts.get(blob_id, ()):
            for i in in_flight():
                if 0 <= i < num_chunks:
                    bits |= 1 << i
        bits &= ~int.from_bytes(held, "little")
        return bits.to_bytes((num_chunks + 7) // 8, "little")
