"""Bytes on the wire, counted at this process's TCP sockets: everything a worker sends
(announcements, closures, gossip, framing), not only the update blobs a benchmark asks for.

The kernel keeps, per TCP socket, the payload bytes the peer acknowledged
(``tcpi_bytes_acked``) and the payload bytes received (``tcpi_bytes_received``); every
byte libp2p moves (gossipsub announcements, closures, attestations, blob fetches in both
directions, handshakes) is in them, framing and encryption included, TCP/IP headers not.
:class:`WireMeter` samples all of this process's sockets and keeps the largest value seen
per socket, so a connection that closes between samples loses at most what moved since
the last sample (the worker samples every ``SAMPLE_INTERVAL`` and at each round).

Linux only; elsewhere :func:`socket_bytes` returns nothing and the counts stay 0.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field

# Offsets of tcpi_bytes_acked and tcpi_bytes_received in struct tcp_info (linux/tcp.h,
# stable since Linux 4.1 / 4.2); the struct is read whole, 232 bytes in recent kernels.
_BYTES_ACKED = 120
_BYTES_RECEIVED = 128
_TCP_INFO_LEN = 232
SAMPLE_INTERVAL = 0.5


def socket_bytes() -> dict[int, tuple[int, int]]:
    """Socket inode -> (bytes sent and acknowledged, bytes received) for this process's
    TCP sockets."""
    out: dict[int, tuple[int, int]] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        inode = int(target[8:-1])
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            continue
        finally:
            sock.close()  # closes our duplicate only; the original stays open
        if len(info) >= _BYTES_RECEIVED + 8:
            (acked,) = struct.unpack_from("<Q", info, _BYTES_ACKED)
            (received,) = struct.unpack_from("<Q", info, _BYTES_RECEIVED)
            out[inode] = (max(0, acked - 1), received)  # the SYN counts one acked byte
    return out


@dataclass
class WireMeter:
    """Running totals over every TCP socket this process has had."""

    seen: dict[int, tuple[int, int]] = field(default_factory=dict)

    def sample(self) -> tuple[int, int]:
        for inode, (sent, received) in socket_bytes().items():
            old = self.seen.get(inode, (0, 0))
            # A reused inode starts again from zero: keep what the old socket had moved.
            if sent < old[0] or received < old[1]:
                self.seen[-len(self.seen) - 1] = old
                old = (0, 0)
            self.seen[inode] = (max(old[0], sent), max(old[1], received))
        return self.totals()

    def totals(self) -> tuple[int, int]:
        return sum(s for s, _ in self.seen.values()), sum(r for _, r in self.seen.values())
