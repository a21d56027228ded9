"""The yamux session state machine, driven by bytes alone: no sockets, no time."""

from __future__ import annotations

import random

import pytest

from p2p.transport.fast.errors import LocalProtocolError, YamuxProtocolError
from p2p.transport.fast.yamux_core import (
    DEFAULT_MAX_WINDOW,
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    HEADER,
    INITIAL_WINDOW,
    MAX_PENDING_CONTROL,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    Stream,
    WindowPool,
    YamuxSession,
)


def frame(typ: int, flags: int, sid: int, length: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(0, typ, flags, sid, length) + payload


def frames_of(data: bytes) -> list[tuple[int, int, int, int]]:
    """(type, flags, stream, length) of each header in control bytes."""
    return [HEADER.unpack_from(data, i)[1:] for i in range(0, len(data), 12)]


class Pair:
    """Two sessions wired back to back; `pump` moves every queued byte across."""

    def __init__(self) -> None:
        self.a = YamuxSession(is_initiator=True)
        self.b = YamuxSession(is_initiator=False)
        self.a_wire = bytearray()  # data frames a wants to send (the shell's send queue)
        self.b_wire = bytearray()

    def send_data(self, side: YamuxSession, st: Stream, payload: bytes) -> None:
        wire = self.a_wire if side is self.a else self.b_wire
        wire += side.take_outgoing()
        wire += side.data_header(st, len(payload)) + payload

    def pump(self) -> None:
        for _ in range(10):
            a_out = bytes(self.a_wire) + self.a.take_outgoing()
            b_out = bytes(self.b_wire) + self.b.take_outgoing()
            self.a_wire.clear()
            self.b_wire.clear()
            if not a_out and not b_out:
                return
            self.b.receive(a_out)
            self.a.receive(b_out)


def test_open_accept_data_and_fin() -> None:
    p = Pair()
    st = p.a.open_stream()
    assert st.stream_id == 1
    p.send_data(p.a, st, b"hello")
    p.pump()
    assert len(p.b.accepted) == 1
    peer = p.b.accepted.popleft()
    assert peer.stream_id == 1
    assert st.acked
    assert p.b.pop(peer, -1) == b"hello"
    fin = p.a.fin_frame(st)
    assert fin is not None
    p.a_wire += fin
    p.pump()
    assert peer.fin_received
    assert not peer.queue


def test_stream_ids_follow_parity() -> None:
    a = YamuxSession(is_initiator=True)
    b = YamuxSession(is_initiator=False)
    assert [a.open_stream().stream_id for _ in range(3)] == [1, 3, 5]
    assert [b.open_stream().stream_id for _ in range(2)] == [2, 4]


def test_window_grows_once_the_application_reads_and_updates_are_batched() -> None:
    p = Pair()
    st = p.a.open_stream()
    p.pump()
    assert st.send_credit == INITIAL_WINDOW
    for _ in range(4):
        p.send_data(p.a, st, bytes(65536))
    p.pump()
    peer = p.b.accepted.popleft()
    assert st.send_credit == 0, "no update before the application reads"
    p.b.pop(peer, 65536)
    p.pump()
    assert st.send_credit == 65536, "the stalled peer gets what was read back at once"
    p.b.pop(peer, 3 * 65536)
    p.pump()
    # 256 KiB read: the window doubles to 512 KiB, granted in one update.
    assert st.send_credit == 2 * INITIAL_WINDOW
    # Reading 8 MiB more grows it to the 16 MiB maximum, in a few batched updates.
    updates = 0
    for _ in range(128):
        p.send_data(p.a, st, bytes(65536))
        p.pump()
        p.b.pop(peer, 65536)
        updates += p.b.has_outgoing
        p.pump()
    assert peer.window_target == DEFAULT_MAX_WINDOW
    assert updates < 20


def test_data_beyond_the_window_is_a_protocol_error() -> None:
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))
    with pytest.raises(YamuxProtocolError, match="exceeds"):
        b.receive(frame(TYPE_DATA, 0, 1, INITIAL_WINDOW + 1))


def test_bad_version_and_unknown_type_are_protocol_errors() -> None:
    with pytest.raises(YamuxProtocolError, match="version"):
        YamuxSession(is_initiator=False).receive(HEADER.pack(1, TYPE_PING, FLAG_SYN, 0, 0))
    with pytest.raises(YamuxProtocolError, match="unknown"):
        YamuxSession(is_initiator=False).receive(frame(9, 0, 0, 0))


def test_syn_with_own_parity_or_duplicate_is_rejected() -> None:
    with pytest.raises(YamuxProtocolError, match="parity"):
        YamuxSession(is_initiator=True).receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 3, 0))
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))
    with pytest.raises(YamuxProtocolError, match="already open"):
        b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))


def test_streams_beyond_the_limit_are_reset_not_fatal() -> None:
    b = YamuxSession(is_initiator=False, max_streams=2)
    for sid in (1, 3, 5):
        b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, sid, 0))
    assert [s.stream_id for s in b.accepted] == [1, 3]
    sent = frames_of(b.take_outgoing())
    assert (TYPE_WINDOW_UPDATE, FLAG_RST, 5, 0) in sent
    # Its payload is dropped without touching any stream.
    b.receive(frame(TYPE_DATA, 0, 5, 3, b"xyz"))
    assert all(not s.queue for s in b.accepted)


def test_rst_wakes_and_forgets_the_stream() -> None:
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))
    st = b.accepted.popleft()
    woken: list[int] = []
    st.wake = lambda: woken.append(1)
    b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_RST, 1, 0))
    assert st.rst
    assert woken
    assert 1 not in b.streams


def test_ping_is_answered_with_the_same_value() -> None:
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_PING, FLAG_SYN, 0, 0xDEADBEEF))
    assert frames_of(b.take_outgoing()) == [(TYPE_PING, FLAG_ACK, 0, 0xDEADBEEF)]


def test_unread_control_frames_are_bounded() -> None:
    """A peer that floods pings but never reads our pongs must not grow our memory forever."""
    b = YamuxSession(is_initiator=False)
    ping = frame(TYPE_PING, FLAG_SYN, 0, 1)
    with pytest.raises(YamuxProtocolError, match="control"):
        b.receive(ping * (MAX_PENDING_CONTROL // 12 + 2))


def test_go_away_normal_forbids_new_streams_error_ends_session() -> None:
    a = YamuxSession(is_initiator=True)
    a.receive(frame(TYPE_GO_AWAY, 0, 0, 0))
    with pytest.raises(LocalProtocolError, match="going away"):
        a.open_stream()
    with pytest.raises(YamuxProtocolError, match="GO_AWAY code 1") as info:
        YamuxSession(is_initiator=True).receive(frame(TYPE_GO_AWAY, 0, 0, 1))
    assert info.value.go_away_code is None


def test_after_local_go_away_new_inbound_streams_are_refused() -> None:
    b = YamuxSession(is_initiator=False)
    b.go_away()
    b.take_outgoing()
    b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))
    assert not b.accepted
    assert frames_of(b.take_outgoing()) == [(TYPE_WINDOW_UPDATE, FLAG_RST, 1, 0)]


def test_window_update_overflow_is_a_protocol_error() -> None:
    a = YamuxSession(is_initiator=True)
    st = a.open_stream()
    with pytest.raises(YamuxProtocolError, match="overflows"):
        a.receive(frame(TYPE_WINDOW_UPDATE, 0, st.stream_id, 2**32 - 1))


def test_payload_goes_straight_into_a_waiting_readinto_buffer() -> None:
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_DATA, FLAG_SYN, 1, 10, b"0123456789"))
    st = b.accepted.popleft()
    assert b.pop(st, -1) == b"0123456789"
    target = bytearray(6)
    st.target = memoryview(target)
    b.receive(frame(TYPE_DATA, 0, 1, 8, b"abcdefgh"))
    assert bytes(target) == b"abcdef"
    assert st.target_filled == 6
    assert b"".join(st.queue) == b"gh", "what does not fit is queued in order"


def test_direct_stream_only_for_whole_frames_of_payload() -> None:
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))
    st = b.accepted.popleft()
    target = bytearray(100)
    st.target = memoryview(target)
    b.receive(HEADER.pack(0, TYPE_DATA, 0, 1, 50))
    assert b.direct_stream(60) is None, "the frame is shorter than the noise message"
    assert b.direct_stream(50) is st
    target[:50] = b"z" * 50
    b.received_direct(st, 50)
    assert st.target_filled == 50
    assert b.direct_stream(1) is None
    b.receive(frame(TYPE_DATA, FLAG_FIN, 1, 1, b"!"))
    assert st.fin_received
    assert target[50:51] == b"!"


def test_a_reader_with_queued_bytes_is_nudged_once_per_read() -> None:
    """Payload that cannot go straight into the reader's buffer because bytes are queued
    ahead of it (with or without a buffer posted) names the stream to nudge, once until its
    reader consumes again; a reader blocked in readinto with nothing queued is the direct
    path's, not a nudge."""
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_DATA, FLAG_SYN, 1, 4, b"head"))  # a message header, queued
    st = b.accepted.popleft()
    b.receive(HEADER.pack(0, TYPE_DATA, 0, 1, 64))  # 64 payload bytes announced
    assert b.idle_reader_stream(64) is st, "no readinto buffer yet"
    st.target = memoryview(bytearray(100))
    assert b.idle_reader_stream(64) is st, "a buffer, but the header is queued ahead"
    assert b.direct_stream(64) is None
    st.nudged = True
    assert b.idle_reader_stream(64) is None, "nudged once already"
    assert b.pop(st, 4) == b"head"  # the reader ran: consumed, blocked again
    assert not st.nudged
    assert b.idle_reader_stream(64) is None
    assert b.direct_stream(64) is st
    assert b.idle_reader_stream(65) is None, "more than the frame's payload left"


def test_a_reader_with_nothing_queued_is_not_nudged() -> None:
    """A nudge lets a reader take what is queued and post its buffer. With nothing queued
    its reader waits for these very bytes (a header inside this frame) or is busy
    elsewhere, and a scheduler round trip cannot help."""
    b = YamuxSession(is_initiator=False)
    b.receive(frame(TYPE_DATA, FLAG_SYN, 1, 4, b"head"))
    st = b.accepted.popleft()
    assert b.pop(st, 4) == b"head"
    b.receive(HEADER.pack(0, TYPE_DATA, 0, 1, 64))
    assert st.target is None
    assert not st.nudged
    assert b.idle_reader_stream(64) is None


def test_an_expected_answer_is_credited_before_it_is_read_within_the_budget() -> None:
    """A client that just asked for 4 MiB on a new stream grants the credit at once: the
    answer crosses a long path in TCP's slow start, not behind a window that doubles a
    round trip at a time from 256 KiB. The session budget still bounds it."""
    p = Pair()
    st = p.a.open_stream()
    p.pump()
    peer = p.b.accepted.popleft()  # the asking side (b), before it has read a byte
    p.b.expect(peer, 4 * 1024 * 1024)
    p.pump()
    assert st.send_credit == 4 * 1024 * 1024
    p.b.expect(peer, 1024)  # a smaller expectation never shrinks a window
    p.pump()
    assert st.send_credit == 4 * 1024 * 1024
    for budget, granted in ((8 << 20, 8 << 20), (1 << 20, 0)):
        session = YamuxSession(is_initiator=False, session_window=budget)
        session.receive(frame(TYPE_DATA, FLAG_SYN, 1, 0))
        asking = session.accepted.popleft()
        session.expect(asking, 16 << 20)
        # Within the budget, and batched as ever (invariant 4: an update grants at least
        # half the window while the stream has credit left).
        assert asking.recv_credit == INITIAL_WINDOW + granted


def test_session_budget_limits_growth_across_streams() -> None:
    budget = 512 * 1024
    b = YamuxSession(is_initiator=False, session_window=budget)
    streams = []
    for sid in (1, 3, 5, 7):
        b.receive(frame(TYPE_DATA, FLAG_SYN, sid, INITIAL_WINDOW, bytes(INITIAL_WINDOW)))
        streams.append(b.accepted.popleft())
    for st in streams:
        b.pop(st, -1)
    extra = sum(max(st.recv_credit + st.buffered - INITIAL_WINDOW, 0) for st in streams)
    assert extra <= budget
    # Nobody starves: every stream can still receive at least its base window.
    assert all(st.recv_credit >= INITIAL_WINDOW for st in streams)
    assert any(st.recv_credit > INITIAL_WINDOW for st in streams)


def test_sessions_sharing_a_pool_stay_within_its_one_budget() -> None:
    """A fetch striped over several connections (one session each) may
    not buffer a session budget per connection; the pool bounds them together."""
    pool = WindowPool(limit=1024 * 1024)
    sessions = [
        YamuxSession(is_initiator=False, session_window=64 * 1024 * 1024, pool=pool)
        for _ in range(4)
    ]
    streams = []
    for session in sessions:
        for sid in (1, 3):
            session.receive(frame(TYPE_DATA, FLAG_SYN, sid, INITIAL_WINDOW, bytes(INITIAL_WINDOW)))
            streams.append(session.accepted.popleft())
    for _ in range(3):  # read everything, so every stream asks to grow, several times
        for session, st in zip([s for s in sessions for _ in (1, 3)], streams, strict=True):
            session.pop(st, -1)
    assert pool.extra_credit() <= pool.limit
    assert pool.extra_credit() == sum(session.extra_credit() for session in sessions)
    assert all(st.recv_credit >= INITIAL_WINDOW for st in streams)  # nobody starves
    assert any(st.recv_credit > INITIAL_WINDOW for st in streams)  # someone grew
    # Without the pool, the same reads grow far past its limit.
    alone = YamuxSession(is_initiator=False, session_window=64 * 1024 * 1024)
    for sid in (1, 3, 5, 7, 9, 11, 13, 15):
        alone.receive(frame(TYPE_DATA, FLAG_SYN, sid, INITIAL_WINDOW, bytes(INITIAL_WINDOW)))
        alone.pop(alone.accepted.popleft(), -1)
    assert alone.extra_credit() > pool.limit


def brute_extra(session: YamuxSession) -> int:
    """Invariant 3's sum, counted the slow way over the streams the session knows."""
    return sum(
        max(st.recv_credit + st.buffered - INITIAL_WINDOW, 0) for st in session.streams.values()
    )


@pytest.mark.parametrize("seed", range(8))
def test_the_kept_extra_credit_is_the_sum_over_the_streams_through_any_traffic(
    seed: int,
) -> None:
    """The session keeps `extra_credit` as streams' credit and buffers change (it is
    asked at every grant, of every session in a pool) instead of summing over all
    streams each time; through random data, reads, direct reads, expectations, resets,
    FINs and a cancelled read, it equals the slow sum, and the pool's equals its sessions'."""
    rng = random.Random(seed)
    pool = WindowPool()
    p = Pair()
    p.b = YamuxSession(is_initiator=False, pool=pool, session_window=8 << 20)
    other = YamuxSession(is_initiator=False, pool=pool)
    other.receive(frame(TYPE_DATA, FLAG_SYN, 1, 4096, bytes(4096)))  # a second member
    senders: list[Stream] = []
    for _ in range(400):
        live = [st for st in senders if st.stream_id in p.a.streams and not st.rst]
        receivers = list(p.b.streams.values())
        op = rng.randrange(8)
        if op == 0 or not live:
            if len(p.a.streams) < 6:
                senders.append(p.a.open_stream())
        elif op == 1:
            st = rng.choice(live)
            n = min(st.send_credit, rng.choice((1, 1000, 65536, 300_000)))
            if n and not st.fin_sent:
                p.send_data(p.a, st, bytes(n))
        elif op == 2 and receivers:
            st = rng.choice(receivers)
            p.b.pop(st, rng.choice((-1, 1, 5000, 70_000)))
        elif op == 3 and receivers:
            p.b.expect(rng.choice(receivers), rng.choice((1 << 20, 8 << 20)))
        elif op == 4 and receivers and rng.random() < 0.2:
            p.b.reset(rng.choice(receivers))
        elif op == 5 and rng.random() < 0.2:
            fin = p.a.fin_frame(rng.choice(live))
            if fin is not None:
                p.a_wire += p.a.take_outgoing() + fin
        elif op == 6:
            # A reader waiting in `readinto` takes payload straight into its buffer, and
            # is cancelled before it counts what it took: the bytes go back to the queue.
            st = rng.choice(live)
            peer = p.b.streams.get(st.stream_id)
            if peer is not None and not peer.queue and st.send_credit >= 2048 and not st.fin_sent:
                peer.target = memoryview(bytearray(4096))
                p.send_data(p.a, st, bytes(2048))
                p.pump()
                filled, peer.target, peer.target_filled = peer.target_filled, None, 0
                assert filled == 2048
                p.b.requeue(peer, bytes(filled))
        p.pump()
        while p.b.accepted:
            p.b.accepted.popleft()
        assert p.b.extra_credit() == brute_extra(p.b)
        assert pool.extra_credit() == brute_extra(p.b) + brute_extra(other)
        assert p.b.extra_credit() <= p.b.session_window


ECHO = b"\x13/multistream/1.0.0\n\x0d/yamux/1.0.0\n"  # what a listener that accepts sends


@pytest.mark.parametrize("split", [1, 5, len(ECHO), len(ECHO) + 3])
def test_a_dialler_that_did_not_wait_checks_the_muxer_echo_before_the_first_frame(
    split: int,
) -> None:
    """The dialler sent its /yamux/1.0.0 proposal and opened a stream in the same flight
    (p2p.transport.fast.upgrade): the listener's echo, in any split, is taken off before the frames
    that follow it, which are then yamux as usual."""
    dialler = YamuxSession(is_initiator=True, expect=ECHO)
    st = dialler.open_stream()
    wire = ECHO + frame(TYPE_WINDOW_UPDATE, FLAG_ACK, st.stream_id, 0)
    wire += frame(TYPE_DATA, 0, st.stream_id, 5, b"hello")
    dialler.receive(wire[:split])
    dialler.receive(wire[split:])
    assert st.acked and bytes(dialler.pop(st, -1)) == b"hello"


def test_a_listener_that_refuses_yamux_ends_the_session_before_any_frame() -> None:
    dialler = YamuxSession(is_initiator=True, expect=ECHO)
    dialler.open_stream()
    dialler.receive(ECHO[:20])  # the multistream header is fine
    with pytest.raises(YamuxProtocolError, match="did not accept yamux"):
        dialler.receive(b"\x03na\n")
    with pytest.raises(LocalProtocolError):
        YamuxSession(is_initiator=True, expect=b"x" * 4096)  # a prefix, not a payload
