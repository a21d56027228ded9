"""Noise transport messages after the handshake, without I/O.

Theory of operation
-------------------
libp2p's Noise spec (https://github.com/libp2p/specs/tree/master/noise) frames every transport
message as a 2-byte big-endian length followed by a ChaCha20-Poly1305 ciphertext of at most 65535
bytes, the last 16 of which are the tag. This module holds the three pieces the I/O shell needs:

1. `CipherState`: one direction's key and 64-bit nonce counter. The nonce is 4 zero bytes then the
   counter, little-endian (Noise spec section 12.3, ChaChaPoly). The counter goes up by one for each
   message that is sealed, or opened successfully; it is never reused and never reset (we do not
   rekey), and the value 2**64-1 is reserved, so a cipher that reaches it refuses to go on.
2. `FrameReader`: a reusable receive buffer. The shell `recv_into`s its free tail with one large
   call, then takes every complete frame out of it as a memoryview: no copies, no per-frame
   allocation. A frame shorter than a tag is a protocol error; a frame can't be longer than 65535
   bytes because the length prefix has 2 bytes.
3. `FrameWriter`: seals a list of plaintext pieces into one preallocated send buffer, so a whole
   batch of frames goes out with a single `send`. Small pieces are coalesced into one frame; large
   pieces are cut into 65519-byte frames straight from the caller's memoryview.

A bad tag or an impossible length raises `NoiseProtocolError`; the shell then closes the
connection, since a Noise session cannot resynchronise after a lost or forged message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from .errors import LocalProtocolError, NoiseProtocolError

# The length prefix has 2 bytes, so a Noise transport message is at most 65535 bytes (spec).
MAX_FRAME = 65535
TAG_LEN = 16
LEN_PREFIX = 2
# Plaintext per frame: 65535 minus the Poly1305 tag, as go-libp2p's MaxPlaintextLength.
MAX_PLAINTEXT = MAX_FRAME - TAG_LEN
# Noise reserves nonce 2**64-1; a cipher must stop before using it (Noise spec section 5.1).
MAX_NONCE = 2**64 - 1
# Pieces below this size are copied into one coalesced frame instead of getting frames of their
# own: yamux headers and window updates are 12 bytes, and a frame costs 18 bytes of overhead.
COALESCE_BELOW = 4096

_NONCE = struct.Struct("<4xQ")
_LEN = struct.Struct(">H")


class CipherState:
    """One direction of a Noise session: key plus nonce counter (see the module docstring)."""

    __slots__ = ("_aead", "nonce")

    def __init__(self, key: bytes, nonce: int = 0) -> None:
        if len(key) != 32:
            raise LocalProtocolError("a Noise ChaChaPoly key has 32 bytes")
        self._aead = ChaCha20Poly1305(key)
        self.nonce = nonce

    def _take_nonce(self) -> bytes:
        n = self.nonce
        if n >= MAX_NONCE:
            raise LocalProtocolError("Noise nonce counter exhausted; the connection must close")
        return _NONCE.pack(n)

    def encrypt_into(self, plaintext: bytes | bytearray | memoryview, out: memoryview) -> int:
        """Seal `plaintext` into `out` (exactly len(plaintext) + 16 bytes); return that size."""
        nonce = self._take_nonce()
        written = self._aead.encrypt_into(nonce, plaintext, None, out)
        self.nonce += 1
        return written

    def encrypt(self, plaintext: bytes | memoryview) -> bytes:
        nonce = self._take_nonce()
        sealed = self._aead.encrypt(nonce, plaintext, None)
        self.nonce += 1
        return sealed

    def decrypt(self, ciphertext: bytes | memoryview) -> bytes:
        """Open one message; the counter moves only on success."""
        nonce = self._take_nonce()
        try:
            plaintext = self._aead.decrypt(nonce, ciphertext, None)
        except InvalidTag:
            raise NoiseProtocolError("Noise message failed authentication (bad tag)") from None
        self.nonce += 1
        return plaintext

    def decrypt_into(self, ciphertext: bytes | memoryview, out: memoryview) -> int:
        """Open one message into `out` (exactly len(ciphertext) - 16 bytes long)."""
        nonce = self._take_nonce()
        try:
            n = self._aead.decrypt_into(nonce, ciphertext, None, out)
        except InvalidTag:
            raise NoiseProtocolError("Noise message failed authentication (bad tag)") from None
        self.nonce += 1
        return n


class FrameReader:
    """Reassembles length-prefixed Noise frames from large reads (see the module docstring).

    The view returned by `next_frame` stays valid until the next `recv_space` call, which may
    move the unread bytes to the front of the buffer.
    """

    __slots__ = ("_buf", "_end", "_start", "_view")

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 2 * (MAX_FRAME + LEN_PREFIX):
            raise LocalProtocolError("FrameReader capacity must hold two whole frames")
        self._buf = bytearray(capacity)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return self._end - self._start

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def grow(self, capacity: int) -> None:
        """Move to a larger buffer (views handed out earlier stay valid: they keep the old one)."""
        if capacity <= len(self._buf):
            return
        start, end = self._start, self._end
        buf = bytearray(capacity)
        buf[: end - start] = self._view[start:end]
        self._buf = buf
        self._view = memoryview(buf)
        self._start, self._end = 0, end - start

    def recv_space(self) -> memoryview:
        """The free tail to `recv_into`; at least one whole frame long."""
        if len(self._buf) - self._end < MAX_FRAME + LEN_PREFIX:
            start, end = self._start, self._end
            self._view[: end - start] = self._view[start:end]
            self._start, self._end = 0, end - start
        return self._view[self._end :]

    def commit(self, n: int) -> None:
        """Record that `n` bytes were received into the last `recv_space` view."""
        if n < 0 or self._end + n > len(self._buf):
            raise LocalProtocolError("FrameReader.commit past the buffer")
        self._end += n

    def feed(self, data: bytes | memoryview) -> int:
        """Copy as much of `data` as fits into the buffer; return how much was taken."""
        space = self.recv_space()
        n = min(len(space), len(data))
        space[:n] = data[:n]
        self._end += n
        return n

    def next_frame(self) -> memoryview | None:
        """The next complete ciphertext (tag included), or None if more bytes are needed."""
        start = self._start
        avail = self._end - start
        if avail < LEN_PREFIX:
            return None
        buf = self._buf
        length = (buf[start] << 8) | buf[start + 1]
        if length < TAG_LEN:
            raise NoiseProtocolError(f"Noise frame of {length} bytes is shorter than its tag")
        if avail < LEN_PREFIX + length:
            return None
        self._start = start + LEN_PREFIX + length
        return self._view[start + LEN_PREFIX : self._start]


class FrameWriter:
    """Seals plaintext pieces into a reusable send buffer (see the module docstring).

    The buffer grows on demand up to `max_capacity`, so connections that only carry small
    messages never hold a large one.
    """

    __slots__ = ("_buf", "_scratch", "_view", "cipher", "max_capacity")

    def __init__(self, cipher: CipherState, max_capacity: int = (1 << 20) + 64 * 1024) -> None:
        if max_capacity < MAX_FRAME + LEN_PREFIX:
            raise LocalProtocolError("FrameWriter capacity must hold one whole frame")
        self.cipher = cipher
        self.max_capacity = max_capacity
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._scratch = bytearray()

    @property
    def capacity(self) -> int:
        """The largest batch, in wire bytes, that one `seal` can produce."""
        return self.max_capacity

    @staticmethod
    def wire_bound(plaintext_len: int) -> int:
        """Upper bound on the wire size of one piece of `plaintext_len` bytes."""
        return plaintext_len + (TAG_LEN + LEN_PREFIX) * (plaintext_len // MAX_PLAINTEXT + 1)

    def _reserve(self, need: int) -> None:
        if need <= len(self._buf):
            return
        if need > self.max_capacity:
            raise LocalProtocolError("Noise batch does not fit the send buffer")
        size = min(max(need, 2 * len(self._buf)), self.max_capacity)
        # The old buffer is dropped, not released: views of it that are still being sent
        # keep it alive until they are done.
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)

    def _seal(self, pos: int, plaintext: bytes | bytearray | memoryview) -> int:
        n = len(plaintext)
        view = self._view
        _LEN.pack_into(view, pos, n + TAG_LEN)
        self.cipher.encrypt_into(plaintext, view[pos + LEN_PREFIX : pos + LEN_PREFIX + n + TAG_LEN])
        return pos + LEN_PREFIX + n + TAG_LEN

    def seal(self, pieces: Sequence[bytes | memoryview]) -> memoryview:
        """Seal every piece, in order, and return the wire bytes (a view of the send buffer,
        valid until the next call). Raises LocalProtocolError if the batch could exceed
        `max_capacity`: callers size batches with `wire_bound`."""
        self._reserve(sum(self.wire_bound(len(p)) for p in pieces))
        pos = 0
        scratch = self._scratch
        for piece in pieces:
            n = len(piece)
            if n < COALESCE_BELOW:
                if len(scratch) + n > MAX_PLAINTEXT:
                    pos = self._seal(pos, scratch)
                    scratch.clear()
                scratch += piece
                continue
            if scratch:
                pos = self._seal(pos, scratch)
                scratch.clear()
            mv = piece if isinstance(piece, memoryview) else memoryview(piece)
            for off in range(0, n, MAX_PLAINTEXT):
                pos = self._seal(pos, mv[off : off + MAX_PLAINTEXT])
        if scratch:
            pos = self._seal(pos, scratch)
            scratch.clear()
        return self._view[:pos]
