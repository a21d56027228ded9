"""Peer exchange, sans-IO: the `peers` message of /blobnet/blob/1.2.0, the
server's bounded, expiring book of who asked for a blob, the fetcher's bounded dialling,
and the scheduler's spreading of a sole seeder's chunks over fetchers."""

from __future__ import annotations

import itertools

import pytest

from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.swarm import PexBook, SwarmBook, listing, usable_addrs
from p2p.fetch.sched_records import SchedulerConfig
from p2p.fetch.scheduler import Scheduler

BLOB = "ab" * 32
ADDR = "/ip4/10.0.0.2/tcp/4001"


def _server(peer_exchange: bool) -> proto.ServerConnection:
    return proto.ServerConnection(messages.Version.V1_2 if peer_exchange else messages.Version.V1_1)


def test_peers_round_trip_on_a_1_2_stream() -> None:
    client = proto.ClientConnection(messages.Version.V1_2)
    server = _server(True)
    server.receive_data(client.send_request(messages.PeersRequest(BLOB)))
    assert server.next_request() == messages.PeersRequest(BLOB)
    listed = (("12D3KooWfellow", (ADDR,)),)
    client.receive_data(server.send_response(messages.PeersResponse(listed)))
    assert client.next_event() == messages.PeersResponse(listed)


def test_peers_is_an_unknown_request_on_older_versions() -> None:
    with pytest.raises(messages.LocalProtocolError, match=r"1\.2\.0"):
        proto.ClientConnection().send_request(messages.PeersRequest(BLOB))
    frame = proto.ClientConnection(messages.Version.V1_2).send_request(messages.PeersRequest(BLOB))
    server = _server(False)
    server.receive_data(frame)
    with pytest.raises(messages.RemoteProtocolError, match="unknown message type"):
        server.next_request()


def test_a_peers_answer_over_its_bounds_is_refused() -> None:
    too_many = tuple((f"peer{k}", (ADDR,)) for k in range(messages.MAX_PEERS_LISTED + 1))
    with pytest.raises(messages.LocalProtocolError):
        messages.encode_response_header(messages.PeersResponse(too_many))
    too_many_addrs = (
        ("peer", tuple(f"{ADDR}{k}" for k in range(messages.MAX_ADDRS_PER_PEER + 1))),
    )
    with pytest.raises(messages.LocalProtocolError):
        messages.encode_response_header(messages.PeersResponse(too_many_addrs))
    with pytest.raises(messages.LocalProtocolError):
        messages.encode_response_header(messages.PeersResponse((("p", (ADDR,)), ("p", (ADDR,)))))
    # A hostile server's oversized list is a remote fault on the client's side.
    client = proto.ClientConnection(messages.Version.V1_2)
    client.send_request(messages.PeersRequest(BLOB))
    import msgpack

    body = msgpack.packb({"t": "peers", "p": [[f"p{k}", [ADDR]] for k in range(17)]})
    client.receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(messages.RemoteProtocolError, match="at most 16"):
        client.next_event()


def test_the_book_lists_recent_askers_newest_first_without_the_asker() -> None:
    book = SwarmBook()
    book.seen(BLOB, "a", now=0.0)
    book.seen(BLOB, "b", now=1.0)
    book.seen(BLOB, "a", now=2.0)  # asked again: now the newest
    assert book.peers(BLOB, now=3.0) == ["a", "b"]
    assert book.peers(BLOB, now=3.0, exclude="a") == ["b"]
    assert book.peers("cd" * 32, now=3.0) == []


def test_the_book_forgets_peers_after_the_expiry() -> None:
    book = SwarmBook(expiry=10.0)
    book.seen(BLOB, "old", now=0.0)
    book.seen(BLOB, "new", now=8.0)
    assert book.peers(BLOB, now=10.0) == ["new", "old"]
    assert book.peers(BLOB, now=10.5) == ["new"]
    assert book.peers(BLOB, now=18.5) == []
    assert len(book) == 0  # an emptied blob takes no room


def test_the_book_is_bounded_in_peers_and_blobs() -> None:
    book = SwarmBook(max_blobs=2, max_peers=3)
    for k in range(5):
        book.seen(BLOB, f"p{k}", now=float(k))
    assert book.peers(BLOB, now=5.0) == ["p4", "p3", "p2"]
    book.seen("01" * 32, "x", now=5.0)
    book.seen("02" * 32, "y", now=6.0)  # a third blob pushes out the least recent
    assert len(book) == 2
    assert book.peers(BLOB, now=7.0) == []


def test_the_answer_holds_only_peers_with_usable_addresses_and_is_bounded() -> None:
    book = SwarmBook()
    for k in range(messages.MAX_PEERS_LISTED + 5):
        book.seen(BLOB, f"p{k}", now=float(k))
    book.seen(BLOB, "no-addr", now=100.0)
    addrs = {f"p{k}": [f"/ip4/10.0.0.{k}/tcp/1", "/ip4/0.0.0.0/tcp/1"] for k in range(21)}
    answer = listing(book, BLOB, "p20", 101.0, lambda peer: addrs.get(peer, []))
    assert len(answer) == messages.MAX_PEERS_LISTED
    assert answer[0] == ("p19", ("/ip4/10.0.0.19/tcp/1",))  # newest first, asker left out
    messages.encode_response_header(messages.PeersResponse(answer))  # within the protocol's bounds


def test_usable_addrs_drops_wildcards_repeats_and_the_peer_suffix() -> None:
    got = usable_addrs(
        [
            "/ip4/0.0.0.0/tcp/1",
            "/ip4/10.0.0.1/udp/1/quic",
            "/ip4/10.0.0.1/tcp/1/p2p/12D3",
            "/ip4/10.0.0.1/tcp/1",
            *(f"/ip4/10.0.1.{k}/tcp/2" for k in range(9)),
        ]
    )
    assert got[0] == "/ip4/10.0.0.1/tcp/1"
    assert len(got) == messages.MAX_ADDRS_PER_PEER


def test_the_fetcher_asks_each_source_once_per_interval() -> None:
    pex = PexBook("me", interval=1.0)
    pex.add_source("seed")
    assert pex.due(0.0) == ["seed"]
    assert pex.due(0.5) == []
    assert pex.next_wake(0.5) == 1.0
    pex.add_source("fellow")
    assert pex.due(0.6) == ["fellow"]
    assert pex.due(1.0) == ["seed"]


def test_the_fetcher_dials_each_new_peer_once_within_its_budget() -> None:
    pex = PexBook("me", max_dials=2)
    pex.add_source("seed")
    listed = [("me", (ADDR,)), ("seed", (ADDR,)), ("a", (ADDR,)), ("b", ()), ("c", (ADDR,))]
    assert [p for p, _ in pex.to_dial(listed)] == ["a", "c"]
    assert pex.to_dial([("a", (ADDR,)), ("d", (ADDR,))]) == []  # known, and budget spent
    assert pex.due(5.0) == []  # nothing more to learn: stop asking


def test_fetchers_starting_at_different_chunks_take_different_chunks_from_a_seeder() -> None:
    config = SchedulerConfig(max_chunks_per_request=4)
    firsts = []
    for start in (0, 16, 32, 48):
        s = Scheduler(64, lambda i: 1 << 20, config=config, start=start)
        s.add_peer("seed", 0.0)
        ticket = s.next_request("seed", 0.0)
        assert ticket is not None
        firsts.append(ticket.ranges)
    assert firsts == [((0, 4),), ((16, 20),), ((32, 36),), ((48, 52),)]
    # The order wraps: a fetcher starting near the end still gets every chunk.
    s = Scheduler(10, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=4), start=8)
    s.add_peer("seed", 0.0)
    got = []
    while (t := s.next_request("seed", 0.0)) is not None:
        for a, b in t.ranges:
            for i in range(a, b):
                got.append(i)
                s.on_chunk(t.request_id, i, 1, 0.0)
        s.on_request_done(t.request_id, 0.0)
    assert set(got[:4]) == {8, 9, 0, 1}  # one request: sorted ranges [0, 2) and [8, 10)
    assert sorted(got) == list(range(10))


def test_rarest_first_leaves_a_fellows_chunks_to_the_fellow() -> None:
    s = Scheduler(8, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=4))
    s.add_peer("seed", 0.0)
    s.add_peer("fellow", 0.0, bitmap=bytes([0b00001111]))  # holds chunks 0..3
    ticket = s.next_request("seed", 0.0)
    assert ticket is not None and ticket.ranges == ((4, 8),)
    ticket = s.next_request("fellow", 0.0)
    assert ticket is not None and ticket.ranges == ((0, 4),)


def test_a_slow_peer_is_asked_for_about_a_second_of_its_rate() -> None:
    mib = 1 << 20
    config = SchedulerConfig(max_request_seconds=1.0, unmeasured_batch_bytes=4 * mib)
    s = Scheduler(64, lambda i: mib, config=config)
    s.add_peer("seed", 0.0)
    first = s.next_request("seed", 0.0)
    assert first is not None and first.ranges == ((0, 4),)  # unmeasured: 4 MiB
    for i in range(4):
        s.on_chunk(first.request_id, i, mib, now=0.5 * (i + 1))  # ~2 MiB/s
    s.on_request_done(first.request_id, 2.0)
    ticket = s.next_request("seed", 2.0)
    assert ticket is not None
    assert sum(b - a for a, b in ticket.ranges) <= 3
    # Without the caps the same peer gets the full batch of 16.
    plain = Scheduler(64, lambda i: mib)
    plain.add_peer("seed", 0.0)
    ticket = plain.next_request("seed", 0.0)
    assert ticket is not None and ticket.ranges == ((0, 16),)


def test_a_seeder_leaves_chunks_a_fellow_holds_to_the_fellow_while_it_is_there() -> None:
    config = SchedulerConfig(max_chunks_per_request=8, defer_to_partial_holders=True)
    s = Scheduler(8, lambda i: 1, config=config)
    s.add_peer("seed", 0.0)
    s.add_peer("fellow", 0.0, bitmap=bytes([0b00001111]))  # holds chunks 0..3
    ticket = s.next_request("seed", 0.0)
    assert ticket is not None and ticket.ranges == ((4, 8),)  # only what nobody else has
    assert s.next_request("seed", 0.0) is None  # 0..3 wait for the fellow
    fellow = s.next_request("fellow", 0.0)
    assert fellow is not None and fellow.ranges == ((0, 4),)
    # A fellow that goes away gives its chunks back to the seeder.
    s.remove_peer("fellow", "gone")
    for i in range(4, 8):
        s.on_chunk(ticket.request_id, i, 1, 1.0)
    s.on_request_done(ticket.request_id, 1.0)
    again = s.next_request("seed", 1.0)
    assert again is not None and again.ranges == ((0, 4),)
    # Without the option the seeder takes the fellow's chunks too.
    plain = Scheduler(8, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=8))
    plain.add_peer("seed", 0.0)
    plain.add_peer("fellow", 0.0, bitmap=bytes([0b00001111]))
    first = plain.next_request("seed", 0.0)
    assert first is not None and first.ranges == ((4, 8),)
    second = plain.next_request("seed", 0.0)
    assert second is not None and second.ranges[0][0] == 0  # a chunk the fellow holds


def test_a_source_that_names_nobody_new_is_asked_ever_less_often() -> None:
    pex = PexBook("me", interval=1.0)
    pex.add_source("seed")
    pex.due(0.0)
    pex.answered("seed", 1, 1)  # it named a fellow once; from then on nobody new
    asked_at = [0.0]
    for tick in range(1, 400):  # 40 s in 0.1 s steps
        now = tick / 10
        for source in pex.due(now):
            asked_at.append(now)
            pex.answered(source, 0, 1)
    gaps = [b - a for a, b in itertools.pairwise(asked_at)]
    assert gaps[:5] == pytest.approx([1.0, 2.0, 4.0, 8.0, 8.0])  # doubling, then the cap
    pex.answered("seed", 1)  # a new fellow: back to the first interval
    assert pex.next_wake(asked_at[-1]) == pytest.approx(asked_at[-1] + 1.0)


def test_a_source_that_has_named_nobody_yet_is_asked_every_interval() -> None:
    """The first fetcher to reach a seeder asks `peers` before its fellows have asked
    anything: the empty answer is no sign that nobody will come. Backed off to 2 s at
    once, it fetched alone (its partition all its own) for two seconds of a five-second
    fan-out while its fellows were there (bench/sim's testbed-shaped fan-out)."""
    pex = PexBook("me", interval=1.0)
    pex.add_source("seed")
    asked_at = []
    for tick in range(100):  # 10 s in 0.1 s steps
        now = tick / 10
        for source in pex.due(now):
            asked_at.append(now)
            pex.answered(source, 0, 0)
    gaps = [b - a for a, b in itertools.pairwise(asked_at)]
    assert gaps == pytest.approx([1.0] * len(gaps)) and len(gaps) >= 9


def test_an_origin_is_spared_while_a_fellow_that_finished_can_serve() -> None:
    """Origins last: a ticket's seeder shared by a swarm kept being asked by every later
    fetcher for its rate-scaled share once fellows had finished; a seeder shared by a
    thousand simulated fetchers sent the blob many times over. With a finished fellow
    around, the named seeder gets nothing from the pool; without it, it serves again."""
    config = SchedulerConfig(max_chunks_per_request=8, defer_to_partial_holders=True)
    s = Scheduler(8, lambda i: 1, config=config)
    s.add_peer("seed", 0.0)
    s.set_origin("seed")
    s.add_peer("fellow", 0.0, bitmap=bytes([0b00001111]))
    s.update_peer_bitmap("fellow", None)  # it finished
    assert s.next_request("seed", 0.0) is None
    tickets = []
    while (ticket := s.next_request("fellow", 0.0)) is not None:
        tickets.append(ticket)
    assert tickets
    # The fellow is at its request limit and chunks are left: still none for the origin.
    assert s.fetchable_count > 0
    assert s.next_request("seed", 0.0) is None
    for t in tickets:
        s.on_request_failed(t.request_id, 1.0, "gone")
    s.remove_peer("fellow", "gone")
    again = s.next_request("seed", 1.0)
    assert again is not None and again.ranges[0][0] == 0


def test_origins_are_not_spared_for_each_other_nor_without_swarming() -> None:
    """Two named seeders (two mirrors of a ticket) both serve: each is an origin, and an
    origin yields only to a fellow that is none; a plain fetch (no peer exchange) never
    spares a peer it was given."""
    swarm = SchedulerConfig(max_chunks_per_request=4, defer_to_partial_holders=True)
    s = Scheduler(8, lambda i: 1, config=swarm)
    for name in ("mirror-a", "mirror-b"):
        s.add_peer(name, 0.0)
        s.set_origin(name)
    assert s.next_request("mirror-a", 0.0) is not None
    assert s.next_request("mirror-b", 0.0) is not None
    plain = Scheduler(8, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=4))
    plain.add_peer("seed", 0.0)
    plain.set_origin("seed")
    plain.add_peer("finished", 0.0)
    assert plain.next_request("seed", 0.0) is not None


def test_a_finished_fellow_gives_a_claimed_chunk_that_an_origin_leaves_to_its_claimer() -> None:
    """Claims spare a seeder's uplink; a fellow that finished (no origin) has no reason to
    make a fetcher wait for the claimer to fetch the chunk, say so and serve it: a
    simulated four-fetcher fan-out's last chunk waited 1.3 s that way."""
    config = SchedulerConfig(max_chunks_per_request=8, defer_to_partial_holders=True)
    s = Scheduler(8, lambda i: 1, config=config)
    s.add_peer("seed", 0.0)
    s.set_origin("seed")
    # A partial fellow holding 0..3 and fetching 4..7 now (its claims).
    s.add_peer("fellow", 0.0, bitmap=bytes([0b00001111]), soon=bytes([0b11110000]))
    assert s.next_request("seed", 0.0) is None  # every chunk held or claimed: left to it
    s.add_peer("finished", 0.0)  # a fellow with every chunk, not named
    got = s.next_request("finished", 0.0)
    assert got is not None and set(got.indices) <= {4, 5, 6, 7}  # the claimed ones
