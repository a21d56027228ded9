"""Tickets: one copyable string with a blob ID and its providers' addresses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.blob.ticket import Ticket
from p2p.errors import BadTicket

PEER = "12D3KooWGxP5jFCb1ZfeytT77zTWxzNbaBDCWUzozFeUwnRSbsES"
ADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


def test_round_trip() -> None:
    ticket = Ticket("ab" * 32, (ADDR, ADDR.replace("4001", "4002")))
    text = ticket.encode()
    assert text.startswith("blob1")
    assert text == text.lower()
    assert Ticket.decode(text) == ticket


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
