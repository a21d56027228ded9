"""Would decrypting or hashing off the event loop pay on this machine? (issue 15 item 5)

    .venv/bin/python bench/offload.py [--seconds 1.0]

A fetch decrypts every Noise frame (ChaCha20-Poly1305, at most 65519 bytes of plaintext)
and hashes every chunk (BLAKE3, 1 MiB) on its trio event loop. `cryptography` >= 50 and
`blake3` release the GIL, so either could run in a worker thread beside the loop, but each
hand-over costs a `trio.to_thread.run_sync` round trip. This prints, measured here and now:

- the work per frame and per chunk, and its rate on one thread;
- the cost of one hand-over to a worker thread (an empty call), and of one frame's decrypt
  handed over;
- the share of one core that decrypting and hashing take at a given fetch rate (``--rate``
  MB/s), which is the most that moving them off the loop could give back, and only where
  another core sits idle.

Offloading pays when a batch's work is well above the hand-over and the loop is the
bottleneck. On the 2-vCPU AMD EPYC (AVX-512) VM, 2026-12-02: a 64 KiB frame decrypts in
~20 us (3.3 GB/s) and a 1 MiB chunk hashes in ~120 us (8.7 GB/s), while one hand-over costs
~126 us; at the WAN bench's ~100 MB/s both together take ~4% of a core. So neither moved.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import blake3
import trio
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

FRAME = 65519  # the largest Noise plaintext (65535 less the 16-byte tag)
CHUNK = 1 << 20
MAX_CALLS = 200_000  # bound each timing loop, whatever the machine's speed


def per_call(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``fn``, timed for about ``seconds``."""
    calls, start = 0, time.perf_counter()
    while calls < MAX_CALLS and time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


async def per_hop(fn: Callable[[], object], seconds: float) -> float:
    limiter = trio.CapacityLimiter(1)
    calls, start = 0, time.perf_counter()
    while calls < MAX_CALLS and time.perf_counter() - start < seconds:
        await trio.to_thread.run_sync(fn, limiter=limiter)
        calls += 1
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--rate", type=float, default=100.0, help="fetch rate, MB/s")
    args = parser.parse_args(argv)
    aead = ChaCha20Poly1305(os.urandom(32))
    nonce = bytes(12)
    sealed = aead.encrypt(nonce, os.urandom(FRAME), None)
    out = bytearray(FRAME)
    chunk = os.urandom(CHUNK)

    def decrypt() -> None:
        aead.decrypt_into(nonce, sealed, None, out)

    def hash_chunk() -> None:
        blake3.blake3(chunk).digest()

    frame_s = per_call(decrypt, args.seconds)
    chunk_s = per_call(hash_chunk, args.seconds)
    hop_s = trio.run(per_hop, lambda: None, args.seconds)
    hop_frame_s = trio.run(per_hop, decrypt, args.seconds)
    per_mb = (frame_s / FRAME + chunk_s / CHUNK) * 1e6
    print(f"decrypt one frame: {frame_s * 1e6:.1f} us ({FRAME / frame_s / 1e6:.0f} MB/s)")
    print(f"BLAKE3 one chunk:  {chunk_s * 1e6:.1f} us ({CHUNK / chunk_s / 1e6:.0f} MB/s)")
    print(f"hand-over to a thread, empty: {hop_s * 1e6:.1f} us; with a frame's decrypt: "
          f"{hop_frame_s * 1e6:.1f} us")  # fmt: skip
    print(f"decrypt + hash at {args.rate:.0f} MB/s: {per_mb * args.rate:.1%} of one core")
    print(f"a frame's decrypt is {frame_s / hop_s:.2f}x a hand-over; a chunk's hash "
          f"{chunk_s / hop_s:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
