"""Hypothesis fuzzing of the two frame parsers.

Invariants: whatever bytes arrive, whole or cut at random points, only our remote protocol
error types escape; and a split changes nothing about what the parser concludes.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.transport.fast.errors import NoiseProtocolError, YamuxProtocolError
from p2p.transport.fast.noise_frames import CipherState, FrameReader, FrameWriter
from p2p.transport.fast.yamux_core import HEADER, YamuxSession

KEY = bytes(range(32))
FUZZ = settings(max_examples=250, deadline=None)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


def noise_decode(pieces: list[bytes]) -> tuple[bytes, str | None]:
    reader = FrameReader(1 << 18)
    cipher = CipherState(KEY)
    plain = bytearray()
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[reader.feed(view) :]
                while (frame := reader.next_frame()) is not None:
                    plain += cipher.decrypt(frame)
    except NoiseProtocolError as err:
        return bytes(plain), type(err).__name__
    return bytes(plain), None


@FUZZ
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_noise_random_bytes_raise_only_noise_errors(data: bytes, cuts: list[int]) -> None:
    whole = noise_decode([data])
    assert noise_decode(split(data, cuts)) == whole


@FUZZ
@given(
    pieces=st.lists(st.binary(max_size=70000), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 300000), max_size=12),
    flip=st.one_of(st.none(), st.integers(0, 300000)),
)
def test_noise_roundtrip_in_any_split_and_tampering_never_yields_wrong_bytes(
    pieces: list[bytes], cuts: list[int], flip: int | None
) -> None:
    wire = bytearray(FrameWriter(CipherState(KEY), 1 << 20).seal(pieces))
    original = b"".join(pieces)
    if flip is None or not wire:
        assert noise_decode(split(bytes(wire), cuts)) == (original, None)
        return
    wire[flip % len(wire)] ^= 0x40
    plain, _ = noise_decode(split(bytes(wire), cuts))
    assert original.startswith(plain), "a tampered stream must never decode to other bytes"


@st.composite
def yamux_frames(draw: st.DrawFn) -> bytes:
    """Mostly plausible frames (right version, small IDs, sane lengths) and some garbage."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.integers(0, 9)) == 0:
            out += draw(st.binary(max_size=20))
            continue
        typ = draw(st.integers(0, 4))
        flags = draw(st.integers(0, 15))
        sid = draw(st.integers(0, 9))
        if typ == 0:
            length = draw(st.integers(0, 300))
            out += HEADER.pack(draw(st.sampled_from([0, 0, 0, 1])), typ, flags, sid, length)
            out += draw(st.binary(min_size=length, max_size=length))
        else:
            length = draw(st.sampled_from([0, 1, 4096, 2**31, 2**32 - 1]))
            out += HEADER.pack(0, typ, flags, sid, length)
    return bytes(out)


def yamux_outcome(is_initiator: bool, pieces: list[bytes]) -> tuple[object, ...]:
    session = YamuxSession(is_initiator, max_streams=4)
    error = None
    try:
        for piece in pieces:
            session.receive(piece)
    except YamuxProtocolError as err:
        error = str(err)
    delivered = {s.stream_id: (b"".join(s.queue), s.fin_received, s.rst) for s in session.accepted}
    return error, delivered, session.take_outgoing(), session.remote_go_away


@FUZZ
@given(
    data=st.one_of(yamux_frames(), st.binary(max_size=400)),
    cuts=st.lists(st.integers(0, 5000), max_size=12),
    is_initiator=st.booleans(),
)
def test_yamux_parser_only_raises_protocol_errors_whatever_the_split(
    data: bytes, cuts: list[int], is_initiator: bool
) -> None:
    whole = yamux_outcome(is_initiator, [data])
    assert yamux_outcome(is_initiator, split(data, cuts)) == whole


def test_split_header_is_reassembled() -> None:
    """A regression guard: a header cut in the middle must parse like a whole one."""
    data = HEADER.pack(0, 0, 1, 2, 3) + b"abc"
    for cut in range(len(data) + 1):
        outcome = yamux_outcome(True, [data[:cut], data[cut:]])
        assert outcome[1] == {2: (b"abc", False, False)}
    assert struct.calcsize(">BBHII") == 12


@FUZZ
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["recv", "pop", "pop_into", "target"]), st.integers(1, 70000)),
        max_size=40,
    )
)
def test_recycled_decryption_buffers_never_corrupt_queued_bytes(
    ops: list[tuple[str, int]],
) -> None:
    """Invariant 8 of yamux_core: a buffer goes back to the pool only once fully read, so
    whatever mix of frames and reads happens, the reader sees exactly the bytes sent."""
    session = YamuxSession(is_initiator=False, max_window=2**32 - 1)
    session.receive(HEADER.pack(0, 0, 1, 1, 0))  # SYN on stream 1
    stream = session.accepted.popleft()
    stream.recv_credit = 2**31
    sent = bytearray()
    got = bytearray()
    counter = 0
    for op, n in ops:
        if op == "recv":
            n = min(n, 65519)
            session.receive(HEADER.pack(0, 0, 0, 1, n))
            view = memoryview(session.payload_buffer())[:n]
            assert session.is_payload(n)
            chunk = bytes((counter + i) % 251 for i in range(n))
            counter += n
            view[:] = chunk
            session.receive(view)
            sent += chunk
        elif op in ("pop", "pop_into") and stream.target is not None:
            # A reader blocked in readinto returns what its buffer got before reading again.
            got += stream.target[: stream.target_filled]
            stream.target = None
        elif op == "pop":
            got += session.pop(stream, n)
        elif op == "pop_into":
            out = bytearray(n)
            k = session.pop_into(stream, memoryview(out))
            got += out[:k]
        elif stream.target is None:
            stream.target = memoryview(bytearray(n))
            stream.target_filled = 0
        else:
            got += stream.target[: stream.target_filled]
            stream.target = None
    if stream.target is not None:
        got += stream.target[: stream.target_filled]
        stream.target = None
    got += session.pop(stream, -1)
    assert bytes(got) == bytes(sent)
