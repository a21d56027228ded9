"""Tickets: a blob ID and the addresses of peers that provide it, in one copyable string.

Format: ``blob1`` followed by unpadded lowercase base32 of a canonical msgpack map
``{"id": <32 bytes>, "addrs": [<multiaddr string with /p2p/>, ...]}``. The ``blob1`` prefix
versions the format and makes tickets recognisable next to bare 64-hex IDs.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import msgpack
from multiaddr import Multiaddr

from p2p.errors import BadTicket

TICKET_PREFIX = "blob1"
# A ticket is pasted by people and passed on command lines: 64 addresses is plenty and
# keeps it under a few KiB.
MAX_TICKET_ADDRS = 64
MAX_TICKET_CHARS = 16 * 1024


@dataclass(frozen=True)
class Ticket:
    blob_id: str
    addrs: tuple[str, ...]

    def encode(self) -> str:
        body = msgpack.packb(
            {"id": bytes.fromhex(self.blob_id), "addrs": list(self.addrs)}, use_bin_type=True
        )
        return TICKET_PREFIX + base64.b32encode(body).decode("ascii").rstrip("=").lower()

    @classmethod
    def decode(cls, text: str) -> Ticket:
        if not text.startswith(TICKET_PREFIX) or len(text) > MAX_TICKET_CHARS:
            raise BadTicket("not a blobnet ticket (it should start with 'blob1')")
        encoded = text[len(TICKET_PREFIX) :].upper()
        encoded += "=" * (-len(encoded) % 8)
        try:
            body = base64.b32decode(encoded)
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except (binascii.Error, ValueError, msgpack.UnpackException) as exc:
            raise BadTicket(f"ticket is corrupt: {exc}") from None
        if not isinstance(obj, dict) or set(obj) != {"id", "addrs"}:
            raise BadTicket("ticket has unexpected fields")
        raw_id, addrs = obj["id"], obj["addrs"]
        if not isinstance(raw_id, bytes) or len(raw_id) != 32:
            raise BadTicket("ticket's blob ID is not 32 bytes")
        if not isinstance(addrs, list) or not 0 < len(addrs) <= MAX_TICKET_ADDRS:
            raise BadTicket(f"ticket must carry 1..{MAX_TICKET_ADDRS} addresses")
        for addr in addrs:
            if not isinstance(addr, str):
                raise BadTicket("ticket address is not a string")
            validate_peer_addr(addr, error=BadTicket)
        return cls(blob_id=raw_id.hex(), addrs=tuple(addrs))


def validate_peer_addr(addr: str, *, error: type[Exception] = BadTicket) -> Multiaddr:
    """Parse a multiaddr that must end in ``/p2p/<peer id>``; ``error`` carries a plain
    one-line reason (no multiaddr internals) when it does not."""
    try:
        maddr = Multiaddr(addr)
    except Exception as exc:  # multiaddr raises many unrelated types for bad text
        raise error(f"bad peer address {addr!r}: {_plain_reason(exc)}") from None
    if "p2p" not in [protocol.name for protocol in maddr.protocols()]:
        raise error(
            f"peer address {addr!r} lacks /p2p/<peer id> "
            "(the full form is /ip4/HOST/tcp/PORT/p2p/12D3KooW...)"
        )
    return maddr


# py-multiaddr's message around the reason: "Invalid MultiAddr '<text>': <reason>
# (string: <text>)".
_MULTIADDR_WRAPPER = re.compile(r"^Invalid MultiAddr '.*?': (?P<reason>.*?)(?: \(string: .*\))?$")


def _plain_reason(exc: Exception) -> str:
    text = str(exc).replace("\n", " ")
    match = _MULTIADDR_WRAPPER.match(text)
    return match.group("reason") if match else text
