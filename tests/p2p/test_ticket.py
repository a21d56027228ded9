"""Tickets: one copyable string with a blob ID and its providers' addresses."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.blob.ticket import Ticket
from p2p.errors import BadTicket
from tests.blob_cli import blob_here

PEER = "12D3KooWGxP5jFCb1ZfeytT77zTWxzNbaBDCWUzozFeUwnRSbsES"
ADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


def test_round_trip() -> None:
    ticket = Ticket("ab" * 32, (ADDR, ADDR.replace("4001", "4002")))
    text = ticket.encode()
    assert text.startswith("blob1p")  # version 1: checksummed
    assert text == text.lower()
    assert Ticket.decode(text) == ticket
    assert Ticket.decode(text.upper()) == ticket  # bech32 is one case, either one


# A ticket as blobnet wrote them before they had a checksum (unpadded base32, "blob1q").
LEGACY = (
    "blob1qkrgszgeecv2xk5lvov2xk5lvov2xk5lvov2xk5lvov2xk5lvov2xk5lvov2xjlbmrshe44r3fic62lqgqxt"
    "cmrxfyyc4mbogexxiy3qf42dambrf5yde4bpgezeim2ln5xvor3yka2wursdmiyvuztfpf2finzxpjkfo6d2jzrgc"
    "qseinlvk6tppjdgkvlxnzjfgyttivjq"
)


def test_tickets_without_a_checksum_are_still_read() -> None:
    assert Ticket.decode(LEGACY) == Ticket("ab" * 32, (ADDR,))


def test_every_changed_character_is_caught() -> None:
    """A ticket without a checksum read one changed character as another blob ID (or
    another address); a checksummed one refuses each such change, wherever it is."""
    text = Ticket("ab" * 32, (ADDR,)).encode()
    for i in range(len("blob1p"), len(text)):
        changed = "q" if text[i] != "q" else "p"
        with pytest.raises(BadTicket, match="checksum"):
            Ticket.decode(text[:i] + changed + text[i + 1 :])
    with pytest.raises(BadTicket, match="checksum"):
        Ticket.decode(text[:-1])  # cut short
    swapped = next(i for i in range(6, len(text) - 1) if text[i] != text[i + 1])
    with pytest.raises(BadTicket, match="checksum"):
        Ticket.decode(text[:swapped] + text[swapped + 1] + text[swapped] + text[swapped + 2 :])


@pytest.mark.parametrize(
    "text",
    [
        "",
        "blob2aaaa",
        "blob1!!!!",
        "blob1" + "a" * 20000,
        Ticket("ab" * 32, (ADDR,)).encode()[:-3],
    ],
)
def test_malformed_tickets_rejected(text: str) -> None:
    with pytest.raises(BadTicket):
        Ticket.decode(text)


def test_address_without_peer_id_rejected() -> None:
    text = Ticket("ab" * 32, ("/ip4/127.0.0.1/tcp/4001",)).encode()
    with pytest.raises(BadTicket, match="p2p"):
        Ticket.decode(text)


@given(st.text(max_size=300))
def test_arbitrary_text_raises_only_bad_ticket(text: str) -> None:
    try:
        Ticket.decode("blob1" + text)
    except BadTicket:
        pass


def test_get_with_a_mistyped_ticket_says_so(tmp_path: Path) -> None:
    """`blob get` of a ticket with one character changed: one line saying the ticket is
    corrupt, before any node starts, not a fetch of some other blob."""
    text = Ticket("ab" * 32, (ADDR,)).encode()
    typo = text[:20] + ("x" if text[20] != "x" else "y") + text[21:]
    done = blob_here(["--store", str(tmp_path / "s"), "--key", str(tmp_path / "k"), "get", typo])
    assert done.returncode == 4, done.stderr  # bad data (README's exit codes)
    assert "checksum" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"addrs": [ADDR], "id": bytes(32)},  # the keys in the other order
        {"id": bytes(32), "addrs": [ADDR], "x": 1},  # an extra key
    ],
    ids=["key-order", "extra-key"],
)
def test_a_ticket_body_in_another_spelling_is_refused(fields: dict[str, object]) -> None:
    """Like every other decoder, a ticket accepts only the one canonical spelling of its
    body, even under a valid checksum."""
    import msgpack

    from p2p.blob import ticket as module

    data = [module.TICKET_VERSION, *module._to_5bit(msgpack.packb(fields, use_bin_type=True))]
    symbols = data + module._checksum(data)
    text = module.TICKET_PREFIX + "".join(module.BECH32_CHARSET[v] for v in symbols)
    with pytest.raises(BadTicket, match="fields id, addrs"):
        Ticket.decode(text)
