"""Building the libp2p host: Noise and yamux only, a resource manager that is really there.

py-libp2p's defaults also offer TLS with 4 KiB reads, secio, ``/plaintext/2.0.0`` and
mplex (unbounded varint frames). A blobnet node offers exactly one security transport
(Noise) and one muxer (yamux), so a peer that asks for anything else fails negotiation.
When blobnet's fast data path (``p2p.fast``) is importable it replaces py-libp2p's Noise
data path and yamux under the same protocol IDs; ``fast=False`` keeps py-libp2p's own.
"""

from __future__ import annotations

import importlib
from typing import Any

from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.rcmgr import ResourceLimits, new_resource_manager
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

# Connection and stream ceilings for the whole host. A blob node talks to tens of peers,
# each with a handful of streams (DESIGN section 4); these leave room for a DHT as well.
MAX_CONNECTIONS = 512
MAX_STREAMS = 4096
MAX_MEMORY_MB = 1024
# Connections one peer may hold to us, and we to it. One TCP connection cannot carry a
# long fat link (stock kernels cap its buffers at a few MiB: ~13 MB/s at 200 ms RTT, 75 MB/s
# with 8 connections; issue 15), so a fetch stripes its streams over several connections
# to one provider. py-libp2p's default is 3.
MAX_CONNECTIONS_PER_PEER = 8


class HostConfigError(RuntimeError):
    """The host could not be built as blobnet requires (a local bug, not a user error)."""


def _fast_path() -> Any | None:
    """``p2p.fast`` when it is importable and ready, else None (py-libp2p's own stack)."""
    try:
        module = importlib.import_module("p2p.fast")
    except ImportError:
        return None
    return module if getattr(module, "FAST_PATH_AVAILABLE", False) else None


def fast_path_available() -> bool:
    return _fast_path() is not None


def security_options(key_pair: KeyPair, *, fast: bool) -> dict[TProtocol, Any]:
    fast_path = _fast_path() if fast else None
    if fast_path is not None:
        return dict(fast_path.security_options(key_pair))
    noise_key = create_new_x25519_key_pair().private_key
    return {TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(key_pair, noise_privkey=noise_key)}


def muxer_options(*, fast: bool) -> dict[TProtocol, Any]:
    fast_path = _fast_path() if fast else None
    if fast_path is not None:
        return dict(fast_path.muxer_options())
    return {TProtocol(YAMUX_PROTOCOL_ID): Yamux}


def build_host(
    key_pair: KeyPair,
    *,
    fast: bool = True,
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
) -> IHost:
    """A host offering Noise + yamux only, with an explicit resource manager.

    ``max_connections_per_peer`` bounds the connections to (and from) one peer; a fetcher
    opens several to one provider to stripe a long fat link.
    """
    connection_config = ConnectionConfig(max_connections_per_peer=max_connections_per_peer)
    resource_manager = new_resource_manager(
        limits=ResourceLimits(
            max_connections=MAX_CONNECTIONS,
            max_memory_mb=MAX_MEMORY_MB,
            max_streams=MAX_STREAMS,
        )
    )
    sec_opt = security_options(key_pair, fast=fast)
    muxer_opt = muxer_options(fast=fast)
    host = new_host(
        key_pair=key_pair,
        sec_opt=sec_opt,
        muxer_opt=muxer_opt,
        resource_manager=resource_manager,
        connection_config=connection_config,
    )
    fast_path = _fast_path() if fast else None
    if fast_path is not None:
        # py-libp2p 0.8.1 builds its own Yamux for /yamux/1.0.0 whatever muxer_opt says;
        # install() makes the upgrader build ours.
        fast_path.install(host)
    network: Any = host.get_network()
    upgrader = network.upgrader
    offered = set(upgrader.security_multistream.transports)
    if offered != set(sec_opt):
        raise HostConfigError(f"host offers security {sorted(offered)}, expected {sorted(sec_opt)}")
    muxers = set(upgrader.muxer_multistream.transports)
    if muxers != set(muxer_opt):
        raise HostConfigError(f"host offers muxers {sorted(muxers)}, expected {sorted(muxer_opt)}")
    if getattr(network, "_resource_manager", resource_manager) is None:
        raise HostConfigError("libp2p silently dropped the resource manager")
    return host
