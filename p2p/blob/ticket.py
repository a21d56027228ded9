"""Tickets: a blob ID and the addresses of peers that provide it, in one copyable string.

The body is a canonical msgpack map ``{"id": <32 bytes>, "addrs": [<multiaddr string with
/p2p/>, ...]}``. Two forms, told apart by the character after ``blob1``:

1. ``blob1p...`` (written since tickets got a checksum): bech32m (BIP 350) with human
   part ``blob``: the data symbols are the version (1, written ``p``) and the body in 5-bit
   groups, then bech32m's six checksum symbols over all of them. One changed, swapped or
   lost character makes the checksum fail instead of naming another blob; bech32's length
   limit of 90 characters is not applied (a ticket with addresses is longer; its
   checksum still catches any single changed character, and most other damage).
2. ``blob1q...`` (the first tickets, still read): unpadded lowercase base32 of the body,
   with no checksum. Its first character is always ``q``: the body starts with msgpack's
   byte for a two-key map, 0x82.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from multiaddr import Multiaddr

from blobstore.canonical import decode_map, require_canonical
from blobstore.canonical import encode as encode_canonical
from p2p.errors import BadTicket

TICKET_PREFIX = "blob1"
# bech32m (BIP 350): its alphabet, generator and final constant.
BECH32_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_BECH32_INDEX = {c: i for i, c in enumerate(BECH32_CHARSET)}
_BECH32M_CONST = 0x2BC830A3
_GENERATOR = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)
_HRP = "blob"
# The data part's first symbol: the ticket format's version (1 is written 'p').
TICKET_VERSION = 1
CHECKSUM_SYMBOLS = 6
# A ticket is pasted by people and passed on command lines: 64 addresses is plenty and
# keeps it under a few KiB.
MAX_TICKET_ADDRS = 64
MAX_TICKET_CHARS = 16 * 1024


@dataclass(frozen=True)
class Ticket:
    blob_id: str
    addrs: tuple[str, ...]

    def encode(self) -> str:
        body = encode_canonical({"id": bytes.fromhex(self.blob_id), "addrs": list(self.addrs)})
        data = [TICKET_VERSION, *_to_5bit(body)]
        symbols = data + _checksum(data)
        return TICKET_PREFIX + "".join(BECH32_CHARSET[v] for v in symbols)

    @classmethod
    def decode(cls, text: str) -> Ticket:
        if text[: len(TICKET_PREFIX)].lower() != TICKET_PREFIX or len(text) > MAX_TICKET_CHARS:
            raise BadTicket("not a blobnet ticket (it should start with 'blob1')")
        rest = text[len(TICKET_PREFIX) :]
        if rest[:1].lower() == BECH32_CHARSET[TICKET_VERSION]:
            if text != text.lower() and text != text.upper():
                raise BadTicket("ticket is corrupt: it mixes upper and lower case")
            body = _checked_body(rest)
        else:
            body = _legacy_body(rest)
        obj = decode_map(body, max_size=MAX_TICKET_CHARS, what="ticket", error=BadTicket)
        if list(obj) != ["id", "addrs"]:
            raise BadTicket("ticket must have exactly the fields id, addrs, in that order")
        raw_id, addrs = obj["id"], obj["addrs"]
        if not isinstance(raw_id, bytes) or len(raw_id) != 32:
            raise BadTicket("ticket's blob ID is not 32 bytes")
        if not isinstance(addrs, list) or not 0 < len(addrs) <= MAX_TICKET_ADDRS:
            raise BadTicket(f"ticket must carry 1..{MAX_TICKET_ADDRS} addresses")
        for addr in addrs:
            if not isinstance(addr, str):
                raise BadTicket("ticket address is not a string")
            validate_peer_addr(addr, error=BadTicket)
        ticket = cls(blob_id=raw_id.hex(), addrs=tuple(addrs))
        require_canonical(
            body, encode_canonical({"id": raw_id, "addrs": addrs}), what="ticket", error=BadTicket
        )
        return ticket


def _polymod(values: list[int]) -> int:
    check = 1
    for value in values:
        top = check >> 25
        check = (check & 0x1FFFFFF) << 5 ^ value
        for i, generator in enumerate(_GENERATOR):
            if top >> i & 1:
                check ^= generator
    return check


def _hrp_expand() -> list[int]:
    return [ord(c) >> 5 for c in _HRP] + [0] + [ord(c) & 31 for c in _HRP]


def _checksum(data: list[int]) -> list[int]:
    polymod = _polymod(_hrp_expand() + data + [0] * CHECKSUM_SYMBOLS) ^ _BECH32M_CONST
    return [polymod >> 5 * (CHECKSUM_SYMBOLS - 1 - i) & 31 for i in range(CHECKSUM_SYMBOLS)]


def _to_5bit(data: bytes) -> list[int]:
    """8-bit bytes as 5-bit groups, the last padded with zero bits."""
    bits = int.from_bytes(data, "big") if data else 0
    nbits = 8 * len(data)
    groups = -(-nbits // 5)
    bits <<= 5 * groups - nbits
    return [bits >> 5 * (groups - 1 - i) & 31 for i in range(groups)]


def _from_5bit(groups: list[int]) -> bytes:
    """The bytes of :func:`_to_5bit`; padding of more than 4 bits, or non-zero, is corrupt."""
    nbits = 5 * len(groups)
    nbytes, pad = divmod(nbits, 8)
    bits = 0
    for group in groups:
        bits = bits << 5 | group
    if pad >= 5 or bits & ((1 << pad) - 1):
        raise BadTicket("ticket is corrupt: it ends in the middle of a byte")
    return (bits >> pad).to_bytes(nbytes, "big")


def _checked_body(rest: str) -> bytes:
    """The body of a ``blob1p...`` ticket, after its checksum."""
    try:
        symbols = [_BECH32_INDEX[c] for c in rest.lower()]
    except KeyError:
        raise BadTicket(
            "ticket is corrupt: it holds a character no ticket has (mistyped, or not a "
            "blobnet ticket)"
        ) from None
    if len(symbols) <= 1 + CHECKSUM_SYMBOLS or _polymod(_hrp_expand() + symbols) != _BECH32M_CONST:
        raise BadTicket(
            "ticket is corrupt: its checksum does not match (a character was changed, "
            "swapped or lost in copying); copy it again"
        )
    return _from_5bit(symbols[1:-CHECKSUM_SYMBOLS])


def _legacy_body(rest: str) -> bytes:
    """The body of a ``blob1q...`` ticket (no checksum)."""
    encoded = rest.upper()
    encoded += "=" * (-len(encoded) % 8)
    try:
        return base64.b32decode(encoded)
    except (binascii.Error, ValueError) as exc:
        raise BadTicket(f"ticket is corrupt: {exc}") from None


def validate_peer_addr(addr: str, *, error: type[Exception] = BadTicket) -> Multiaddr:
    """Parse a multiaddr that must end in ``/p2p/<peer id>``; ``error`` carries a plain
    one-line reason (no multiaddr internals) when it does not."""
    try:
        maddr = Multiaddr(addr)
    except Exception as exc:  # multiaddr raises many unrelated types for bad text
        raise error(f"bad peer address {addr!r}: {plain_reason(exc)}") from None
    if "p2p" not in [protocol.name for protocol in maddr.protocols()]:
        raise error(
            f"peer address {addr!r} lacks /p2p/<peer id> "
            "(the full form is /ip4/HOST/tcp/PORT/p2p/12D3KooW...)"
        )
    return maddr


# py-multiaddr's message around the reason: "Invalid MultiAddr '<text>': <reason>
# (string: <text>)".
_MULTIADDR_WRAPPER = re.compile(r"^Invalid MultiAddr '.*?': (?P<reason>.*?)(?: \(string: .*\))?$")


def plain_reason(exc: Exception) -> str:
    text = str(exc).replace("\n", " ")
    match = _MULTIADDR_WRAPPER.match(text)
    return match.group("reason") if match else text
