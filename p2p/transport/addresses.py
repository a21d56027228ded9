"""Dialable addresses for a node that listens on the wildcard address.

py-libp2p reports ``/ip4/0.0.0.0/tcp/PORT`` for a node listening on every interface,
which no peer can dial. :func:`dialable_addrs` replaces each such address with one per
IPv4 address of this machine's interfaces (others first, loopback last), as ``blob serve``
prints them and tickets carry them.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Sequence

WILDCARD_IP4 = "/ip4/0.0.0.0/"
# Linux's ioctl that reads an interface's IPv4 address (linux/sockios.h).
SIOCGIFADDR = 0x8915
# Interfaces looked at: a host with more is unusual, and the list only feeds a ready line.
MAX_INTERFACES = 256


def interface_ipv4s() -> list[str]:
    """This machine's IPv4 interface addresses: non-loopback ones first, then loopback."""
    found: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex()[:MAX_INTERFACES]:
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # down, or no IPv4 address
                continue
            address = socket.inet_ntoa(answer[20:24])
            if address not in found:
                found.append(address)
    if "127.0.0.1" not in found:
        found.append("127.0.0.1")
    return sorted(found, key=lambda a: ipaddress.IPv4Address(a).is_loopback)


def dialable_addrs(addrs: Sequence[str]) -> list[str]:
    """``addrs`` with every ``/ip4/0.0.0.0/...`` expanded into the interface addresses."""
    out: list[str] = []
    for addr in addrs:
        if addr.startswith(WILDCARD_IP4):
            rest = addr[len(WILDCARD_IP4) :]
            out.extend(f"/ip4/{ip}/{rest}" for ip in interface_ipv4s())
        else:
            out.append(addr)
    return list(dict.fromkeys(out))
