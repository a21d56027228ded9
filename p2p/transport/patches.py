"""Every place blobnet reaches into py-libp2p 0.8.1's private attributes, each with its reason.

Theory of operation:
1. Each patch is one function here that takes the object it patches (a swarm, a host, a
   resource manager) and replaces an attribute on that instance only, never on
   py-libp2p's classes: two hosts in one process (tests, a relay beside a node) patch
   their own objects.
2. Before replacing anything a patch looks the attribute up with ``_require``; a
   py-libp2p that renamed or dropped it raises ``PatchTargetMissing`` at start-up
   instead of silently running unpatched. ``TARGETS`` lists every (class, attribute)
   a patch needs, and tests/p2p/test_patches.py fails when one disappears.
3. A patch keeps py-libp2p's own behaviour around the part it changes (it wraps the
   original and calls it), so a fix upstream makes the patch a no-op, not a conflict.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.host.basic_host import BasicHost
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.network.swarm import Swarm
from libp2p.rcmgr.manager import ResourceManager
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol


class PatchTargetMissing(RuntimeError):
    """py-libp2p no longer has an attribute blobnet patches (a local error: this
    py-libp2p is not the one the patch was written for)."""


# (class, attribute, why blobnet patches it). Each line is checked by the patches test.
TARGETS: tuple[tuple[type, str, str], ...] = (
    (
        Swarm,
        "upgrade_inbound_raw_conn",
        "its clean-up awaits the raw close before releasing the pre-upgrade connection "
        "scope, so a cancelled handshake leaks one resource-manager slot",
    ),
    (
        Swarm,
        "_dial_addr_single_attempt",
        "same leak on a dial cancelled during its handshake",
    ),
    (
        Swarm,
        "_resource_manager",
        "the manager whose open_connection the scope release records",
    ),
    (
        ResourceManager,
        "open_connection",
        "records the scopes an upgrade opened, so a failed one releases them",
    ),
    (
        Swarm,
        "_handle_inbound_connection",
        "py-libp2p's handler admits through a slot counter it never gives back; "
        "p2p.transport.host.InboundGate replaces it",
    ),
    (
        Swarm,
        "_build_remote_multiaddr",
        "the replacement inbound handler asks py-libp2p's connection gate as it would",
    ),
    (
        Swarm,
        "_select_connection",
        "picks which of a peer's connections a new stream uses (one with the most "
        "streams by default), so striped fetches choose their own",
    ),
    (
        KadDHT,
        "provider_store",
        "py-libp2p stores every ADD_PROVIDER's addresses, without caps, for 48 h; "
        "p2p.transport.providers decides what is kept",
    ),
    (
        KadDHT,
        "handle_stream",
        "py-libp2p reads a Kademlia request of up to 4 MiB and parses all of it (400,000 "
        "addresses in one ADD_PROVIDER) before any cap applies; limit_kad_requests wraps it",
    ),
    (
        ProviderStore,
        "add_provider",
        "where an accepted ADD_PROVIDER is stored: the guard filters it first",
    ),
    (
        ProviderStore,
        "providers",
        "the records by key and peer: the guard drops the ones it evicts",
    ),
    (
        BasicHost,
        "get_addrs",
        "a NATed node hands out relay circuit addresses that addrs_factory would mangle",
    ),
    (
        DCUtRProtocol,
        "_auto_drive_loop",
        "it starts a second DCUtR session to a peer whose own session is on its way (every "
        "2 s, to each relayed peer); blobnet's dialler starts the only one",
    ),
    (
        DCUtRProtocol,
        "_dial_peer",
        "its hole-punch dial sends one SYN a window; p2p.nat.holepunch retries it after "
        "a router's reset or ICMP refusal",
    ),
)
# Set at run time, so not in TARGETS: DCUtRProtocol registers itself on its host as
# ``_dcutr_protocol`` and never leaves (tests/p2p/test_patches.py checks it on a running
# one).
DCUTR_ATTRIBUTE = "_dcutr_protocol"


def _require(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise PatchTargetMissing(
            f"py-libp2p's {type(obj).__name__} has no {name!r}: blobnet's patch of it "
            "needs updating for this py-libp2p version"
        ) from None


# --- Connection scopes of failed upgrades --------------------------------------------------
#
# py-libp2p 0.8.1 (network/swarm.py, Swarm.upgrade_inbound_raw_conn) takes a pre-upgrade
# connection scope from the resource manager, and on any failure runs a clean-up that
# first awaits the muxed, secured and raw connections' close and only then closes the
# scope. When the failure is a cancellation (the upgrade's caller cancelled it: our inbound
# gate dropping a handshake, a dial abandoned mid-handshake), the first await in that
# clean-up raises Cancelled again and ``pre_scope.close()`` never runs. Each such upgrade
# keeps one of the manager's connection slots for the life of the process; after
# ``max_connections`` of them every new connection is refused ("Connection denied by
# resource manager (pre-upgrade admission)"). The dial path
# (``_dial_addr_single_attempt``) has the same order in its BaseException handler.
#
# The patch records every connection scope opened while an upgrade runs (the task's
# context variable below) and, when the upgrade ends in any exception, closes them all.
# A scope's close is idempotent, so scopes py-libp2p did release are not released twice.
# One case errs the other way: an upgrade cancelled inside ``add_conn`` after the swarm
# registered its connection has that live connection's scope released early: an
# undercount of one until it closes, never a slot lost for good.

_UPGRADE_SCOPES: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "blobnet_upgrade_scopes", default=None
)


def release_scopes_of_failed_upgrades(network: Any) -> None:
    """Make ``network``'s inbound upgrades and outbound dials give their resource-manager
    connection scopes back when they fail or are cancelled (see above)."""
    manager = _require(network, "_resource_manager")
    if manager is None:
        return
    open_connection: Callable[..., Any] = _require(manager, "open_connection")

    def recording_open_connection(*args: Any, **kwargs: Any) -> Any:
        scope = open_connection(*args, **kwargs)
        held = _UPGRADE_SCOPES.get()
        if scope is not None and held is not None:
            held.append(scope)
        return scope

    manager.open_connection = recording_open_connection
    for name in ("upgrade_inbound_raw_conn", "_dial_addr_single_attempt"):
        setattr(network, name, _releasing_scopes(_require(network, name)))


def _releasing_scopes(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def upgrade(*args: Any, **kwargs: Any) -> Any:
        held: list[Any] = []
        token = _UPGRADE_SCOPES.set(held)
        try:
            return await original(*args, **kwargs)
        except BaseException:
            for scope in held:
                close = getattr(scope, "close", None)
                if close is not None:
                    close()
            raise
        finally:
            _UPGRADE_SCOPES.reset(token)

    return upgrade


def resource_manager(network: Any) -> Any:
    """``network``'s resource manager (None if it has none): py-libp2p keeps it private."""
    return _require(network, "_resource_manager")


# --- The inbound handler -------------------------------------------------------------------


def route_inbound(network: Any, handle: Callable[[Any, Any], Awaitable[None]]) -> Any:
    """Send ``network``'s new inbound sockets to ``handle`` instead of py-libp2p's handler
    (which admits through a slot counter it never gives back; p2p.transport.host's theory
    of operation). Returns py-libp2p's handler, for connections that are not ours to gate."""
    original = _require(network, "_handle_inbound_connection")
    network._handle_inbound_connection = handle
    return original


def remote_multiaddr(network: Any, read_write_closer: Any) -> Any:
    """The multiaddr py-libp2p's connection gate is asked about for an inbound socket."""
    return _require(network, "_build_remote_multiaddr")(read_write_closer)


# --- Provider records ----------------------------------------------------------------------


def guard_provider_store(kad: Any, guard: Any, clock: Callable[[], float]) -> None:
    """Pass every provider record ``kad`` would store through ``guard``
    (p2p.transport.providers.ProviderGuard): py-libp2p 0.8.1 stores them all, every
    address included, for 48 h. ``clock`` is the wall clock py-libp2p's records use."""
    from libp2p.peer.peerinfo import PeerInfo

    store = _require(kad, "provider_store")
    original: Callable[[bytes, Any], None] = _require(store, "add_provider")
    records: dict[bytes, dict[str, Any]] = _require(store, "providers")

    def add_provider(key: bytes, provider: Any) -> None:
        if not provider or not getattr(provider, "peer_id", None):
            return
        now = clock()
        for gone_key, gone_peer in guard.expire(now):
            records.get(gone_key, {}).pop(gone_peer, None)
        decision = guard.admit(key, str(provider.peer_id), list(provider.addrs), now)
        for drop_key, drop_peer in decision.drop:
            held = records.get(drop_key)
            if held is not None:
                held.pop(drop_peer, None)
                if not held:
                    del records[drop_key]
        if decision.addrs is None:
            return
        original(key, PeerInfo(provider.peer_id, decision.addrs))
        if str(provider.peer_id) not in records.get(key, {}):
            guard.forget(key, str(provider.peer_id))  # py-libp2p's own per-key cap said no

    store.add_provider = add_provider


# --- Kademlia request size -----------------------------------------------------------------
#
# py-libp2p 0.8.1's KadDHT.handle_stream reads each varint-prefixed request of up to its
# MAX_DHT_MESSAGE_SIZE (4 MiB) whole and hands it to protobuf, which builds one Python
# object per address: an ADD_PROVIDER naming 400,000 addresses costs the handler hundreds
# of MiB and seconds of CPU before the provider guard keeps 8 of them. The patch wraps
# the stream each request is read from: once a request's length prefix is in and names
# more than the limit, the read fails with py-libp2p's own MessageTooLarge (its handler
# then resets the stream, as for its own limit), so the body is neither read nor parsed.

# The largest inbound Kademlia request blobnet takes. What a peer sends us is a query (a
# key and its signed peer record, a few KiB), an ADD_PROVIDER (its addresses: go-libp2p
# sends a few dozen of ~30-100 bytes) or a PUT_VALUE of a name record (at most 5 KiB,
# p2p.names.record's MAX_NAME_RECORD_SIZE): 64 KiB is over ten times the largest.
MAX_KAD_REQUEST_BYTES = 64 * 1024


def limit_kad_requests(kad: Any, max_bytes: int = MAX_KAD_REQUEST_BYTES) -> None:
    """Refuse ``kad``'s inbound requests over ``max_bytes`` before they are read or parsed
    (see above); registered again on its host where it serves now, and found by
    py-libp2p's own mode switch (it registers ``self.handle_stream``)."""
    from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL_ID
    from libp2p.kad_dht.kad_dht import DHTMode

    original: Callable[[Any], Awaitable[None]] = _require(kad, "handle_stream")

    async def handle_stream(stream: Any) -> None:
        await original(_CappedKadStream(stream, max_bytes))

    kad.handle_stream = handle_stream
    if _require(kad, "mode") == DHTMode.SERVER:
        _require(kad, "host").set_stream_handler(KAD_PROTOCOL_ID, handle_stream)


class _CappedKadStream:
    """A Kademlia stream whose reads follow the varint-prefixed framing and fail with
    MessageTooLarge as soon as a prefix names more than ``max_bytes`` (sans-IO framing,
    the stream's other methods passed through)."""

    def __init__(self, stream: Any, max_bytes: int) -> None:
        self._stream = stream
        self._max = max_bytes
        self._prefix = 0  # the length being decoded
        self._shift = 0
        self._body_left = 0  # bytes of the current request still to come
        self.refused: int | None = None  # the length named by the refused prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        from libp2p.io.exceptions import MessageTooLarge

        if self.refused is not None:
            raise MessageTooLarge(f"Kademlia request of {self.refused} bytes refused")
        data: bytes = await self._stream.read(n)
        i = 0
        while i < len(data):
            if self._body_left:
                taken = min(self._body_left, len(data) - i)
                self._body_left -= taken
                i += taken
                continue
            byte = data[i]
            i += 1
            self._prefix |= (byte & 0x7F) << self._shift
            self._shift += 7
            if byte & 0x80 and self._shift < 64:
                continue
            length, self._prefix, self._shift = self._prefix, 0, 0
            if length > self._max:
                self.refused = length
                raise MessageTooLarge(
                    f"Kademlia request of {length} bytes is over blobnet's {self._max}"
                )
            self._body_left = length
        return data


# --- Connection choice ---------------------------------------------------------------------


def wrap_select_connection(
    swarm: Any, make: Callable[[Any], Callable[[list[Any], Any], Any]]
) -> bool:
    """Replace the swarm's choice of which of a peer's connections a new stream uses with
    ``make(original)`` (py-libp2p 0.8.1's ``Swarm.new_stream`` calls ``_select_connection``;
    by default the connection with the most streams, which piles every stream onto one TCP
    connection). Wrapping only that keeps the rest of ``new_stream`` as py-libp2p does it.
    Once per swarm; False if this py-libp2p has no such hook (streams then go where it
    puts them)."""
    original = getattr(swarm, "_select_connection", None)
    if original is None or getattr(original, "_blobnet", False):
        return original is not None
    select = make(original)
    select._blobnet = True  # type: ignore[attr-defined]
    swarm._select_connection = select
    return True


# --- Advertised addresses ------------------------------------------------------------------


def advertise_addrs(host: Any, extra: list[Any]) -> None:
    """Make ``host.get_addrs()`` name ``extra`` multiaddrs too, after its own. Not through
    py-libp2p's ``addrs_factory``: ``BasicHost.get_addrs`` (0.8.1, host/basic_host.py)
    strips an address's first ``/p2p/`` component and appends ours, which turns
    ``.../p2p/<relay>/p2p-circuit/p2p/<us>`` into the relay's bare address. Built on the
    host's addresses as the node already shaped them (``advertise_interfaces``)."""
    _require(type(host), "get_addrs")
    own = host.get_addrs

    def get_addrs() -> list[Any]:
        return [*own(), *extra]

    host.get_addrs = get_addrs


def advertise_interfaces(host: Any) -> None:
    """Make ``host.get_addrs()`` name each interface's address in place of a wildcard
    listen address (``/ip4/0.0.0.0/...``). Identify tells every peer we connect to what
    ``get_addrs`` returns, and a seeder's ``peers`` answers (p2p.blob.swarm rule 2) list
    those addresses to our fellow fetchers. A wildcard address is dialable by nobody and
    is not listed, so without this, fetchers listening on every interface (``blob get``'s
    default with a remote peer) would never learn of each other. DHT provider records
    name the same addresses."""
    from multiaddr import Multiaddr

    from p2p.transport.addresses import dialable_addrs

    own = _require(type(host), "get_addrs").__get__(host)

    def get_addrs() -> list[Any]:
        return [Multiaddr(a) for a in dialable_addrs([str(a) for a in own()])]

    host.get_addrs = get_addrs


# --- DCUtR ---------------------------------------------------------------------------------


def running_dcutr(host: Any) -> Any:
    """The DCUtR service registered on ``host``, or None."""
    return getattr(host, DCUTR_ATTRIBUTE, None)


def replace_dcutr_dial(dcutr: Any, make: Callable[[Any], Any]) -> None:
    """Make ``dcutr``'s hole-punch dials ``make(original)``: py-libp2p 0.8.1's
    ``DCUtRProtocol._perform_hole_punch`` dials every address of a round through
    ``self._dial_peer(peer_id, addr, source, as_responder)`` (and its unilateral upgrade
    through the same, without ``source``). Once per service."""
    original = _require(dcutr, "_dial_peer")
    if getattr(original, "_blobnet", False):
        return
    dial = make(original)
    dial._blobnet = True
    dcutr._dial_peer = dial


def stop_dcutr_auto_drive(dcutr: Any) -> None:
    """Keep ``dcutr`` from starting hole punches on its own: py-libp2p 0.8.1's
    ``DCUtRProtocol.run`` starts ``self._auto_drive_loop``, which every 2 s opens a DCUtR
    session to each peer connected only through a relay, as the DCUtR spec has the
    relayed connection's inbound peer do. blobnet's dialler opens one as soon as its
    relayed connection is up (p2p.nat.punch), and a second session crossing it runs a
    second punch with the opposite roles: each side may then dial as the Noise responder
    of a different session, and the connection their SYNs make never finishes its
    handshake. Before the service runs."""
    _require(dcutr, "_auto_drive_loop")

    async def idle() -> None:
        await trio.sleep_forever()

    dcutr._auto_drive_loop = idle


def forget_dcutr(host: Any, dcutr: Any) -> None:
    """Take a stopped DCUtR service off its host: DCUtRProtocol registers itself there and
    never leaves, and the next user (p2p.nat.punch) must not find a stopped one."""
    if getattr(host, DCUTR_ATTRIBUTE, None) is dcutr:
        delattr(host, DCUTR_ATTRIBUTE)
