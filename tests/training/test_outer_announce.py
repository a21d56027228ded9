"""Announcements are re-sent on change, then with exponential back-off (each announcement
every second would cost 7x the update bytes); peers are dialled again, with
back-off, for as long as they are not connected."""

from __future__ import annotations

from training.outer.announce import MAX_ADDRS_PER_PEER, MAX_PEERS, Announcer, PeerDialer


def test_resends_back_off_and_a_change_restarts_them() -> None:
    a = Announcer(first=1.0, cap=8.0)
    assert a.set("update", b"u1", now=0.0)
    assert not a.set("update", b"u1", now=0.5)  # unchanged: nothing to publish
    sent = []
    t = 0.0
    while t <= 30.0:
        if a.due(t):
            sent.append(t)
        t += 0.25
    assert sent == [1.0, 3.0, 7.0, 15.0, 23.0]  # +1, +2, +4, +8, then every 8 s
    assert a.set("update", b"u2", now=30.0)  # changed: publish now, back-off restarts
    assert a.next_due() == 31.0
    a.drop("update")
    assert a.due(100.0) == []
    assert a.next_due() == float("inf")


def test_thirty_seconds_cost_five_resends_not_thirty() -> None:
    a = Announcer()
    a.set("hello", b"h", now=0.0)
    count = sum(len(a.due(float(t))) for t in range(1, 31))
    assert count <= 6


def test_a_peer_is_dialled_until_it_answers_backing_off_and_at_once_when_it_drops() -> None:
    """A worker back from a pause must find its living peers even when the one it
    bootstrapped to is dead (CI: a resumed worker never rejoined): every peer heard of is
    dialled while not connected, for the whole run, with back-off."""
    d = PeerDialer(first=1.0, cap=4.0)
    d.learn("dead", ["/ip4/127.0.0.1/tcp/1/p2p/dead"], now=0.0)
    d.learn("live", ["/ip4/127.0.0.1/tcp/2/p2p/live"], now=0.0)
    assert [p for p, _ in d.due(0.0, connected=[])] == ["dead", "live"]
    d.failed("dead", 0.0)
    d.succeeded("live", 0.0)
    tried = []
    for t in range(1, 30):
        for peer, _ in d.due(float(t), connected=["live"]):
            tried.append((t, peer))
            d.failed(peer, float(t))
    # The dead peer: after 1, 2, 4, then every 4 s (capped), never given up.
    assert tried == [(1, "dead"), (3, "dead"), (7, "dead"), (11, "dead"), (15, "dead"),
                     (19, "dead"), (23, "dead"), (27, "dead")]  # fmt: skip
    # The live one is never dialled while connected; once it drops, at once.
    assert [p for p, _ in d.due(30.0, connected=[])] == ["live"]


def test_addresses_are_merged_newest_first_and_bounded() -> None:
    d = PeerDialer()
    for i in range(10):
        d.learn("p", [f"/ip4/10.0.0.{i}/tcp/1/p2p/p"], now=float(i))
    assert d.addrs("p")[0] == "/ip4/10.0.0.9/tcp/1/p2p/p"
    assert len(d.addrs("p")) == MAX_ADDRS_PER_PEER
    d.learn("p", [], now=11.0)  # an announcement without addresses changes nothing
    assert len(d.addrs("p")) == MAX_ADDRS_PER_PEER
    for i in range(MAX_PEERS + 5):
        d.learn(f"q{i}", ["/ip4/10.0.0.1/tcp/1/p2p/q"], now=100.0 + i)
    assert len(d.peers) == MAX_PEERS and "q0" not in d.peers  # the oldest-heard go first


def test_after_a_pause_every_peer_is_due_again() -> None:
    d = PeerDialer(first=1.0, cap=8.0)
    d.learn("a", ["/ip4/127.0.0.1/tcp/1/p2p/a"], now=0.0)
    for t in range(5):
        d.failed("a", float(t))
    assert d.due(5.0, connected=[]) == []  # backed off to 8 s
    d.all_due(5.0)
    assert [p for p, _ in d.due(5.0, connected=[])] == ["a"]
