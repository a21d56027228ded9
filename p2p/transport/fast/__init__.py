"""blobnet's fast libp2p data path: wire-compatible `/noise` and `/yamux/1.0.0`.

Use with py-libp2p::

    host = new_host(key_pair=kp, sec_opt=security_options(kp), muxer_opt=muxer_options())
    install(host)          # py-libp2p would otherwise build its own Yamux for /yamux/1.0.0

Streams then behave like py-libp2p's yamux streams, wrapped in its NetStream as usual:
`read(n)` returns up to n bytes and raises `StreamEOF` once the peer has closed its side
(exactly as py-libp2p's own yamux does; it never returns b""), `write(b)` blocks while the
peer's window is full (no timeout: use a cancel scope), `close()` half-closes, `reset()`
aborts both ways. `read_into(stream, buf)` / `read_exactly_into(stream, buf)` receive straight
into your buffer (decrypted in place where frames allow) and return 0 / a short count at EOF;
on other stacks they fall back to `read` plus one copy.

Modules: `noise_frames` and `yamux_core` are the sans-IO protocol cores (fuzzed); `noise`
and `yamux` are the trio shells; `upgrade` swaps py-libp2p's muxer negotiator.
"""

from __future__ import annotations

from typing import Any

from libp2p.abc import ISecureTransport
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TMuxerOptions, TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.stream_muxer.exceptions import MuxedStreamEOF

from .errors import (
    FastPathError,
    LocalProtocolError,
    NoiseProtocolError,
    RemoteProtocolError,
    YamuxProtocolError,
)
from .noise import PROTOCOL_ID as NOISE_PROTOCOL_ID
from .noise import FastNoiseTransport, FastSecureConn, socket_rtt
from .upgrade import FastMuxerMultistream, install
from .yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from .yamux import FastYamuxConn, FastYamuxStream

FAST_PATH_AVAILABLE = True


def security_options(key_pair: KeyPair) -> dict[TProtocol, ISecureTransport]:
    """`sec_opt` for `new_host`: our Noise transport under `/noise`."""
    return {NOISE_PROTOCOL_ID: FastNoiseTransport(key_pair)}


def muxer_options() -> TMuxerOptions:
    """`muxer_opt` for `new_host`: our yamux under `/yamux/1.0.0` (needs `install(host)`)."""
    return {TProtocol(YAMUX_PROTOCOL_ID): FastYamuxConn}


def fast_stream_of(stream: Any) -> FastYamuxStream | None:
    """The fast muxed stream under a py-libp2p NetStream (or the stream itself), if any."""
    muxed = getattr(stream, "muxed_stream", stream)
    return muxed if isinstance(muxed, FastYamuxStream) else None


def kernel_rtt(stream: Any) -> float | None:
    """The kernel's smoothed RTT (seconds) of the TCP connection under a fast-path stream,
    or None (another stack, another OS, no sample yet). Unlike timing a request, it holds
    no muxer negotiation and no server time."""
    fast = fast_stream_of(stream)
    return connection_rtt(fast.muxed_conn) if fast is not None else None


def connection_rtt(muxed_conn: Any) -> float | None:
    """`kernel_rtt` of a fast-path muxed connection (a py-libp2p swarm connection's
    ``muxed_conn``); None on another stack."""
    return socket_rtt(getattr(getattr(muxed_conn, "secured_conn", None), "sock", None))


async def read_into(stream: Any, buf: Any) -> int:
    """Read up to len(buf) bytes from `stream` into `buf`; 0 at EOF, on any py-libp2p stream.

    On the fast path the bytes are decrypted straight into `buf` when a frame allows it;
    on other stacks this falls back to `read` plus one copy.
    """
    out = memoryview(buf).cast("B")
    fast = fast_stream_of(stream)
    if fast is not None:
        return await fast.readinto(out)
    try:
        data = await stream.read(len(out))
    except (StreamEOF, MuxedStreamEOF):
        return 0
    n = len(data)
    out[:n] = data
    return n


async def read_exactly_into(stream: Any, buf: Any) -> int:
    """Fill `buf` completely unless EOF comes first; returns the number of bytes read."""
    out = memoryview(buf).cast("B")
    pos = 0
    while pos < len(out):
        n = await read_into(stream, out[pos:])
        if n == 0:
            break
        pos += n
    return pos


__all__ = [
    "FAST_PATH_AVAILABLE",
    "NOISE_PROTOCOL_ID",
    "YAMUX_PROTOCOL_ID",
    "FastMuxerMultistream",
    "FastNoiseTransport",
    "FastPathError",
    "FastSecureConn",
    "FastYamuxConn",
    "FastYamuxStream",
    "LocalProtocolError",
    "NoiseProtocolError",
    "RemoteProtocolError",
    "YamuxProtocolError",
    "connection_rtt",
    "fast_stream_of",
    "install",
    "kernel_rtt",
    "muxer_options",
    "read_exactly_into",
    "read_into",
    "security_options",
]
