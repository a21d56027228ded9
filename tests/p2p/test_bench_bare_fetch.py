"""bench/bare_fetch.py (the pure-Python floor of a fetch) and bench/stack.py's
fast_stream_store row must do a fetch's real work (their figures are compared with the
real fetch), and refuse bytes that are not what was sent."""

from __future__ import annotations

import mmap
import socket
import sys
import threading
from pathlib import Path

import pytest

from p2p.blob.messages import encode_chunk_header
from p2p.transport.fast.noise_frames import CipherState, FrameWriter
from p2p.transport.fast.yamux_core import HEADER as YAMUX_HEADER
from p2p.transport.fast.yamux_core import TYPE_DATA

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bare_fetch  # noqa: E402
import stack  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _sealed_chunk(index: int, body: bytes, *, body_length: int | None = None) -> bytes:
    header = encode_chunk_header(index, len(body))
    pieces: list[bytes | memoryview] = [
        YAMUX_HEADER.pack(0, TYPE_DATA, 0, bare_fetch.STREAM_ID, len(header)) + header,
        YAMUX_HEADER.pack(0, TYPE_DATA, 0, bare_fetch.STREAM_ID, body_length or len(body)),
        memoryview(body),
    ]
    return bytes(FrameWriter(CipherState(bare_fetch.KEY), 4 * MiB).seal(pieces))


def _pair_sending(data: bytes) -> tuple[socket.socket, socket.socket, threading.Thread]:
    a, b = socket.socketpair()
    b.settimeout(30)  # a receiver waiting for bytes that never come fails, not hangs
    sender = threading.Thread(target=a.sendall, args=(data,), daemon=True)
    sender.start()
    return a, b, sender


def test_receiver_decodes_a_chunk_straight_into_the_buffer() -> None:
    body = bytes(range(256)) * 1024 * 3  # 768 KiB: twelve Noise frames
    a, b, sender = _pair_sending(_sealed_chunk(7, body))
    with a, b:
        out = memoryview(mmap.mmap(-1, MiB))
        index, length = bare_fetch._Receiver(b).chunk_into(out)
        sender.join(30)
    assert (index, length) == (7, len(body))
    assert out[:length] == body


def test_receiver_refuses_a_body_that_disagrees_with_its_chunk_header() -> None:
    body = b"x" * 8192
    a, b, _ = _pair_sending(_sealed_chunk(0, body, body_length=len(body) - 1))
    with a, b, pytest.raises(bare_fetch.BadChunk):
        bare_fetch._Receiver(b).chunk_into(memoryview(mmap.mmap(-1, MiB)))


@pytest.mark.slow
def test_bare_fetch_row_moves_verified_chunks_between_processes(tmp_path: Path) -> None:
    # Two processes over 127.0.0.1: the child checks every chunk against the hashes the
    # sender computed and raises (no acknowledgement) on a mismatch.
    row = stack.run_row("bare_fetch", 8 * MiB, reps=2, directory=tmp_path)
    assert [rep.seconds > 0 and rep.mb_s > 0 for rep in row.reps] == [True, True]
    assert all(rep.sender_cpu_s > 0 and rep.receiver_cpu_s > 0 for rep in row.reps)
    assert list(tmp_path.iterdir()) == []  # source and destination files cleaned up


@pytest.mark.slow
def test_fast_stream_store_row_publishes_a_verified_blob_between_processes(
    tmp_path: Path,
) -> None:
    # The receiving child verifies every chunk against the payload's hashes, writes it
    # into a real store and publishes the blob; a chunk that failed or a blob that did not
    # publish kills the child before it acknowledges, and run_row raises.
    row = stack.run_row("fast_stream_store", 3 * MiB + 1000, reps=2, directory=tmp_path)
    assert [rep.seconds > 0 and rep.mb_s > 0 for rep in row.reps] == [True, True]
    assert all(rep.receiver_cpu_s > 0 for rep in row.reps)
    assert list(tmp_path.iterdir()) == []  # each rep's store removed
