"""Noise transport framing and nonces, without sockets."""

from __future__ import annotations

import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from noise.backends.default.ciphers import ChaCha20Cipher  # type: ignore[import-untyped]

from p2p.transport.fast.errors import LocalProtocolError, NoiseProtocolError
from p2p.transport.fast.noise_frames import (
    MAX_FRAME,
    MAX_NONCE,
    MAX_PLAINTEXT,
    CipherState,
    FrameReader,
    FrameWriter,
)

KEY = bytes(range(32))


def test_nonce_is_four_zero_bytes_then_little_endian_counter() -> None:
    for n in (0, 1, 2**32 + 5, MAX_NONCE - 1):
        ours = CipherState(KEY, n).encrypt(b"payload")
        nonce = b"\0\0\0\0" + n.to_bytes(8, "little")
        assert ours == ChaCha20Poly1305(KEY).encrypt(nonce, b"payload", None)


def test_matches_the_noiseprotocol_package_message_by_message() -> None:
    ref = ChaCha20Cipher()
    ref.initialize(KEY)
    ours = CipherState(KEY)
    for n in range(5):
        msg = os.urandom(100 + n)
        assert ours.encrypt(msg) == ref.encrypt(KEY, n, None, msg)


def test_counter_moves_on_success_only_and_never_reaches_the_reserved_value() -> None:
    sender, receiver = CipherState(KEY), CipherState(KEY)
    first = sender.encrypt(b"one")
    second = sender.encrypt(b"two")
    with pytest.raises(NoiseProtocolError, match="bad tag"):
        receiver.decrypt(second)  # out of order: wrong nonce
    assert receiver.nonce == 0
    assert receiver.decrypt(first) == b"one"
    assert receiver.decrypt(second) == b"two"
    assert receiver.nonce == 2
    last = CipherState(KEY, MAX_NONCE)
    with pytest.raises(LocalProtocolError, match="exhausted"):
        last.encrypt(b"x")


def test_tampered_ciphertext_fails() -> None:
    sealed = bytearray(CipherState(KEY).encrypt(b"hello world"))
    sealed[3] ^= 1
    with pytest.raises(NoiseProtocolError):
        CipherState(KEY).decrypt(bytes(sealed))


def test_writer_cuts_large_pieces_and_coalesces_small_ones() -> None:
    writer = FrameWriter(CipherState(KEY), 4 << 20)
    big = os.urandom(3 * MAX_PLAINTEXT + 7)
    wire = bytes(writer.seal([b"h1", b"h2", big, b"tail"]))
    lengths = []
    reader = FrameReader(1 << 20)
    assert reader.feed(wire) == len(wire)
    plain = bytearray()
    dec = CipherState(KEY)
    while (frame := reader.next_frame()) is not None:
        lengths.append(len(frame))
        plain += dec.decrypt(frame)
    assert bytes(plain) == b"h1h2" + big + b"tail"
    assert lengths == [4 + 16, MAX_FRAME, MAX_FRAME, MAX_FRAME, 7 + 16, 4 + 16]
    assert max(lengths) <= MAX_FRAME


def test_writer_refuses_a_batch_larger_than_its_buffer() -> None:
    writer = FrameWriter(CipherState(KEY), MAX_FRAME + 2)
    with pytest.raises(LocalProtocolError, match="does not fit"):
        writer.seal([os.urandom(MAX_PLAINTEXT + 1)])


def test_frame_shorter_than_a_tag_is_a_protocol_error() -> None:
    reader = FrameReader(1 << 18)
    reader.feed(struct.pack(">H", 15) + bytes(15))
    with pytest.raises(NoiseProtocolError, match="shorter than its tag"):
        reader.next_frame()


def test_reader_waits_for_whole_frames_and_grows_without_losing_bytes() -> None:
    sealed = CipherState(KEY).encrypt(b"abc")
    wire = struct.pack(">H", len(sealed)) + sealed
    reader = FrameReader(1 << 18)
    reader.feed(wire[:5])
    assert reader.next_frame() is None
    reader.grow(1 << 20)
    assert reader.capacity == 1 << 20
    reader.feed(wire[5:])
    frame = reader.next_frame()
    assert frame is not None
    assert CipherState(KEY).decrypt(frame) == b"abc"
