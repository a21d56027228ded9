"""Chunks in flight are visible to fellows: /blobnet/blob/1.3.0's `status` says
which chunks a peer holds and which it is fetching now; a fetcher leaves a fellow's chunks
in flight to the fellow instead of asking the seeder for them too, and fetchers that know
each other split the chunks nobody holds among themselves (the swarm partition), so each
chunk crosses a slow seeder's uplink about once."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

from blobstore import Manifest, Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.blob.shell import BlobClient, StreamLost, open_optimistic
from p2p.blob.swarm import LINGER_MAX, LINGER_QUIET, FetchingBoard
from p2p.fetch.downloader import _linger
from p2p.fetch.sched_records import SchedulerConfig, bitmap_of
from p2p.fetch.scheduler import Scheduler
from p2p.node.node import open_node

BLOB = "cd" * 32
SWARM = SchedulerConfig(max_chunks_per_request=4, defer_to_partial_holders=True)


def _chunks(ticket: object) -> set[int]:
    ranges = getattr(ticket, "ranges", ())
    return {i for a, b in ranges for i in range(a, b)}


# --- the wire ---------------------------------------------------------------------------


def test_status_round_trip_on_a_1_3_stream() -> None:
    client = proto.ClientConnection(messages.Version.V1_3)
    server = proto.ServerConnection(messages.Version.V1_3)
    server.receive_data(client.send_request(messages.StatusRequest(BLOB)))
    assert server.next_request() == messages.StatusRequest(BLOB)
    answer = messages.StatusResponse(num_chunks=10, bitmap=b"\x05\x02", soon=b"\x02\x00")
    client.receive_data(server.send_response(answer))
    assert client.next_event() == answer
    # A 1.3.0 stream still carries `peers`.
    assert proto.ClientConnection(messages.Version.V1_3).send_request(messages.PeersRequest(BLOB))


def test_status_is_an_unknown_request_before_1_3() -> None:
    with pytest.raises(messages.LocalProtocolError, match=r"1\.3\.0"):
        proto.ClientConnection(messages.Version.V1_2).send_request(messages.StatusRequest(BLOB))
    frame = proto.ClientConnection(messages.Version.V1_3).send_request(messages.StatusRequest(BLOB))
    server = proto.ServerConnection(messages.Version.V1_2)
    server.receive_data(frame)
    with pytest.raises(messages.RemoteProtocolError, match="unknown message type"):
        server.next_request()


@pytest.mark.parametrize(
    ("bits", "soon", "why"),
    [
        (b"\x01\x00", b"\x01\x00", "both held and soon"),
        (b"\x01\x00", b"\x00\x04", "past the last chunk"),
        (b"\x01\x00", b"\x00", "bytes for"),
    ],
)
def test_a_status_answer_that_breaks_its_rules_is_a_remote_fault(
    bits: bytes, soon: bytes, why: str
) -> None:
    import msgpack

    client = proto.ClientConnection(messages.Version.V1_3)
    client.send_request(messages.StatusRequest(BLOB))
    body = msgpack.packb({"t": "status", "n": 10, "bits": bits, "soon": soon}, use_bin_type=True)
    client.receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(messages.RemoteProtocolError, match=why):
        client.next_event()
    with pytest.raises(messages.LocalProtocolError):
        messages.encode_response_header(messages.StatusResponse(10, bits, soon))


# --- what a server says -----------------------------------------------------------------


def test_the_board_lists_what_is_in_flight_less_what_is_held_while_posted() -> None:
    board = FetchingBoard()
    in_flight = [1, 2, 9]
    with board.posting(BLOB, lambda: in_flight):
        assert board.soon(BLOB, 10, bitmap_of([2], 10)) == bitmap_of([1, 9], 10)
        in_flight.append(3)
        assert board.soon(BLOB, 10, bytes(2)) == bitmap_of([1, 2, 3, 9], 10)
    assert board.soon(BLOB, 10, bytes(2)) == bytes(2)


async def test_a_node_answers_status_with_its_chunks_in_flight_and_refuses_it_on_1_2(
    tmp_path: Path,
) -> None:
    """The node's server reads `soon` from the board its downloads post on (the node's)."""
    chunk = 64 * 1024
    data = bytes(range(256)) * (4 * chunk // 256)  # 4 chunks
    manifest = Manifest.of_bytes(data, chunk)
    store = Store.open(tmp_path / "fellow")
    partial = store.begin_partial(manifest)
    partial.write_chunk(0, data[:chunk])
    blob_id = manifest.blob_id
    async with (
        open_node(store, dht=False) as fellow,
        open_node(tmp_path / "asker", dht=False) as asker,
    ):
        peer = await asker.connect(fellow.addrs[0])
        with (
            trio.fail_after(30),
            fellow.server.board.posting(blob_id, lambda: [0, 2]),  # 0 is already held
        ):
            stream = await open_optimistic(
                asker.host, ID.from_base58(peer), messages.Version.V1_3.protocol_id
            )
            answer = await BlobClient(stream, version=messages.Version.V1_3).status(blob_id)
            assert answer == messages.StatusResponse(4, bitmap_of([0], 4), bitmap_of([2], 4))
            await stream.reset()
            # On 1.2.0 the same request is a protocol violation.
            stream = await open_optimistic(
                asker.host, ID.from_base58(peer), messages.Version.V1_2.protocol_id
            )
            client = BlobClient(stream, version=messages.Version.V1_2)
            client.conn = proto.ClientConnection(messages.Version.V1_3)  # say it anyway
            try:
                reply = await client.status(blob_id)
            except StreamLost:
                reply = None  # the reset may beat the error frame (PROTOCOL.md 7.4)
            assert reply is None or (
                isinstance(reply, messages.ErrorResponse)
                and reply.code == messages.ErrorCode.BAD_REQUEST
            )
            await stream.reset()
    partial.close()


# --- what a fetcher does with it --------------------------------------------------------


def test_a_seeder_leaves_a_fellows_chunks_in_flight_to_the_fellow() -> None:
    s = Scheduler(8, lambda i: 1, config=SWARM)
    s.add_peer("seed", 0.0)
    s.add_peer("fellow", 0.0, bitmap=bytes(1), soon=bitmap_of([0, 1, 2, 3], 8))
    first = s.next_request("seed", 0.0)
    assert _chunks(first) == {4, 5, 6, 7}
    assert s.next_request("seed", 0.0) is None  # 0..3 are on their way to the fellow
    assert s.next_request("fellow", 0.0) is None  # ...and not there yet
    # Chunk 0 arrived at the fellow: it serves it; chunk 3's request there failed.
    s.update_peer_bitmap("fellow", bitmap_of([0], 8), soon=bitmap_of([1, 2], 8))
    assert _chunks(s.next_request("fellow", 0.0)) == {0}
    assert _chunks(s.next_request("seed", 0.0)) == {3}
    s._check_invariants()
    # Without the option (or the claim) the seeder is asked for them all.
    plain = Scheduler(8, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=8))
    plain.add_peer("seed", 0.0)
    plain.add_peer("fellow", 0.0, bitmap=bytes(1), soon=bitmap_of([0, 1, 2, 3], 8))
    assert _chunks(plain.next_request("seed", 0.0)) == set(range(8))


def test_a_fellows_claims_go_when_it_goes() -> None:
    s = Scheduler(4, lambda i: 1, config=SWARM)
    s.add_peer("seed", 0.0)
    s.add_peer("fellow", 0.0, bitmap=bytes(1), soon=bitmap_of([0, 1, 2, 3], 4))
    assert s.next_request("seed", 0.0) is None
    s.remove_peer("fellow", "gone")
    s._check_invariants()
    assert _chunks(s.next_request("seed", 0.0)) == {0, 1, 2, 3}


def test_claims_nobody_refreshes_are_void() -> None:
    """A fellow that exits while the seeder defers to its claims and its share (its
    status stream fails) must not hold the download up: before drop_claims it hung."""
    names = ["12D3KooWalpha", "12D3KooWbravo"]
    s = _swarm_of(names, 16)[names[0]]
    mine = _seeded(s)
    assert len(mine) < 15 and s.next_request("seed", 0.0) is None
    s.drop_claims(names[1])
    assert mine | _seeded(s) == set(range(16))
    s._check_invariants()


def _swarm_of(names: list[str], n: int) -> dict[str, Scheduler]:
    """One scheduler per fetcher, each seeing the seeder and its fetching fellows."""
    out = {}
    for me in names:
        s = Scheduler(n, lambda i: 1, config=SWARM, own=me)
        s.add_peer("seed", 0.0)
        for other in names:
            if other != me:
                # Fetching something (a claim outside this blob's range would do too).
                s.add_peer(other, 0.0, bitmap=bytes((n + 7) // 8), soon=bitmap_of([0], n))
        out[me] = s
    return out


def _seeded(s: Scheduler) -> set[int]:
    got: set[int] = set()
    while (ticket := s.next_request("seed", 0.0)) is not None:
        got |= _chunks(ticket)
        for i in _chunks(ticket):
            s.on_chunk(ticket.request_id, i, 1, 0.0)
        s.on_request_done(ticket.request_id, 0.0)
    return got


def test_fetchers_that_know_each_other_split_the_seeders_chunks_between_them() -> None:
    names = ["12D3KooWalpha", "12D3KooWbravo", "12D3KooWcharlie"]
    n = 96
    shares = {name: _seeded(s) for name, s in _swarm_of(names, n).items()}
    everyone = set().union(*shares.values())
    assert everyone == set(range(1, n))  # chunk 0 is claimed by all: nobody's share
    assert sum(len(x) for x in shares.values()) == n - 1  # no chunk twice
    assert all(len(x) > n // 6 for x in shares.values())  # each a fair part
    # A partial peer that is not fetching (it claims nothing: a stale partial copy, say)
    # takes no share: it would never get one.
    s = Scheduler(n, lambda i: 1, config=SWARM, own=names[0])
    s.add_peer("seed", 0.0)
    s.add_peer(names[1], 0.0, bitmap=bitmap_of([0], n))
    assert _seeded(s) == set(range(1, n))  # chunk 0 is left to the peer that holds it


def test_a_fellow_that_leaves_gives_its_share_back() -> None:
    names = ["12D3KooWalpha", "12D3KooWbravo"]
    s = _swarm_of(names, 64)[names[0]]
    mine = _seeded(s)
    assert 0 < len(mine) < 63
    s.remove_peer(names[1], "gone")
    assert mine | _seeded(s) == set(range(64))
    s._check_invariants()


def test_an_unmeasured_seeder_holds_two_requests_while_swarming() -> None:
    s = Scheduler(64, lambda i: 1, config=SWARM)
    s.add_peer("seed", 0.0)
    s.set_connections("seed", 4)  # predialled: six requests without the cap
    assert [s.next_request("seed", 0.0) is not None for _ in range(3)] == [True, True, False]
    plain = Scheduler(64, lambda i: 1, config=SchedulerConfig(max_chunks_per_request=4))
    plain.add_peer("seed", 0.0)
    plain.set_connections("seed", 4)
    assert plain.inflight_limit("seed") == 6


# --- staying for the fellows ------------------------------------------------------------


async def test_a_complete_swarming_fetch_stays_while_its_fellows_ask(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A one-shot fetcher that left the moment it was complete took its last chunks with
    it: its fellows had to ask the seeder for them again."""
    board = FetchingBoard()
    await _linger(board, BLOB)  # nobody ever asked: no wait
    assert trio.current_time() == 0.0
    board.asked(BLOB, trio.current_time())

    async def fellow(times: int) -> None:
        for _ in range(times):
            await trio.sleep(0.5)
            board.asked(BLOB, trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fellow, 4)
        await _linger(board, BLOB)
    assert trio.current_time() == pytest.approx(2.0 + LINGER_QUIET)
    # Fellows that never stop asking hold it at most LINGER_MAX.
    began = trio.current_time()
    board.asked(BLOB, began)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fellow, 1000)
        await _linger(board, BLOB)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - began == pytest.approx(LINGER_MAX)


def test_a_swarms_seeder_copies_a_fellows_request_only_once_it_is_overdue() -> None:
    def tail(config: SchedulerConfig) -> Scheduler:
        s = Scheduler(2, lambda i: 1, config=config)
        s.add_peer("seed", 0.0)
        s.add_peer("fellow", 0.0, bitmap=bitmap_of([1], 2))
        first = s.next_request("seed", 0.0)
        assert _chunks(first) == {0}
        assert _chunks(s.next_request("fellow", 0.0)) == {1}
        assert first is not None
        s.on_chunk(first.request_id, 0, 1, 0.5)
        s.on_request_done(first.request_id, 0.5)
        return s

    swarm = tail(SWARM)
    assert swarm.next_request("seed", 1.0) is None  # the fellow's copy is on its way
    late = swarm.next_request("seed", 2.5)
    assert late is not None and late.endgame and _chunks(late) == {1}
    plain = tail(SchedulerConfig(max_chunks_per_request=4))
    copy = plain.next_request("seed", 1.0)
    assert copy is not None and copy.endgame
