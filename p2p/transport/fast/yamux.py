"""`/yamux/1.0.0` for py-libp2p: the trio shell around `yamux_core.YamuxSession`.

Theory of operation
-------------------
One connection runs two tasks, started by `FastYamuxConn.start` (py-libp2p's swarm runs it):

1. The receive loop owns the socket's read side. It `recv_into`s the Noise frame reader's
   buffer (one call returns many frames), opens each frame, and feeds the plaintext to the
   session. When a stream's reader is blocked in `readinto` and the next Noise frame is pure
   payload for it, the frame is decrypted straight into the reader's buffer. The loop never
   waits on anything but the socket: control frames it owes (ACK, pong, window update) are
   queued in the session and sent by the other task, so two peers that both write bulk data
   can never deadlock on each other's full socket buffers.
2. The send loop owns the socket's write side and the Noise send nonce. Writers queue
   (header, payload view) items and wait until their item is sealed into the send buffer (one
   encryption per 65519 bytes, straight from the caller's memory); the loop then sends the
   whole batch with a few `send` calls while the writer prepares its next item. Control
   frames are taken in the same step, in order, before the items queued after them, so a
   stream's SYN always precedes its data; FIN goes through the item queue, after the data.

Waking is by trio events set only when something changed (data, EOF, reset, window credit):
nothing polls. A stream `write` blocks while its send window is zero, without a timeout
(use a trio cancel scope). If the connection dies, every blocked call raises.

`read(n)` follows py-libp2p's yamux: up to n bytes, `MuxedStreamEOF` after the peer's FIN
(NetStream turns it into `StreamEOF`), `MuxedStreamReset` after a reset or a dead
connection. `readinto(buf)` returns the number of bytes put into `buf`, 0 at EOF.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import trio
from libp2p.abc import IMuxedConn, IMuxedStream, ISecureConn
from libp2p.io.exceptions import IOException
from libp2p.peer.id import ID
from libp2p.protocol_muxer.multiselect_client import DEFAULT_NEGOTIATE_TIMEOUT
from libp2p.stream_muxer.exceptions import (
    MuxedConnUnavailable,
    MuxedStreamClosed,
    MuxedStreamEOF,
    MuxedStreamError,
    MuxedStreamReset,
)

from .errors import FastPathError, LocalProtocolError, RemoteProtocolError, YamuxProtocolError
from .noise import FastSecureConn
from .noise_frames import MAX_PLAINTEXT, TAG_LEN, FrameWriter
from .yamux_core import GO_AWAY_NORMAL, Stream, WindowPool, YamuxSession

logger = logging.getLogger(__name__)

# What a dead socket or transport raises (the generic, non-TCP path raises libp2p's IOException).
_CONNECTION_LOST = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, IOException)

PROTOCOL_ID = "/yamux/1.0.0"
# Every session of this process draws its receive credit beyond the base windows from one
# pool (yamux_core.DEFAULT_SHARED_WINDOW): striping a fetch over more connections does not
# multiply what the fetcher may buffer.
SHARED_WINDOWS = WindowPool()
# Payload per DATA frame we send: the receiver takes any length within its window (go-yamux and
# py-libp2p both do), and large frames mean one header per MiB instead of one per 64 KiB.
MAX_DATA_FRAME = 1024 * 1024
# Control bytes sealed per send batch, so a flood of them cannot starve data.
CONTROL_BATCH = 64 * 1024
# Payload frames at least this large are worth one scheduler round trip to land in place.
NUDGE_MIN = 16 * 1024
# How long close() waits for queued frames (and our GO_AWAY) to reach the socket.
CLOSE_FLUSH_TIMEOUT = 1.0
# A dialler that proposed yamux without waiting (yamux_core invariant 9) gives the echo
# this long: what py-libp2p's negotiation allows a listener to answer a proposal in.
ECHO_TIMEOUT = float(DEFAULT_NEGOTIATE_TIMEOUT)


_wire_bound = FrameWriter.wire_bound


class _Item:
    """One ordered unit for the send loop: a header and optional payload."""

    __slots__ = ("done", "failed", "header", "payload")

    def __init__(self, header: bytes, payload: memoryview | None) -> None:
        self.header = header
        self.payload = payload
        self.done = trio.Event()
        # Set when the connection died before the item was sealed.
        self.failed = False


class FastYamuxStream(IMuxedStream):
    """One yamux stream (see the module docstring for read/write semantics)."""

    def __init__(self, conn: FastYamuxConn, st: Stream) -> None:
        self.muxed_conn = conn
        self._conn = conn
        self._st = st
        self.stream_id = st.stream_id
        self.is_initiator = st.outbound
        self._event: trio.Event | None = None
        st.wake = self._wake

    def _wake(self) -> None:
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()

    async def _wait(self) -> None:
        ev = self._event
        if ev is None:
            ev = self._event = trio.Event()
        await ev.wait()

    def _dead_error(self) -> MuxedStreamReset:
        return MuxedStreamReset(f"connection closed: {self._conn.dead_reason}")

    async def read(self, n: int | None = -1) -> bytes:
        if n == 0:
            return b""
        st = self._st
        conn = self._conn
        while not st.queue:
            if st.rst:
                raise MuxedStreamReset("stream was reset")
            if st.fin_received:
                raise MuxedStreamEOF("stream closed by the peer")
            if conn.dead_reason is not None:
                raise self._dead_error()
            await self._wait()
        if st.rst:
            raise MuxedStreamReset("stream was reset")
        data = conn.session.pop(st, -1 if n is None else n)
        conn.kick()
        return data

    async def readinto(self, buf: Any) -> int:
        """Read up to len(buf) bytes into `buf` (a writable buffer); 0 at EOF.

        While it waits, incoming payload for this stream is decrypted or copied straight into
        `buf`. If cancelled, bytes already placed in `buf` are kept for the next read.
        """
        out = memoryview(buf).cast("B")
        if not out:
            return 0
        st = self._st
        conn = self._conn
        while True:
            if st.rst:
                raise MuxedStreamReset("stream was reset")
            if st.queue:
                n = conn.session.pop_into(st, out)
                conn.kick()
                return n
            if st.fin_received:
                return 0
            if conn.dead_reason is not None:
                raise self._dead_error()
            st.target = out
            st.target_filled = 0
            try:
                await self._wait()
            except BaseException:
                filled = st.target_filled
                if filled and not st.rst:
                    conn.session.requeue(st, bytes(out[:filled]))
                raise
            finally:
                filled = st.target_filled
                st.target = None
                st.target_filled = 0
            if filled:
                conn.session.consumed(st, filled)
                conn.kick()
                return filled

    def expect(self, nbytes: int) -> None:
        """We asked the peer for about ``nbytes`` on this stream: grant the credit now
        (yamux_core invariant 3)."""
        self._conn.session.expect(self._st, nbytes)
        self._conn.kick()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        st = self._st
        conn = self._conn
        session = conn.session
        while view:
            while True:
                if st.rst:
                    raise MuxedStreamReset("stream was reset")
                if st.fin_sent:
                    raise MuxedStreamClosed("stream closed for writing")
                if conn.dead_reason is not None:
                    raise self._dead_error()
                credit = st.send_credit
                if credit > 0:
                    break
                await self._wait()
            k = min(len(view), credit, MAX_DATA_FRAME)
            await conn.submit(session.data_header(st, k), view[:k])
            view = view[k:]

    async def close(self) -> None:
        """Half-close: send FIN after everything written so far. Reading stays possible."""
        fin = self._conn.session.fin_frame(self._st)
        if fin is None or self._conn.dead_reason is not None:
            return
        try:
            await self._conn.submit(fin, None)
        except MuxedStreamError:
            pass

    async def close_write(self) -> None:
        await self.close()

    async def reset(self) -> None:
        self._conn.session.reset(self._st)
        self._conn.kick()

    def set_deadline(self, ttl: int) -> None:
        raise NotImplementedError("yamux streams have no deadlines; use a trio cancel scope")

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._conn.get_remote_address()

    async def __aenter__(self) -> FastYamuxStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.close()


class FastYamuxConn(IMuxedConn):
    """A yamux session over a `FastSecureConn` (see the module docstring)."""

    def __init__(
        self,
        secured_conn: ISecureConn,
        peer_id: ID,
        is_initiator: bool | None = None,
        on_close: Callable[[], Awaitable[Any]] | None = None,
        *,
        expect: bytes = b"",
        echo_timeout: float = ECHO_TIMEOUT,
    ) -> None:
        """``expect``: the multistream answer to a proposal sent without waiting for it
        (p2p.transport.fast.upgrade), checked before the first frame (yamux_core invariant
        9); a peer that has not sent all of it within ``echo_timeout`` seconds ends the
        connection, as a listener that never answers a proposal fails the dial that waits for it."""
        if not echo_timeout > 0:
            raise LocalProtocolError("echo_timeout must be positive")
        if not isinstance(secured_conn, FastSecureConn):
            raise LocalProtocolError("FastYamuxConn runs only over FastSecureConn")
        self.secured_conn = secured_conn
        self.peer_id = peer_id
        self._is_initiator = secured_conn.is_initiator if is_initiator is None else is_initiator
        self.session = YamuxSession(self._is_initiator, pool=SHARED_WINDOWS, expect=expect)
        self._echo_timeout = echo_timeout
        self.on_close = on_close
        self.event_started = trio.Event()
        self.event_closed = trio.Event()
        self.dead_reason: str | None = None
        self._queue: deque[_Item] = deque()
        self._sender_wakeup: trio.Event | None = None
        self._sender_idle = True
        self._idle_event: trio.Event | None = None
        # The socket's write side has one user at a time: the send loop or a writer sending
        # its own frame inline (see submit). A writer cancelled part-way leaves the rest of
        # its sealed bytes here, and they go out before anything else.
        self._sending = False
        self._pending_wire: memoryview | None = None
        self._send_free: trio.Event | None = None
        self._accept_event: trio.Event | None = None
        self._streams: weakref.WeakSet[FastYamuxStream] = weakref.WeakSet()
        self._closing = False
        self._shut_down = False
        self._nursery: trio.Nursery | None = None
        # Noise frames decrypted straight into a reader's buffer, and all frames received.
        self.direct_frames = 0
        self.frames_received = 0

    # ------------------------------------------------------------------ IMuxedConn surface

    @property
    def is_initiator(self) -> bool:
        return self._is_initiator

    @property
    def is_established(self) -> bool:
        return self.event_started.is_set() and self.dead_reason is None

    @property
    def is_closed(self) -> bool:
        return self.event_closed.is_set()

    def get_transport_addresses(self) -> list[Any]:
        return self.secured_conn.get_transport_addresses()

    def get_connection_type(self) -> Any:
        return self.secured_conn.get_connection_type()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.secured_conn.get_remote_address()

    async def open_stream(self) -> FastYamuxStream:
        if self.dead_reason is not None:
            raise MuxedStreamError(f"connection closed: {self.dead_reason}")
        try:
            st = self.session.open_stream()
        except LocalProtocolError as err:
            raise MuxedStreamError(str(err)) from err
        stream = FastYamuxStream(self, st)
        self._streams.add(stream)
        self.kick()
        return stream

    async def accept_stream(self) -> FastYamuxStream:
        accepted = self.session.accepted
        while not accepted:
            if self.dead_reason is not None:
                raise MuxedConnUnavailable(f"connection closed: {self.dead_reason}")
            ev = self._accept_event = trio.Event()
            await ev.wait()
        stream = FastYamuxStream(self, accepted.popleft())
        self._streams.add(stream)
        return stream

    async def start(self) -> None:
        if self.event_started.is_set() or self._shut_down:
            return
        reason = "connection closed by the peer"
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._send_loop)
                if self.session.awaiting_echo:
                    nursery.start_soon(self._echo_deadline)
                self.event_started.set()
                try:
                    await self._recv_loop()
                except YamuxProtocolError as err:
                    reason = f"yamux protocol error from the peer: {err}"
                    logger.info("closing connection to %s: %s", self.peer_id, reason)
                    if err.go_away_code is not None:
                        self.session.go_away(err.go_away_code)
                        await self._flush(CLOSE_FLUSH_TIMEOUT)
                except RemoteProtocolError as err:
                    reason = f"protocol error from the peer: {err}"
                    logger.info("closing connection to %s: %s", self.peer_id, reason)
                except _CONNECTION_LOST as err:
                    reason = f"connection lost: {err!r}"
                except FastPathError as err:
                    reason = f"internal error: {err}"
                    logger.warning("closing connection to %s: %s", self.peer_id, reason)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._shutdown(reason)

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.event_started.is_set() and self.dead_reason is None:
            self.session.go_away(GO_AWAY_NORMAL)
            self.kick()
            await self._flush(CLOSE_FLUSH_TIMEOUT)
        await self._shutdown("closed locally")

    # ------------------------------------------------------------------------ internals

    def kick(self) -> None:
        """Wake the send loop if there is something for it."""
        ev = self._sender_wakeup
        if ev is not None and (
            self._queue or self.session.has_outgoing or self._pending_wire is not None
        ):
            self._sender_wakeup = None
            ev.set()

    def _release_socket(self) -> None:
        self._sending = False
        ev = self._send_free
        if ev is not None:
            self._send_free = None
            ev.set()
        if self._queue or self.session.has_outgoing or self._pending_wire is not None:
            self.kick()
        else:
            idle = self._idle_event
            if idle is not None:
                self._idle_event = None
                idle.set()

    async def submit(self, header: bytes, payload: memoryview | None) -> None:
        """Send a frame (header and optional payload) in order after every frame submitted
        before it; return once it is sealed (the payload is no longer needed then).

        When nothing else is queued or being sent, the writer seals and sends the frame
        itself, saving two task switches per frame; otherwise it queues the frame for the
        send loop. A writer cancelled while its bytes are part-sent leaves the rest to the
        send loop, so the connection stays intact."""
        if self.dead_reason is not None or self._shut_down:
            raise MuxedStreamReset(f"connection closed: {self.dead_reason}")
        secure = self.secured_conn
        if (
            not self._sending
            and not self._queue
            and self._pending_wire is None
            and secure.sock is not None
            and self._nursery is not None
        ):
            self._sending = True
            try:
                pieces: list[bytes | memoryview] = []
                if self.session.has_outgoing:
                    pieces.append(self.session.take_outgoing(CONTROL_BATCH))
                pieces.append(header)
                if payload is not None:
                    pieces.append(payload)
                await self._send_inline(secure.writer.seal(pieces))
            except _CONNECTION_LOST as err:
                self._die(f"connection lost while sending: {err!r}")
                raise MuxedStreamReset(f"connection closed: {self.dead_reason}") from err
            except FastPathError as err:
                self._die(f"send failed: {err}")
                raise MuxedStreamReset(f"connection closed: {self.dead_reason}") from err
            finally:
                self._release_socket()
            return
        item = _Item(header, payload)
        self._queue.append(item)
        self.kick()
        await item.done.wait()
        if item.failed:
            raise MuxedStreamReset(f"connection closed: {self.dead_reason}")

    async def _send_inline(self, wire: memoryview) -> None:
        sock = self.secured_conn.sock
        if sock is None:
            raise LocalProtocolError("inline send needs a socket")
        self.secured_conn.coalesce(len(wire))
        while wire:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("socket closed")
            try:
                wire = wire[os.write(fd, wire) :]
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(fd)
                except trio.Cancelled:
                    self._pending_wire = wire
                    raise

    async def _flush(self, limit_s: float) -> None:
        with trio.move_on_after(limit_s):
            while (
                self._queue
                or self.session.has_outgoing
                or self._sending
                or self._pending_wire is not None
                or not self._sender_idle
            ):
                if self._nursery is None:
                    return
                ev = self._idle_event = trio.Event()
                self.kick()
                await ev.wait()

    async def _send_loop(self) -> None:
        secure = self.secured_conn
        writer = secure.writer
        session = self.session
        queue = self._queue
        budget = writer.capacity
        try:
            while True:
                if self._sending:
                    free = self._send_free = trio.Event()
                    await free.wait()
                    continue
                if self._pending_wire is not None:
                    wire, self._pending_wire = self._pending_wire, None
                    self._sending = True
                    try:
                        await secure.send_wire(wire)
                    finally:
                        self._release_socket()
                    continue
                if not queue and not session.has_outgoing:
                    self._sender_idle = True
                    idle = self._idle_event
                    if idle is not None:
                        self._idle_event = None
                        idle.set()
                    ev = self._sender_wakeup = trio.Event()
                    await ev.wait()
                    continue
                self._sender_idle = False
                pieces: list[bytes | memoryview] = []
                done: list[_Item] = []
                size = 0
                if session.has_outgoing:
                    ctrl = session.take_outgoing(CONTROL_BATCH)
                    pieces.append(ctrl)
                    size = _wire_bound(len(ctrl))
                while queue:
                    item = queue[0]
                    need = _wire_bound(len(item.header))
                    if item.payload is not None:
                        need += _wire_bound(len(item.payload))
                    if pieces and size + need > budget:
                        break
                    queue.popleft()
                    pieces.append(item.header)
                    if item.payload is not None:
                        pieces.append(item.payload)
                    size += need
                    done.append(item)
                self._sending = True
                try:
                    wire = writer.seal(pieces)
                    for item in done:
                        item.payload = None
                        item.done.set()
                    await secure.send_wire(wire)
                finally:
                    self._release_socket()
        except _CONNECTION_LOST as err:
            self._die(f"connection lost while sending: {err!r}")
        except FastPathError as err:
            self._die(f"send failed: {err}")

    async def _recv_loop(self) -> None:
        secure = self.secured_conn
        reader = secure.reader
        cipher = secure.recv_cipher
        session = self.session
        leftover = secure.take_over()
        if leftover:
            session.receive(bytes(leftover))
            self._after_receive()
        while self.dead_reason is None:
            frame = reader.next_frame()
            if frame is None:
                if not await secure.recv_more():
                    return
                continue
            self.frames_received += 1
            plen = len(frame) - TAG_LEN
            st = session.direct_stream(plen) if plen else None
            if st is None and plen >= NUDGE_MIN:
                idle = session.idle_reader_stream(plen)
                if idle is not None:
                    # Its reader may be a step away from blocking in readinto (e.g. it was
                    # woken for a message header now queued): let it run once, so this
                    # payload can go straight into its buffer instead of the queue. Trio
                    # runs each batch of ready tasks in random order, so after one
                    # checkpoint the reader has had its turn only half the time; after a
                    # second, always (measured on 1 MiB chunks: payload frames queued per
                    # chunk went from about 5 to 1, the frame that carries the header).
                    idle.nudged = True
                    await trio.lowlevel.checkpoint()
                    st = session.direct_stream(plen)
                    if st is None:
                        await trio.lowlevel.checkpoint()
                        st = session.direct_stream(plen)
            if st is not None and st.target is not None:
                target = st.target
                filled = st.target_filled
                cipher.decrypt_into(frame, target[filled : filled + plen])
                session.received_direct(st, plen)
                self.direct_frames += 1
                if len(target) - st.target_filled < MAX_PLAINTEXT:
                    # The reader's buffer cannot take another whole frame: let it run now
                    # (consume, then block again with a fresh buffer) so that the frames
                    # already received go straight into that buffer too, not to the queue.
                    await trio.lowlevel.checkpoint()
            elif plen >= NUDGE_MIN and session.is_payload(plen):
                view = memoryview(session.payload_buffer())[:plen]
                cipher.decrypt_into(frame, view)
                session.receive(view)
            else:
                session.receive(cipher.decrypt(frame))
                if session.accepted or session.has_outgoing:
                    self._after_receive()

    def _after_receive(self) -> None:
        if self.session.accepted:
            ev = self._accept_event
            if ev is not None:
                self._accept_event = None
                ev.set()
        self.kick()

    async def _echo_deadline(self) -> None:
        await trio.sleep(self._echo_timeout)
        if self.session.awaiting_echo:
            reason = f"the peer did not answer our muxer proposal within {self._echo_timeout:g} s"
            logger.info("closing connection to %s: %s", self.peer_id, reason)
            self._die(reason)

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        for item in self._queue:
            item.failed = True
            item.payload = None
            item.done.set()
        self._queue.clear()
        for stream in list(self._streams):
            stream._wake()
        ev = self._accept_event
        if ev is not None:
            self._accept_event = None
            ev.set()
        idle = self._idle_event
        if idle is not None:
            self._idle_event = None
            idle.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _shutdown(self, reason: str) -> None:
        self._die(reason)
        if self._shut_down:
            return
        self._shut_down = True
        try:
            await self.secured_conn.close()
        except Exception as err:  # the socket may already be gone; nothing left to do
            logger.debug("closing the secure connection to %s: %r", self.peer_id, err)
        self.event_closed.set()
        if self.on_close is not None:
            try:
                await self.on_close()
            except Exception as err:
                logger.warning("on_close callback for %s failed: %r", self.peer_id, err)
