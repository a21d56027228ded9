"""The catalog: publish a blob under ``PUBLISHER/NAME`` and resolve it on any node.

Theory of operation
===================

A name is a signed record (:mod:`p2p.names.record`): publisher peer ID, name, blob ID,
sequence number, time, optional expiry. Records spread two ways, both bounded:

1. **The DHT.** Each name has the DHT key ``/blobnet-name/<hex>``; :func:`install`
   registers :class:`NameValidator` for that namespace on the node's KadDHT, so every
   blobnet DHT server refuses records that do not verify or do not match their key, and
   keeps the newest one (py-libp2p asks the validator's ``select`` on every PUT_VALUE).
   A publisher ``put_value`` s its record; a resolver ``get_value`` s it. Nodes without
   the validator store anything; resolvers verify every answer themselves.
2. **``/blobnet/names/1.0.0``** (:mod:`p2p.names.protocol`), answered from the node's
   record cache (:mod:`p2p.names.cache`, kept in the store directory): ``get`` a name,
   ``put`` (push) a record, ``list`` a publisher's names. A publisher pushes its record
   to its connected peers; a peer that takes a *newer* record pushes it on to its own
   connected peers (a flood that stops where nothing changes).

Resolving asks, in parallel and under one deadline: the local cache, up to
``MAX_RESOLVE_PEERS`` connected peers, and the DHT; it ends when all have answered, or
``RESOLVE_GRACE`` after the first valid record. Every answer is verified
(signature, publisher, name, expiry, and the publisher's certificate when a trust store
is given); the newest valid record wins (seq, then time, then bytes), is kept in the
cache so this node answers for it too, and refused answers are reported with their
reasons when nothing valid was found. A node that publishes trusts its own cache.

Time is an argument everywhere below this module's boundary functions, which default it
to the wall clock (record expiry is wall-clock time; the checks take it as ``now``).
"""

from __future__ import annotations

import logging
import time as _time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.records.validator import Validator

from blobstore import StoreError
from identity import AdmissionCertificate, Signer, TrustStore
from p2p.blob.shell import StreamLost, close_quietly, read_some, reset_quietly, write_all
from p2p.names import protocol as wire
from p2p.names.cache import MAX_RECORDS_PER_PUBLISHER, NameCache
from p2p.names.record import (
    DHT_NAMESPACE,
    BadName,
    CatalogError,
    NameNotFound,
    NameReason,
    NameRecord,
    NameRef,
    NameRejected,
    check_name,
    dht_key,
    dht_key_of,
    newest,
    order_key,
    parse_ref,
    record_key,
    sign_record,
    verify,
)

if TYPE_CHECKING:
    from blobstore import Store


class Node(Protocol):
    """What the names service needs of a running node (``p2p.node.Node`` is one): names sit
    below the node, which installs them, so they see it through this view only."""

    store: Store
    host: Any
    dht: Any
    # The node's own names service: None until `install` builds it.
    name_service: NameService | None

    @property
    def peer_id(self) -> str: ...

    def connected_peers(self) -> list[str]: ...


__all__ = [
    "HostKeySigner",
    "NameService",
    "NameValidator",
    "Spread",
    "catalog",
    "install",
    "publish_in_store",
    "publish_name",
    "publish_record",
    "resolve",
    "run_names",
]

log = logging.getLogger(__name__)

# Resolving waits at most this long for peers and the DHT; what arrived by then counts.
# py-libp2p's DHT queries each peer for up to 10 s, so one dead peer must not hold a
# resolve for that long.
RESOLVE_TIMEOUT = 5.0
# Once one valid record is in, the others get this long to answer with a newer one:
# peers answer within a round trip (milliseconds on a LAN, a few hundred on the open
# internet), while a dead peer or a DHT query to a node without the DHT can take the
# whole RESOLVE_TIMEOUT. Newer records reach peers by pushes, so the first answers are
# rarely stale.
RESOLVE_GRACE = 0.5
# One peer's answer to one request (open the stream, ask, read the answer).
PEER_TIMEOUT = 3.0
# A publish waits this long for pushes and the DHT put, then reports what took.
PUBLISH_TIMEOUT = 10.0
# Connected peers asked per resolve or listing, and pushed to per publish; beyond these
# the DHT carries the record.
MAX_RESOLVE_PEERS = 16
MAX_PUSH_PEERS = 32
# Inbound requests served at once; more are reset at once (they are tiny and cheap to
# retry, and a flood of them must not pile up tasks).
MAX_CONCURRENT_REQUESTS = 64
# A requester gets this long to send its request and read the answer.
SERVE_TIMEOUT = 10.0
# How often run_names looks for records another process wrote into the store, and how
# often it puts this node's own records into the DHT again (py-libp2p drops a value
# 24 h after it was stored; go-libp2p republishes every 22 h, we do it far sooner).
NAMES_POLL = 10.0
REPUBLISH_INTERVAL = 3600.0
# Pushes taken from one peer per minute. Each new record costs a durable write and a
# relay to every connected peer, so a peer re-signing its own names in a loop must not
# turn this node into a disk grinder and an amplifier; publishers push a handful.
MAX_PUSHES_PER_PEER_PER_MINUTE = 60
PUSH_WINDOW_S = 60.0
# Peers whose push counts are remembered; more forget the oldest window.
MAX_TRACKED_PUSHERS = 1024
# Default validity of a published record, in seconds; None = no expiry.
DEFAULT_EXPIRY_S: int | None = None


class HostKeySigner:
    """A :class:`identity.Signer` over the libp2p host's own key (the machine key), so a
    node can publish under its peer ID without holding a :class:`MachineKey`."""

    def __init__(self, host: Any) -> None:
        self._key = host.get_private_key()
        self._peer_id = str(host.get_id())
        self._public = host.get_public_key().to_bytes()

    @property
    def kind(self) -> str:
        return "software"

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def public_key_bytes(self) -> bytes:
        public: bytes = self._public
        return public

    def sign(self, message: bytes) -> bytes:
        signature: bytes = self._key.sign(message)
        return signature


class NameValidator(Validator):
    """py-libp2p DHT validator for ``/blobnet-name/`` keys.

    ``validate`` refuses a record that does not verify at ``clock()`` or whose key is
    not its name's; ``select`` picks the newest (invalid values never win)."""

    def __init__(self, clock: Callable[[], float] = _time.time) -> None:
        self.clock = clock

    def validate(self, key: str, value: bytes) -> None:
        record = verify(value, now=self.clock())
        if dht_key(record.publisher, record.name) != key:
            raise NameRejected(
                NameReason.WRONG_NAME, f"{record.describe()} was stored under another key"
            )

    def select(self, key: str, values: list[bytes]) -> int:
        best = 0
        best_key: tuple[int, int, bytes] | None = None
        now = self.clock()
        for index, value in enumerate(values):
            try:
                record = verify(value, now=now)
            except NameRejected:
                continue
            if dht_key(record.publisher, record.name) != key:
                continue
            candidate = order_key(record)
            # ">=": of identical values the later wins, so py-libp2p's PUT_VALUE handler
            # (which keeps the existing value when select answers 0) takes a republished
            # copy and refreshes its age instead of refusing it.
            if best_key is None or candidate >= best_key:
                best, best_key = index, candidate
        return best


class PushLimiter:
    """At most ``MAX_PUSHES_PER_PEER_PER_MINUTE`` pushes per peer in each fixed window
    (time is an argument)."""

    def __init__(self, limit: int = MAX_PUSHES_PER_PEER_PER_MINUTE) -> None:
        self.limit = limit
        self._windows: dict[str, tuple[float, int]] = {}

    def allow(self, peer: str, now: float) -> bool:
        start, count = self._windows.pop(peer, (now, 0))
        if now - start >= PUSH_WINDOW_S:
            start, count = now, 0
        if len(self._windows) >= MAX_TRACKED_PUSHERS:
            del self._windows[next(iter(self._windows))]  # the least recently seen
        self._windows[peer] = (start, count + 1)
        return count < self.limit


@dataclass
class Spread:
    """Where a published record went."""

    record: NameRecord
    pushed: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    dht_stored: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            **self.record.to_json(),
            "pushed_to": self.pushed,
            "refused_by": self.refused,
            "dht": self.dht_stored,
        }


class NameService:
    """The catalog side of one node: its record cache and its protocol handler."""

    def __init__(
        self, node: Node, cache: NameCache, clock: Callable[[], float] = _time.time
    ) -> None:
        self.node = node
        self.cache = cache
        self.clock = clock
        self.own_publisher = node.peer_id
        self._active = 0
        self.pushes = PushLimiter()
        # Who may ask (p2p.node.admission); None: everyone.
        self.admitted: Callable[[str], bool] | None = None

    # --- serving -----------------------------------------------------------------------
    async def handle_stream(self, stream: Any) -> None:
        if self.admitted is not None and not self.admitted(_remote_peer(stream)):
            await reset_quietly(stream)  # a node that serves admitted peers only
            return
        if self._active >= MAX_CONCURRENT_REQUESTS:
            await reset_quietly(stream)
            return
        # A relay counts as active too: pushes cost nothing to send, and each new record
        # fans out to MAX_PUSH_PEERS streams for up to PUBLISH_TIMEOUT, so uncounted
        # relays would let a flood of pushes pile up tasks without bound.
        self._active += 1
        try:
            peer = _remote_peer(stream)
            relay = await self._serve(stream, peer)
            if relay is not None:
                # A newer record: hand it on, so it reaches peers its publisher never met.
                with trio.move_on_after(PUBLISH_TIMEOUT):
                    await _push_all(self.node, relay, exclude={peer})
        finally:
            self._active -= 1

    async def _serve(self, stream: Any, peer: str) -> NameRecord | None:
        """Answer one request; returns a newly taken record to relay, if any."""
        relay: NameRecord | None = None
        try:
            with trio.move_on_after(SERVE_TIMEOUT) as scope:
                body = await _read_frame(stream, wire.MAX_REQUEST_SIZE)
                request = wire.decode_request(body)
                response, relay = await self._answer(request, peer)
                await write_all(stream, wire.encode(response))
                await close_quietly(stream)
            if scope.cancelled_caught:
                await reset_quietly(stream)
        except (wire.NamesProtocolError, StreamLost) as exc:
            log.info("names request from %s refused: %s", peer, exc)
            await reset_quietly(stream)
        except Exception:  # our bug or our disk: never let it take the host down
            log.exception("unexpected error serving a names request from %s", peer)
            await reset_quietly(stream)
        return relay

    async def _answer(
        self, request: wire.Request, peer: str
    ) -> tuple[wire.Response, NameRecord | None]:
        now = self.clock()
        if isinstance(request, wire.GetRequest):
            record = await self._lookup(request.key, now)
            return wire.RecordResponse(None if record is None else record.encode()), None
        if isinstance(request, wire.PutRequest):
            if not self.pushes.allow(peer, now):
                reason = f"busy: over {self.pushes.limit} pushes a minute from {peer}"
                return wire.PutResponse(False, reason), None
            try:
                record = verify(request.record, now=now)
            except NameRejected as exc:
                return wire.PutResponse(False, f"{exc.reason.value}: {exc}"), None
            try:
                taken = await self.take(record, now=now)
            except StoreError as exc:  # our disk, not the peer's fault: say so, keep serving
                log.warning("cannot keep %s: %s", record.describe(), exc)
                return wire.PutResponse(False, "internal: this node cannot save records"), None
            return wire.PutResponse(taken[0], taken[1]), record if taken[2] else None
        await trio.to_thread.run_sync(self._reload_all, now)
        records = [r for r in self.cache.by_publisher(request.publisher) if _live(r, now)][
            : wire.MAX_LISTED_RECORDS
        ]
        return wire.RecordsResponse(tuple(r.encode() for r in records)), None

    def _reload_all(self, now: float) -> None:
        self.cache.load_if_changed(now=now, own_publisher=self.own_publisher)

    async def _lookup(self, key: bytes, now: float) -> NameRecord | None:
        await trio.to_thread.run_sync(self._reload_key, key, now)
        record = self.cache.get(key)
        if record is not None and _live(record, now):
            return record
        dht = getattr(self.node, "dht", None)
        if dht is None:
            return None
        stored = dht.value_store.get(dht_key_of(key).encode())
        if stored is None:
            return None
        try:
            found = verify(stored.value, now=now)
        except NameRejected:
            return None
        return found if found.key == key else None

    def _reload_key(self, key: bytes, now: float) -> None:
        self.cache.reload_key(key, now=now, own_publisher=self.own_publisher)

    async def take(
        self, record: NameRecord, *, now: float, asked: bool = False
    ) -> tuple[bool, str, bool]:
        """Offer a verified record to the cache; persist it and copy it into the local
        DHT value store when it is newer. ``asked``: this node asked for the name (it
        resolved or published it), which the cache keeps over pushed records. Returns
        (accepted, reason, changed)."""
        offer = self.cache.offer(
            record, now=now, own=record.publisher == self.own_publisher, asked=asked
        )
        if offer.changed:
            await trio.to_thread.run_sync(partial(self.cache.persist, record.key, now=now))
            dht = getattr(self.node, "dht", None)
            if dht is not None:
                # DHT GET_VALUE answers from this store: keep it as fresh as the cache.
                dht.value_store.put(
                    dht_key(record.publisher, record.name).encode(), record.encode()
                )
        elif asked and offer.accepted:
            # The held record, now asked for: its rank is saved as the record would be.
            await trio.to_thread.run_sync(self.cache.persist_asked, record.key)
        return offer.accepted, offer.reason, offer.changed


def install(node: Node, *, clock: Callable[[], float] = _time.time) -> NameService:
    """Attach the catalog to a running node (its ``name_service``): load its saved records,
    serve ``/blobnet/names/1.0.0`` and validate ``/blobnet-name/`` DHT records. Idempotent;
    blocking for the (small, bounded) cache load."""
    if node.name_service is not None:
        return node.name_service
    store = node.store
    cache = NameCache.for_store_root(store.root, store.tmp_dir)
    service = NameService(node, cache, clock)
    cache.load(now=clock(), own_publisher=service.own_publisher)
    node.host.set_stream_handler(TProtocol(wire.PROTOCOL_ID), service.handle_stream)
    if node.dht is not None:
        node.dht.set_namespace_validator(DHT_NAMESPACE, NameValidator(clock))
    node.name_service = service
    return service


def service_of(node: Node) -> NameService:
    """The node's catalog, installed on first use."""
    return node.name_service or install(node)


# --- client side ----------------------------------------------------------------------
async def _read_exact(stream: Any, n: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        data = await read_some(stream, n - got)
        if not data:
            raise wire.NamesProtocolError(f"stream ended {n - got} bytes short")
        parts.append(data)
        got += len(data)
    return b"".join(parts)


async def _read_frame(stream: Any, limit: int) -> bytes:
    prefix = await _read_exact(stream, wire.LENGTH_PREFIX_SIZE)
    return await _read_exact(stream, wire.body_length(prefix, limit=limit))


async def request(node: Node, peer: str, message: wire.Request) -> wire.Response:
    """One request to ``peer`` and its answer. Any failure (unreachable, timed out,
    protocol broken, peer without the catalog) raises :class:`CatalogError`."""
    stream: Any = None
    try:
        with trio.fail_after(PEER_TIMEOUT):
            stream = await node.host.new_stream(ID.from_base58(peer), [TProtocol(wire.PROTOCOL_ID)])
            await write_all(stream, wire.encode(message))
            body = await _read_frame(stream, wire.MAX_RESPONSE_SIZE)
            response = wire.decode_response(body, message)
    except wire.NamesProtocolError as exc:
        if stream is not None:
            await reset_quietly(stream)
        raise CatalogError(f"{peer} broke {wire.PROTOCOL_ID}: {exc}") from None
    except trio.TooSlowError:
        if stream is not None:
            await reset_quietly(stream)
        raise CatalogError(f"{peer} did not answer within {PEER_TIMEOUT} s") from None
    except Exception as exc:  # libp2p raises many types for one failed stream
        if stream is not None:
            await reset_quietly(stream)
        raise CatalogError(f"cannot ask {peer}: {type(exc).__name__}: {exc}") from None
    await close_quietly(stream)
    return response


async def _push_all(node: Node, record: NameRecord, *, exclude: Collection[str] = ()) -> Spread:
    spread = Spread(record)
    peers = [p for p in node.connected_peers() if p not in exclude][:MAX_PUSH_PEERS]

    async def push(peer: str) -> None:
        try:
            response = await request(node, peer, wire.PutRequest(record.encode()))
        except CatalogError as exc:
            spread.refused[peer] = str(exc)
            return
        if isinstance(response, wire.PutResponse) and response.ok:
            spread.pushed.append(peer)
        elif isinstance(response, wire.PutResponse):
            spread.refused[peer] = response.reason
        else:
            spread.refused[peer] = f"unexpected answer {type(response).__name__}"

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(push, peer)
    return spread


def _live(record: NameRecord, now: float) -> bool:
    return record.expires is None or now < record.expires


def _remote_peer(stream: Any) -> str:
    try:
        return str(stream.muxed_conn.peer_id)
    except AttributeError:
        return "?"


# --- the API --------------------------------------------------------------------------
async def publish_record(
    node: Node,
    record: NameRecord,
    *,
    now: float | None = None,
    push: bool = True,
    use_dht: bool = True,
) -> Spread:
    """Keep ``record`` in this node's cache and spread it: pushed to connected peers
    (``push``) and put into the DHT (``use_dht``), within ``PUBLISH_TIMEOUT``. Refuses
    (NameRejected) a record that does not verify or is older than one this node holds."""
    service = service_of(node)
    now = service.clock() if now is None else now
    verify(record, now=now)
    await trio.to_thread.run_sync(service._reload_key, record.key, now)
    accepted, reason, _changed = await service.take(record, now=now, asked=True)
    if not accepted:
        raise NameRejected(NameReason.OLDER, f"{record.describe()} not published: {reason}")
    spread = Spread(record)

    async def pushes() -> None:
        done = await _push_all(node, record)
        spread.pushed, spread.refused = done.pushed, done.refused

    async def dht_put() -> None:
        if node.dht is None or not use_dht:
            return
        try:
            await node.dht.put_value(dht_key(record.publisher, record.name), record.encode())
            # put_value reports nothing; with an empty routing table it stored nowhere.
            spread.dht_stored = node.dht.routing_table.size() > 0
        except Exception as exc:  # the DHT is best effort; the pushes and cache remain
            log.info("DHT put of %s failed: %r", record.describe(), exc)

    with trio.move_on_after(PUBLISH_TIMEOUT):
        async with trio.open_nursery() as nursery:
            if push:
                nursery.start_soon(pushes)
            nursery.start_soon(dht_put)
    return spread


async def publish_name(
    node: Node,
    name: str,
    blob_id: str,
    *,
    signer: Signer | None = None,
    seq: int | None = None,
    expiry_s: int | None = DEFAULT_EXPIRY_S,
    certificate: AdmissionCertificate | None = None,
    now: float | None = None,
) -> NameRecord:
    """Sign ``PUBLISHER/name -> blob_id`` (publisher: ``signer``, default the node's own
    key) and spread it (:func:`publish_record`). ``seq`` defaults to one more than the
    last record this node holds for the name, and at least the current Unix time, so a
    publisher that lost its store still supersedes what it published before."""
    return (
        await publish(
            node,
            name,
            blob_id,
            signer=signer,
            seq=seq,
            expiry_s=expiry_s,
            certificate=certificate,
            now=now,
        )
    ).record


async def publish(
    node: Node,
    name: str,
    blob_id: str,
    *,
    signer: Signer | None = None,
    seq: int | None = None,
    expiry_s: int | None = DEFAULT_EXPIRY_S,
    certificate: AdmissionCertificate | None = None,
    now: float | None = None,
    push: bool = True,
    use_dht: bool = True,
) -> Spread:
    """:func:`publish_name`, returning where the record went (``push`` and ``use_dht``
    as in :func:`publish_record`)."""
    service = service_of(node)
    now = service.clock() if now is None else now
    signer = signer if signer is not None else HostKeySigner(node.host)
    check_name(name)
    key = record_key(signer.peer_id, name)
    await trio.to_thread.run_sync(service._reload_key, key, now)
    record = _sign_next(
        signer, name, blob_id, service.cache.get(key), seq, expiry_s, certificate, now
    )
    return await publish_record(node, record, now=now, push=push, use_dht=use_dht)


def _sign_next(
    signer: Signer,
    name: str,
    blob_id: str,
    held: NameRecord | None,
    seq: int | None,
    expiry_s: int | None,
    certificate: AdmissionCertificate | None,
    now: float,
) -> NameRecord:
    """The next record for a name: ``seq`` defaults to max(held + 1, Unix time)."""
    if seq is None:
        seq = max(int(now), held.seq + 1 if held is not None else 1)
    if expiry_s is not None and expiry_s <= 0:
        raise BadName(f"expiry must be a positive number of seconds, not {expiry_s}")
    return sign_record(
        signer,
        name=name,
        blob_id=blob_id,
        seq=seq,
        time=int(now),
        expires=None if expiry_s is None else int(now) + expiry_s,
        certificate=certificate,
    )


def publish_in_store(
    store: Store,
    signer: Signer,
    name: str,
    blob_id: str,
    *,
    now: float,
    seq: int | None = None,
    expiry_s: int | None = DEFAULT_EXPIRY_S,
    certificate: AdmissionCertificate | None = None,
) -> NameRecord:
    """Sign a record and keep it in ``store``'s record cache, without any network: for
    programs with no node running (``blob train run --publish NAME``). A node serving
    this store answers for it at once and spreads it within ``NAMES_POLL`` seconds
    (:func:`run_names`). Blocking (a small durable write)."""
    check_name(name)
    cache = NameCache.for_store_root(store.root, store.tmp_dir)
    key = record_key(signer.peer_id, name)
    cache.reload_key(key, now=now, own_publisher=signer.peer_id)
    record = _sign_next(signer, name, blob_id, cache.get(key), seq, expiry_s, certificate, now)
    verify(record, now=now)
    offer = cache.offer(record, now=now, own=True)
    if not offer.accepted:
        raise NameRejected(NameReason.OLDER, f"{record.describe()} not published: {offer.reason}")
    cache.persist(key, now=now)
    return record


async def resolve(
    node: Node,
    ref: str | NameRef,
    *,
    now: float | None = None,
    trust: TrustStore | None = None,
    wait_s: float = RESOLVE_TIMEOUT,
    use_peers: bool = True,
    use_dht: bool = True,
) -> NameRecord:
    """The newest valid record for ``PUBLISHER/NAME`` (see the module docstring).

    Raises :class:`BadName` for a malformed reference and :class:`NameNotFound` when no
    valid record arrived within ``wait_s`` seconds (its message counts the refused ones by
    reason)."""
    target = parse_ref(ref) if isinstance(ref, str) else ref
    service = service_of(node)
    now = service.clock() if now is None else now
    key = record_key(target.publisher, target.name)
    found: list[NameRecord] = []
    refused: Counter[str] = Counter()
    unreachable: list[str] = []

    first_valid = trio.Event()

    def consider(raw: bytes | NameRecord, source: str) -> None:
        try:
            found.append(
                verify(raw, now=now, publisher=target.publisher, name=target.name, trust=trust)
            )
            first_valid.set()
        except NameRejected as exc:
            log.info("refused a record for %s from %s: %s", target, source, exc)
            refused[exc.reason.value] += 1

    await trio.to_thread.run_sync(service._reload_key, key, now)
    held = service.cache.get(key)
    if held is not None:
        consider(held, "the local cache")
    if found and target.publisher == service.own_publisher:
        return found[0]  # a publisher's cache holds its newest record

    async def ask(peer: str) -> None:
        try:
            response = await request(node, peer, wire.GetRequest(key))
        except CatalogError as exc:
            unreachable.append(str(exc))
            return
        if isinstance(response, wire.RecordResponse) and response.record is not None:
            consider(response.record, peer)

    dht = node.dht

    async def ask_dht() -> None:
        if dht is None:
            return
        try:
            value = await dht.get_value(dht_key(target.publisher, target.name))
        except Exception as exc:  # a failed DHT lookup just finds nothing
            log.info("DHT get of %s failed: %r", target, exc)
            return
        if value is not None:
            consider(value, "the DHT")

    async def ask_all(done: trio.CancelScope) -> None:
        async with trio.open_nursery() as nursery:
            if use_peers:
                for peer in node.connected_peers()[:MAX_RESOLVE_PEERS]:
                    nursery.start_soon(ask, peer)
            if use_dht and dht is not None:
                nursery.start_soon(ask_dht)
        done.cancel()  # everyone answered

    async def settle(done: trio.CancelScope) -> None:
        await first_valid.wait()
        await trio.sleep(RESOLVE_GRACE)
        done.cancel()

    with trio.move_on_after(wait_s):
        async with trio.open_nursery() as outer:
            outer.start_soon(ask_all, outer.cancel_scope)
            outer.start_soon(settle, outer.cancel_scope)
    best = newest(found)
    if best is None:
        detail = ", ".join(f"{n} {why}" for why, n in sorted(refused.items()))
        raise NameNotFound(
            f"no valid record for {target}"
            + (f" (refused: {detail})" if detail else "")
            + f"; asked the local cache, {min(len(node.connected_peers()), MAX_RESOLVE_PEERS)}"
            f" connected peer(s){' and the DHT' if use_dht and node.dht is not None else ''}"
        )
    try:
        await service.take(best, now=now, asked=True)
    except StoreError as exc:  # caching what was resolved is a courtesy to others
        log.warning("cannot keep %s: %s", best.describe(), exc)
    return best


async def catalog(
    node: Node,
    publisher: str,
    *,
    now: float | None = None,
    trust: TrustStore | None = None,
    use_peers: bool = True,
) -> list[NameRecord]:
    """What ``publisher`` has named, as far as this node and its connected peers know
    (the DHT is keyed by name and cannot list): the newest valid record per name,
    sorted by name, at most ``MAX_RECORDS_PER_PUBLISHER``."""
    parse_ref(f"{publisher}/x")  # BadName for a malformed publisher
    service = service_of(node)
    now = service.clock() if now is None else now
    best: dict[str, NameRecord] = {}

    def consider(raw: bytes | NameRecord) -> None:
        try:
            record = verify(raw, now=now, publisher=publisher, trust=trust)
        except NameRejected as exc:
            log.info("refused a catalog record: %s", exc)
            return
        held = best.get(record.name)
        if held is None or order_key(record) > order_key(held):
            best[record.name] = record

    await trio.to_thread.run_sync(service._reload_all, now)
    for record in service.cache.by_publisher(publisher):
        consider(record)

    async def ask(peer: str) -> None:
        try:
            response = await request(node, peer, wire.ListRequest(publisher))
        except CatalogError as exc:
            log.info("catalog: %s", exc)
            return
        if isinstance(response, wire.RecordsResponse):
            for raw in response.records:
                consider(raw)

    if use_peers:
        with trio.move_on_after(RESOLVE_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for peer in node.connected_peers()[:MAX_RESOLVE_PEERS]:
                    nursery.start_soon(ask, peer)
    return [best[name] for name in sorted(best)][:MAX_RECORDS_PER_PUBLISHER]


async def run_names(node: Node, *, poll: float = NAMES_POLL) -> None:
    """Background task of a serving node (start it in the node's nursery): spread this
    node's own records at start, whenever another process sharing the store writes a
    new one (``blob publish`` beside ``blob serve``), and into the DHT again every
    ``REPUBLISH_INTERVAL``. Runs until cancelled."""
    service = service_of(node)
    spread_at: dict[bytes, tuple[float, tuple[int, int, bytes]]] = {}
    while True:
        now = service.clock()
        await trio.to_thread.run_sync(service._reload_all, now)
        for record in service.cache.by_publisher(service.own_publisher):
            if not _live(record, now):
                continue
            last = spread_at.get(record.key)
            if last is None or last[1] != order_key(record) or now - last[0] >= REPUBLISH_INTERVAL:
                spread_at[record.key] = (now, order_key(record))
                try:
                    await publish_record(node, record, now=now)
                except NameRejected as exc:  # superseded meanwhile: the newer one goes next
                    log.info("not spreading %s: %s", record.describe(), exc)
        await trio.sleep(poll)
