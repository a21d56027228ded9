"""The yamux session state machine, without I/O (sans-IO; STYLE.md section 1).

Theory of operation
-------------------
Yamux (https://github.com/hashicorp/yamux/blob/master/spec.md, libp2p `/yamux/1.0.0`) sends
12-byte headers `version:u8 type:u8 flags:u16 stream_id:u32 length:u32`, big-endian; DATA
frames carry `length` bytes of payload. `YamuxSession.receive` takes decrypted bytes in any
split, updates the state of every stream, and queues the control frames we owe the peer
(ACKs, RSTs, pongs, window updates) in an outgoing buffer that the I/O shell sends. The shell
learns what changed through `Stream.wake` (a plain callback) and `YamuxSession.accepted`.

Invariants:
1. Stream IDs: the dialler (initiator) uses odd IDs, the listener even ones; ID 0 is the
   session. A SYN with our own parity, ID 0, or an ID already open is a protocol error.
2. Flow control: each direction of a stream starts with a 256 KiB window (spec). A DATA frame
   longer than the receive credit we granted is a protocol error (go-yamux does the same), so
   the bytes buffered for a stream never exceed the credit we handed out.
3. A stream's window grows past 256 KiB only as the application reads (to twice the bytes
   read so far, up to 16 MiB) or says it expects an answer of a given size (`expect`, up to
   16 MiB). A stream nobody reads or expects anything on so holds at most 256 KiB, and all
   credit beyond the 256 KiB base comes out of one session budget, so a peer can make us
   buffer at most `max_streams * 256 KiB + session_window` bytes. Sessions that share a
   `WindowPool` (several connections to one peer) also keep their credit beyond the base
   within the pool's one limit.
4. Window updates are batched: one is sent when it can grant at least half the window, or when
   the peer is about to stall (under 128 KiB of credit left). Never one per frame.
5. Frames for streams that we no longer know (closed and forgotten, or refused) are dropped,
   payload included, as go-yamux does. A stream is forgotten once both directions are done.
6. Unknown frame types and versions, an oversized window, or a peer that lets our control
   frames pile up without reading them, raise `YamuxProtocolError`: the shell sends GO_AWAY
   with its code and closes. A GO_AWAY from the peer with a non-zero code ends the session;
   with code 0 it only forbids opening new streams, as in go-yamux.
7. Payload bytes are kept as memoryviews of the buffers given to `receive` (no copy): callers
   must hand in buffers that they will not reuse (e.g. the `bytes` a decryption returns).
   When a reader is blocked in `readinto`, payload goes straight into its buffer instead.
8. The exception to 7: a `PlainBuffer` from `payload_buffer()`, filled with plaintext that
   `is_payload` said is payload of one stream, becomes at most one queue entry; the session
   takes it back for reuse once the application has read that entry entirely, which saves an
   allocation per 64 KiB frame when the reader is not waiting.
9. A dialler that proposed `/yamux/1.0.0` without waiting for the answer
   (p2p.transport.fast.upgrade) gives the session the bytes that answer must be (`expect`):
   the first bytes received must match them, else the peer refused yamux and the session
   ends; the first frame follows them. Frames we send meanwhile follow our proposal on the
   wire, so a listener that accepts reads them as yamux.
"""

from __future__ import annotations

import struct
import weakref
from collections import deque
from collections.abc import Callable

from .errors import LocalProtocolError, YamuxProtocolError

HEADER = struct.Struct(">BBHII")
HEADER_LEN = 12
VERSION = 0

TYPE_DATA = 0x0
TYPE_WINDOW_UPDATE = 0x1
TYPE_PING = 0x2
TYPE_GO_AWAY = 0x3

FLAG_SYN = 0x1
FLAG_ACK = 0x2
FLAG_FIN = 0x4
FLAG_RST = 0x8

GO_AWAY_NORMAL = 0x0
GO_AWAY_PROTOCOL_ERROR = 0x1
GO_AWAY_INTERNAL_ERROR = 0x2

# Every stream starts with this window in both directions (yamux spec).
INITIAL_WINDOW = 256 * 1024
# A stream that is being read grows its window to this: 16 MiB is go-yamux's maximum too, and at
# 1 GB/s it covers 16 ms of round trip.
DEFAULT_MAX_WINDOW = 16 * 1024 * 1024
# Credit granted beyond each stream's 256 KiB base, summed over the session (invariant 3): four
# streams at full window. Bounds what one peer can make us buffer.
DEFAULT_SESSION_WINDOW = 64 * 1024 * 1024
# Credit beyond the base windows summed over all sessions that share one `WindowPool` (the
# shell's default: every session of the process). Credit is spent when the server writes
# into its socket, so a lane of a fetch striped over eight connections at 200 ms has about
# 6 MiB out (its share of the 25 MB bandwidth-delay product, and the server's send buffer,
# which holds up to 4 MiB): eight lanes wanted most of 64 MiB, and lanes waited for credit
# (lone eu->asia 256 MiB: 58-60 MB/s at 64 MiB, 62.8-63.5 at 128 MiB, 62.3-63.0 at 256).
# It bounds what peers can make this process buffer beyond the base windows when it stops
# reading (its chunk buffers full, its disk slow): 128 MiB.
DEFAULT_SHARED_WINDOW = 128 * 1024 * 1024
# Open streams per session (both directions). py-libp2p's backlog is 256 as well; 256 * 256 KiB
# of unread base windows is the worst a peer can make us hold on top of the session budget.
DEFAULT_MAX_STREAMS = 256
# Control frames we owe but the peer does not read (e.g. a ping flood while it never reads):
# past this the peer is misbehaving and the session ends.
MAX_PENDING_CONTROL = 1024 * 1024
# The longest prefix a session may expect before the first frame (invariant 9): the
# multistream header's and the protocol's echoes are 34 bytes.
MAX_EXPECTED_PREFIX = 256
# Windows and lengths are u32 on the wire.
MAX_U32 = 2**32 - 1
# Size of recycled decryption buffers: the largest Noise plaintext (65535 - 16-byte tag).
PLAIN_BUFFER_SIZE = 65535 - 16
# Recycled buffers kept per session (4 MiB); beyond that they are left to the allocator.
PLAIN_POOL_LIMIT = 64


class PlainBuffer(bytearray):
    """A decryption buffer that the session recycles (invariant 8)."""

    __slots__ = ()


def _noop() -> None:
    return None


class Stream:
    """The state of one yamux stream. The I/O shell reads these fields; only the session and
    the shell's read path (through the session's methods) change them."""

    __slots__ = (
        "acked",
        "buffered",
        "extra",
        "fin_received",
        "fin_sent",
        "nudged",
        "outbound",
        "queue",
        "recv_credit",
        "rst",
        "send_credit",
        "stream_id",
        "taken",
        "target",
        "target_filled",
        "wake",
        "window_target",
    )

    def __init__(self, stream_id: int, outbound: bool) -> None:
        self.stream_id = stream_id
        self.outbound = outbound
        self.acked = not outbound
        self.send_credit = INITIAL_WINDOW
        self.recv_credit = INITIAL_WINDOW
        self.window_target = INITIAL_WINDOW
        # Bytes the application has read so far (drives the window growth, invariant 3).
        self.taken = 0
        self.queue: deque[memoryview] = deque()
        self.buffered = 0
        # What this stream adds to its session's `extra_credit` (kept by the session).
        self.extra = 0
        self.fin_received = False
        self.fin_sent = False
        self.rst = False
        # A blocked `readinto`'s buffer and how much of it is filled (invariant 7).
        self.target: memoryview | None = None
        self.target_filled = 0
        # For the shell: it already let the reader run once before queueing payload that
        # arrived on an empty queue; cleared whenever the application reads.
        self.nudged = False
        # Called whenever readable data, EOF, reset or send credit changes.
        self.wake: Callable[[], None] = _noop

    @property
    def readable(self) -> bool:
        return bool(self.queue) or self.fin_received or self.rst

    @property
    def done(self) -> bool:
        """Both directions finished: no more frames are expected either way."""
        return self.rst or (self.fin_received and self.fin_sent)


class WindowPool:
    """A receive-credit budget shared by several sessions (invariant 3, across sessions):
    the credit granted beyond every stream's 256 KiB base, summed over the member
    sessions, stays within ``limit``."""

    def __init__(self, limit: int = DEFAULT_SHARED_WINDOW) -> None:
        if limit < 0:
            raise LocalProtocolError("a window pool's limit must not be negative")
        self.limit = limit
        self._sessions: weakref.WeakSet[YamuxSession] = weakref.WeakSet()

    def join(self, session: YamuxSession) -> None:
        self._sessions.add(session)

    def extra_credit(self) -> int:
        return sum(session.extra_credit() for session in list(self._sessions))


class YamuxSession:
    """One yamux session's state (see the module docstring for the rules it enforces)."""

    def __init__(
        self,
        is_initiator: bool,
        *,
        max_window: int = DEFAULT_MAX_WINDOW,
        session_window: int = DEFAULT_SESSION_WINDOW,
        max_streams: int = DEFAULT_MAX_STREAMS,
        pool: WindowPool | None = None,
        expect: bytes = b"",
    ) -> None:
        if len(expect) > MAX_EXPECTED_PREFIX:
            raise LocalProtocolError("an expected prefix is a multistream answer, not data")
        if not INITIAL_WINDOW <= max_window <= MAX_U32:
            raise LocalProtocolError("max_window must be between 256 KiB and 2**32-1")
        self.is_initiator = is_initiator
        self.pool = pool
        if pool is not None:
            pool.join(self)
        self.max_window = max_window
        self.session_window = session_window
        self.max_streams = max_streams
        self.streams: dict[int, Stream] = {}
        # `extra_credit`, kept up to date as each stream's credit and buffer change: it is
        # asked at every grant, of every session in the pool (cProfile of a 16-fetcher
        # swarm: 603k sums over all streams, ~3% of the fetchers' CPU).
        self._extra = 0
        self._next_id = 1 if is_initiator else 2
        # Inbound streams not yet handed to the application.
        self.accepted: deque[Stream] = deque()
        self.remote_go_away: int | None = None
        self.local_go_away = False
        self.pongs: list[int] = []
        self._pool: list[PlainBuffer] = []
        self._out = bytearray()
        # Bytes the peer must send before its first frame (invariant 9): what is left of it.
        self._expect = memoryview(expect)
        # Parser state: a partial header, or the payload still expected for a DATA frame.
        self._hdr = bytearray()
        self._payload_left = 0
        self._payload_stream: Stream | None = None
        self._payload_flags = 0

    # ---------------------------------------------------------------- outgoing control bytes

    @property
    def has_outgoing(self) -> bool:
        return bool(self._out)

    def take_outgoing(self, limit: int = 1 << 20) -> bytes:
        """Control frames to send now, in order (at most `limit` bytes, whole frames)."""
        out = self._out
        if len(out) <= limit:
            data = bytes(out)
            out.clear()
            return data
        cut = limit - limit % HEADER_LEN
        data = bytes(out[:cut])
        del out[:cut]
        return data

    def _control(self, typ: int, flags: int, stream_id: int, length: int) -> None:
        if len(self._out) >= MAX_PENDING_CONTROL:
            raise YamuxProtocolError("peer does not read the control frames we owe it")
        self._out += HEADER.pack(VERSION, typ, flags, stream_id, length)

    # --------------------------------------------------------------------------- receiving

    @property
    def awaiting_echo(self) -> bool:
        """Part of the expected multistream answer (invariant 9) has not arrived yet."""
        return bool(self._expect)

    def receive(self, data: bytes | memoryview) -> None:
        """Parse decrypted bytes (any split); see invariant 7 about buffer ownership."""
        mv = data if isinstance(data, memoryview) else memoryview(data)
        pos = 0
        n = len(mv)
        if self._expect:
            pos = min(n, len(self._expect))
            if mv[:pos] != self._expect[:pos]:
                raise YamuxProtocolError(
                    f"the peer did not accept yamux: it answered {bytes(mv[:64])!r}", None
                )
            self._expect = self._expect[pos:]
        hdr = self._hdr
        while pos < n:
            left = self._payload_left
            if left:
                take = min(left, n - pos)
                st = self._payload_stream
                if st is not None:
                    self._deliver(st, mv[pos : pos + take])
                pos += take
                self._payload_left = left - take
                if left == take:
                    self._end_payload()
                continue
            if hdr or n - pos < HEADER_LEN:
                take = min(HEADER_LEN - len(hdr), n - pos)
                hdr += mv[pos : pos + take]
                pos += take
                if len(hdr) < HEADER_LEN:
                    break
                fields = HEADER.unpack(hdr)
                hdr.clear()
            else:
                fields = HEADER.unpack_from(mv, pos)
                pos += HEADER_LEN
            self._on_header(*fields)

    def _on_header(self, version: int, typ: int, flags: int, stream_id: int, length: int) -> None:
        if version != VERSION:
            raise YamuxProtocolError(f"yamux version {version} is not 0")
        if typ in (TYPE_DATA, TYPE_WINDOW_UPDATE):
            st = self._stream_for(stream_id, flags)
            if typ == TYPE_DATA:
                if st is not None:
                    if length > st.recv_credit:
                        raise YamuxProtocolError(
                            f"DATA of {length} bytes on stream {stream_id} exceeds the "
                            f"{st.recv_credit}-byte window"
                        )
                    st.recv_credit -= length
                    self._recount(st)
                if length:
                    self._payload_left = length
                    self._payload_stream = st if st is not None and not st.rst else None
                    self._payload_flags = flags
                    return
                self._apply_flags(st, flags)
                return
            if st is not None:
                credit = st.send_credit + length
                if credit > MAX_U32:
                    raise YamuxProtocolError(f"window update overflows stream {stream_id}")
                st.send_credit = credit
                self._apply_flags(st, flags)
                if length:
                    st.wake()
            return
        if typ == TYPE_PING:
            if flags & FLAG_SYN:
                self._control(TYPE_PING, FLAG_ACK, 0, length)
            elif flags & FLAG_ACK:
                self.pongs.append(length)
            return
        if typ == TYPE_GO_AWAY:
            self.remote_go_away = length
            if length != GO_AWAY_NORMAL:
                raise YamuxProtocolError(
                    f"peer ended the session with GO_AWAY code {length}", go_away_code=None
                )
            return
        raise YamuxProtocolError(f"unknown yamux frame type {typ}")

    def _stream_for(self, stream_id: int, flags: int) -> Stream | None:
        st = self.streams.get(stream_id)
        if flags & FLAG_SYN:
            if st is not None:
                raise YamuxProtocolError(f"SYN for stream {stream_id}, which is already open")
            if stream_id == 0 or (stream_id & 1) == (1 if self.is_initiator else 0):
                raise YamuxProtocolError(f"SYN with stream ID {stream_id} of the wrong parity")
            if self.local_go_away or len(self.streams) >= self.max_streams:
                if not flags & FLAG_RST:
                    self._control(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)
                return None
            st = Stream(stream_id, outbound=False)
            self.streams[stream_id] = st
            if flags & FLAG_RST:
                # Born reset: nothing to accept or acknowledge.
                st.rst = True
                self._forget(st)
                return None
            self._control(TYPE_WINDOW_UPDATE, FLAG_ACK, stream_id, 0)
            self.accepted.append(st)
            return st
        if st is not None and flags & FLAG_ACK:
            st.acked = True
        return st

    def _apply_flags(self, st: Stream | None, flags: int) -> None:
        if st is None or not flags & (FLAG_FIN | FLAG_RST):
            return
        if flags & FLAG_RST:
            st.rst = True
        if flags & FLAG_FIN:
            st.fin_received = True
        st.wake()
        if st.done:
            self._forget(st)

    def _end_payload(self) -> None:
        st = self._payload_stream
        self._payload_stream = None
        if st is not None:
            self._apply_flags(st, self._payload_flags)

    def _deliver(self, st: Stream, view: memoryview) -> None:
        target = st.target
        if target is not None and not st.queue:
            filled = st.target_filled
            k = min(len(target) - filled, len(view))
            target[filled : filled + k] = view[:k]
            st.target_filled = filled + k
            if k == len(view):
                self._recycle(view)
                st.wake()
                return
            view = view[k:]
        st.queue.append(view)
        st.buffered += len(view)
        self._recount(st)
        st.wake()

    def direct_stream(self, nbytes: int) -> Stream | None:
        """The stream whose blocked `readinto` buffer can take the next `nbytes` of plaintext
        directly (they are all payload for it), else None. See `received_direct`."""
        if self._payload_left < nbytes or self._hdr:
            return None
        st = self._payload_stream
        if st is None or st.target is None or st.queue:
            return None
        if len(st.target) - st.target_filled < nbytes:
            return None
        return st

    def is_payload(self, nbytes: int) -> bool:
        """Whether the next `nbytes` of plaintext are all payload of one live stream."""
        return self._payload_left >= nbytes and not self._hdr and self._payload_stream is not None

    def payload_buffer(self) -> PlainBuffer:
        """A buffer of PLAIN_BUFFER_SIZE bytes to decrypt payload into (invariant 8)."""
        return self._pool.pop() if self._pool else PlainBuffer(PLAIN_BUFFER_SIZE)

    def _recycle(self, view: memoryview) -> None:
        obj = view.obj
        if type(obj) is PlainBuffer and len(self._pool) < PLAIN_POOL_LIMIT:
            self._pool.append(obj)

    def idle_reader_stream(self, nbytes: int) -> Stream | None:
        """The stream the next `nbytes` of plaintext are payload for, when bytes are queued
        ahead of them (so they cannot go straight into its reader's buffer yet) and it has
        not been nudged since it last consumed: its reader may be one scheduler step away
        from taking what is queued (a message header, say) and blocking in `readinto`
        again. Else None: with nothing queued, the reader waits for these very bytes (a
        header inside this frame) or is busy elsewhere, and letting it run cannot help."""
        if self._payload_left < nbytes or self._hdr:
            return None
        st = self._payload_stream
        if st is None or st.nudged or not st.queue:
            return None
        return st

    def received_direct(self, st: Stream, nbytes: int) -> None:
        """The shell put `nbytes` of payload straight into `st.target` (after `direct_stream`)."""
        st.target_filled += nbytes
        self._payload_left -= nbytes
        if not self._payload_left:
            self._end_payload()
        st.wake()

    # ------------------------------------------------------------------ application reading

    def consumed(self, st: Stream, nbytes: int) -> None:
        """The application took `nbytes` (from the queue or its readinto buffer): grant the
        peer more credit if invariants 3 and 4 allow it."""
        if nbytes <= 0:
            return
        st.nudged = False
        st.taken += nbytes
        st.window_target = max(
            st.window_target, min(self.max_window, max(INITIAL_WINDOW, 2 * st.taken))
        )
        self._grant(st)

    def expect(self, st: Stream, nbytes: int) -> None:
        """The application asked the peer for ``nbytes`` on this stream (a request it just
        sent) and will read them as they come: grant that much credit now, within the
        same budgets (invariant 3), rather than let the window grow a round trip at a
        time from 256 KiB while a new stream's answer crosses a long path."""
        if nbytes <= st.window_target:
            return
        st.window_target = min(self.max_window, nbytes)
        self._grant(st)

    def _grant(self, st: Stream) -> None:
        if st.fin_received or st.rst or st.stream_id not in self.streams:
            return
        have = st.recv_credit + st.buffered
        want = st.window_target - have
        half = st.window_target // 2
        if want <= 0 or (want < half and st.recv_credit >= INITIAL_WINDOW // 2):
            return
        room = self.session_window - self.extra_credit()
        if self.pool is not None:
            room = min(room, self.pool.limit - self.pool.extra_credit())
        grant = min(want, max(room, INITIAL_WINDOW - have))
        if grant <= 0 or (grant < half and st.recv_credit >= INITIAL_WINDOW // 2):
            return
        self._control(TYPE_WINDOW_UPDATE, 0, st.stream_id, grant)
        st.recv_credit += grant
        self._recount(st)

    def extra_credit(self) -> int:
        """Credit granted (or filled and unread) beyond the base window, over all streams:
        the sum of ``max(recv_credit + buffered - INITIAL_WINDOW, 0)`` over the streams
        this session knows, kept by `_recount` and `_forget`."""
        return self._extra

    def _recount(self, st: Stream) -> None:
        """`st`'s credit or buffer changed: update what it adds to `extra_credit`."""
        if self.streams.get(st.stream_id) is not st:
            return  # forgotten: it counts no more
        extra = st.recv_credit + st.buffered - INITIAL_WINDOW
        if extra < 0:
            extra = 0
        self._extra += extra - st.extra
        st.extra = extra

    def pop(self, st: Stream, n: int) -> bytes:
        """Take up to `n` buffered bytes (all if n < 0) as one bytes object."""
        if n == 0 or not st.queue:
            return b""
        queue = st.queue
        done: list[memoryview]
        if n < 0 or n >= st.buffered:
            data = bytes(queue[0]) if len(queue) == 1 else b"".join(queue)
            done = list(queue)
            queue.clear()
        else:
            parts: list[memoryview] = []
            done = []
            need = n
            while need:
                head = queue[0]
                if len(head) <= need:
                    done.append(queue.popleft())
                    parts.append(head)
                    need -= len(head)
                else:
                    parts.append(head[:need])
                    queue[0] = head[need:]
                    need = 0
            data = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
            del parts
        for view in done:
            self._recycle(view)
        self._take(st, len(data))
        return data

    def pop_into(self, st: Stream, out: memoryview) -> int:
        """Copy buffered bytes into `out`; return how many."""
        queue = st.queue
        pos = 0
        room = len(out)
        while queue and pos < room:
            head = queue[0]
            k = min(len(head), room - pos)
            out[pos : pos + k] = head[:k]
            pos += k
            if k == len(head):
                self._recycle(queue.popleft())
            else:
                queue[0] = head[k:]
        self._take(st, pos)
        return pos

    def _take(self, st: Stream, nbytes: int) -> None:
        st.buffered -= nbytes
        self._recount(st)
        st.nudged = False
        self.consumed(st, nbytes)

    def requeue(self, st: Stream, data: bytes) -> None:
        """Put back at the head of `st`'s queue bytes that went straight into a reader's
        buffer (invariant 7) and that the reader, cancelled, did not take."""
        st.queue.appendleft(memoryview(data))
        st.buffered += len(data)
        self._recount(st)

    # ------------------------------------------------------------------ application writing

    def open_stream(self) -> Stream:
        """A new outbound stream; its SYN is queued as a control frame."""
        if self.remote_go_away is not None or self.local_go_away:
            raise LocalProtocolError("the yamux session is going away; open a new connection")
        if len(self.streams) >= self.max_streams:
            raise LocalProtocolError(f"already {self.max_streams} streams open on this connection")
        sid = self._next_id
        if sid > MAX_U32:
            raise LocalProtocolError("yamux stream IDs exhausted on this connection")
        self._next_id = sid + 2
        st = Stream(sid, outbound=True)
        self.streams[sid] = st
        self._control(TYPE_WINDOW_UPDATE, FLAG_SYN, sid, 0)
        return st

    def data_header(self, st: Stream, nbytes: int) -> bytes:
        """The header of a DATA frame of `nbytes` (taken from the send credit)."""
        if not 0 < nbytes <= st.send_credit:
            raise LocalProtocolError("DATA frame larger than the send window")
        if st.fin_sent or st.rst:
            raise LocalProtocolError("write on a closed yamux stream")
        st.send_credit -= nbytes
        return HEADER.pack(VERSION, TYPE_DATA, 0, st.stream_id, nbytes)

    def fin_frame(self, st: Stream) -> bytes | None:
        """Mark our side finished; the FIN frame to send in order with the data, or None."""
        if st.fin_sent or st.rst:
            return None
        st.fin_sent = True
        if st.done:
            self._forget(st)
        return HEADER.pack(VERSION, TYPE_WINDOW_UPDATE, FLAG_FIN, st.stream_id, 0)

    def reset(self, st: Stream) -> None:
        """Reset the stream both ways; the RST goes out as a control frame."""
        if st.rst:
            return
        known = st.stream_id in self.streams
        st.rst = True
        st.queue.clear()
        st.buffered = 0
        if known:
            self._control(TYPE_WINDOW_UPDATE, FLAG_RST, st.stream_id, 0)
            self._forget(st)
        st.wake()

    def ping(self, value: int) -> None:
        self._control(TYPE_PING, FLAG_SYN, 0, value & MAX_U32)

    def go_away(self, code: int = GO_AWAY_NORMAL) -> None:
        """Tell the peer we open and accept no more streams (queued as a control frame)."""
        if not self.local_go_away:
            self.local_go_away = True
            self._out += HEADER.pack(VERSION, TYPE_GO_AWAY, 0, 0, code)

    def _forget(self, st: Stream) -> None:
        if self.streams.pop(st.stream_id, None) is st:
            self._extra -= st.extra
            st.extra = 0
