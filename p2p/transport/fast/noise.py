"""The `/noise` security transport: py-libp2p's XX handshake, then our own data path.

The handshake (XX, the identity-payload signature checks, and for outbound connections the
check that the remote key matches the peer ID we dialled) is py-libp2p's own `PatternXX`, run
unchanged. When it finishes we read the two split cipher keys and their nonces out of the
`noiseprotocol` state and hand the raw socket to `FastSecureConn`, which frames, encrypts and
decrypts with `noise_frames` (one large recv per many frames, preallocated buffers).

`FastSecureConn.read`/`write` are a complete, general byte-stream API (used for the muxer's
multistream-select negotiation, and by py-libp2p's own yamux if our muxer is not installed).
`FastYamuxConn` then takes the connection over (`take_over`) and drives the frame reader and
writer itself. Errors are translated to libp2p's `IOException` family at this boundary.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import trio
from libp2p.abc import IRawConnection, ISecureConn, ISecureTransport
from libp2p.crypto.keys import KeyPair, PrivateKey, PublicKey
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import ConnectionClosedError, IOException
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.security.base_session import BaseSession
from libp2p.security.noise.patterns import PatternXX

from .errors import FastPathError, LocalProtocolError
from .noise_frames import CipherState, FrameReader, FrameWriter

PROTOCOL_ID = TProtocol("/noise")

# Receive buffer of a connection: it starts small (control-only connections stay cheap) and
# grows to the large size once a single recv fills it, i.e. during bulk transfer.
RECV_BUFFER_START = 256 * 1024
RECV_BUFFER_MAX = 1024 * 1024
# Plaintext bytes sealed per `write` batch (one `send` each).
WRITE_BATCH = 1024 * 1024
# A new connection may send about ten segments before its first ACK (Linux's initial
# congestion window), and its first flight is many small frames, each its own segment
# (TCP_NODELAY): the muxer's echoes, each new stream's window update and multistream
# echoes, the first requests or answers. Past the window the last of them wait a round
# trip for ACKs: on the 200 ms testbed path a fetch's first answers came after 0.4 s, and
# after 0.2 s with the initial window raised to 40 on both hosts. So while a connection is
# young, writes close together are corked (TCP_CORK) and leave together COALESCE_S after
# the first of them, in full segments; after COALESCE_BYTES its window has grown.
COALESCE_S = 0.002
COALESCE_BYTES = 256 * 1024
_TCP_CORK = getattr(socket, "TCP_CORK", None)


# struct tcp_info (linux/tcp.h): eight u8 fields, then u32s; tcpi_rtt, the smoothed RTT in
# microseconds, is the sixteenth u32.
_TCPI_RTT = struct.Struct("=I")
_TCPI_RTT_OFFSET = 8 + 15 * 4
_TCP_INFO_LEN = 104


def socket_rtt(sock: Any) -> float | None:
    """The kernel's smoothed RTT (seconds) of a TCP socket, or None (not TCP, another OS,
    no sample yet). A dialler has one as soon as its connect completes: the SYN's."""
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _TCPI_RTT_OFFSET + _TCPI_RTT.size:
        return None
    (micros,) = _TCPI_RTT.unpack_from(info, _TCPI_RTT_OFFSET)
    return micros / 1e6 if micros else None


def trio_socket_of(raw: IRawConnection) -> trio.socket.SocketType | None:
    """The trio socket under a py-libp2p TCP connection, or None for other transports."""
    if isinstance(raw, RawConnection) and isinstance(raw.stream, TrioTCPStream):
        stream = raw.stream.stream
        if isinstance(stream, trio.SocketStream):
            return stream.socket
    return None


class FastSecureConn(BaseSession):
    """A Noise transport session over one connection (see the module docstring)."""

    def __init__(
        self,
        *,
        local_peer: ID,
        local_private_key: PrivateKey,
        remote_peer: ID,
        remote_permanent_pubkey: PublicKey,
        is_initiator: bool,
        raw: IRawConnection,
        send_cipher: CipherState,
        recv_cipher: CipherState,
    ) -> None:
        super().__init__(
            local_peer=local_peer,
            local_private_key=local_private_key,
            remote_peer=remote_peer,
            remote_permanent_pubkey=remote_permanent_pubkey,
            is_initiator=is_initiator,
        )
        self.raw = raw
        self.sock = trio_socket_of(raw)
        self.send_cipher = send_cipher
        self.recv_cipher = recv_cipher
        self.reader = FrameReader(RECV_BUFFER_START)
        self.writer = FrameWriter(send_cipher, 2 * (WRITE_BATCH + 64 * 1024))
        self._plain = memoryview(b"")
        self._read_lock = trio.Lock()
        self._write_lock = trio.Lock()
        self._taken_over = False
        self.broken = False
        self._eof = False
        self._young_bytes = COALESCE_BYTES if _TCP_CORK is not None else 0
        self._corked = False

    # --------------------------------------------------------------- low-level I/O (muxer)

    async def recv_more(self) -> bool:
        """Receive more ciphertext into the frame reader; False at EOF. Grows the buffer
        when a recv fills it (bulk transfer). Raises OSError/trio errors on a broken socket."""
        if self._eof:
            return False
        reader = self.reader
        space = reader.recv_space()
        if self.sock is not None:
            n = await self._recv_into(self.sock, space)
        else:
            data = await self.raw.read(len(space))
            n = len(data)
            space[:n] = data
        if n == 0:
            self._eof = True
            return False
        reader.commit(n)
        if n == len(space) and reader.capacity < RECV_BUFFER_MAX:
            reader.grow(min(reader.capacity * 4, RECV_BUFFER_MAX))
        return True

    @staticmethod
    async def _recv_into(sock: trio.socket.SocketType, space: memoryview) -> int:
        # The syscall is made directly on the non-blocking descriptor, and we wait for
        # readiness only when it would block: trio's socket methods add a scheduler round
        # trip to every call. The descriptor is looked up on each attempt, so a socket
        # closed meanwhile (fileno -1) is never confused with a reused descriptor number.
        while True:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("socket closed")
            try:
                n = os.readv(fd, [space])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                continue
            # Keep the loop fair to other tasks when data is always ready.
            await trio.lowlevel.checkpoint()
            return n

    def coalesce(self, nbytes: int) -> None:
        """About to send ``nbytes`` on the socket: while the connection is young, cork it
        (see COALESCE_S) so that what follows within COALESCE_S shares its segments."""
        sock = self.sock
        if self._young_bytes <= 0 or sock is None or _TCP_CORK is None:
            return
        self._young_bytes -= nbytes
        if self._corked:
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
        except OSError:
            self._young_bytes = 0
            return
        self._corked = True
        trio.lowlevel.spawn_system_task(self._uncork_soon)

    async def _uncork_soon(self) -> None:
        try:
            await trio.sleep(COALESCE_S)
        finally:
            self._corked = False
            sock = self.sock
            if sock is not None and sock.fileno() >= 0 and _TCP_CORK is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 0)
                except OSError:
                    pass

    async def send_wire(self, wire: memoryview) -> None:
        """Send already-sealed frames. If this is interrupted part-way (cancelled, socket
        error) the session is marked broken and closed: the peer's nonce would be off."""
        try:
            if self.sock is not None:
                self.coalesce(len(wire))
                sock = self.sock
                while wire:
                    fd = sock.fileno()  # see _recv_into on why it is read each time
                    if fd < 0:
                        raise trio.ClosedResourceError("socket closed")
                    try:
                        wire = wire[os.write(fd, wire) :]
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(fd)
            else:
                await self.raw.write(bytes(wire))
        except BaseException:
            self.broken = True
            self._abort()
            raise

    def _abort(self) -> None:
        if self.sock is not None:
            self.sock.close()

    def take_over(self) -> memoryview:
        """Hand the session to the muxer: returns plaintext already decrypted but unread.
        After this, `read`/`write` refuse to run (the muxer owns the frame order)."""
        self._taken_over = True
        plain, self._plain = self._plain, memoryview(b"")
        return plain

    # -------------------------------------------------------- py-libp2p byte stream API

    async def read(self, n: int | None = None) -> bytes:
        if self._taken_over:
            raise IOException("this Noise session belongs to the muxer now")
        if n == 0:
            return b""
        async with self._read_lock:
            try:
                while not self._plain:
                    frame = self.reader.next_frame()
                    if frame is not None:
                        self._plain = memoryview(self.recv_cipher.decrypt(frame))
                        continue
                    if not await self.recv_more():
                        return b""
            except FastPathError as err:
                self._abort()
                raise IOException(str(err)) from err
            except (OSError, trio.BrokenResourceError) as err:
                raise ConnectionClosedError(f"connection broken: {err}", transport="tcp") from err
            except trio.ClosedResourceError:
                return b""
            plain = self._plain
            take = len(plain) if n is None or n < 0 else min(n, len(plain))
            data = bytes(plain[:take])
            self._plain = plain[take:]
            return data

    async def write(self, data: bytes) -> None:
        if self._taken_over:
            raise IOException("this Noise session belongs to the muxer now")
        view = memoryview(data).cast("B")
        if not view:
            return
        async with self._write_lock:
            if self.broken:
                raise ConnectionClosedError("Noise session is broken", transport="tcp")
            try:
                for off in range(0, len(view), WRITE_BATCH):
                    await self.send_wire(self.writer.seal([view[off : off + WRITE_BATCH]]))
            except LocalProtocolError as err:
                raise IOException(str(err)) from err
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as err:
                raise ConnectionClosedError(f"connection broken: {err}", transport="tcp") from err

    async def close(self) -> None:
        await self.raw.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self.raw.get_remote_address()

    def get_transport_addresses(self) -> list[Any]:
        return self.raw.get_transport_addresses()  # type: ignore[no-any-return]

    def get_connection_type(self) -> Any:
        return self.raw.get_connection_type()


class FastNoiseTransport(ISecureTransport):
    """`/noise` with py-libp2p's handshake and `FastSecureConn` as the data path."""

    def __init__(self, libp2p_keypair: KeyPair, noise_privkey: PrivateKey | None = None) -> None:
        self.libp2p_privkey = libp2p_keypair.private_key
        self.local_peer = ID.from_pubkey(libp2p_keypair.public_key)
        self.noise_privkey = (
            noise_privkey if noise_privkey is not None else create_x25519_key_pair().private_key
        )

    def _pattern(self) -> PatternXX:
        return PatternXX(self.local_peer, self.libp2p_privkey, self.noise_privkey)

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        session = await self._pattern().handshake_inbound(conn)
        return self._fast(conn, session)

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        return await self.secure_outbound_through(conn, conn, peer_id)

    async def secure_outbound_through(
        self, raw: IRawConnection, handshake_io: Any, peer_id: ID | None
    ) -> FastSecureConn:
        """The handshake over ``handshake_io`` (``raw`` itself, or a wrapper of it that
        checks a negotiation answer first: p2p.transport.fast.upgrade), the session over ``raw``.
        ``peer_id`` None: any peer (the caller checks who answered)."""
        # PatternXX checks the signed payload and that its key matches `peer_id`.
        session = await self._pattern().handshake_outbound(handshake_io, peer_id)
        return self._fast(raw, session)

    def _fast(self, raw: IRawConnection, session: Any) -> FastSecureConn:
        protocol = session.conn.noise_state.noise_protocol
        enc, dec = protocol.cipher_state_encrypt, protocol.cipher_state_decrypt
        return FastSecureConn(
            local_peer=session.local_peer,
            local_private_key=session.local_private_key,
            remote_peer=session.remote_peer,
            remote_permanent_pubkey=session.remote_permanent_pubkey,
            is_initiator=session.is_initiator,
            raw=raw,
            send_cipher=CipherState(bytes(enc.k), int(enc.n)),
            recv_cipher=CipherState(bytes(dec.k), int(dec.n)),
        )


__all__ = ["PROTOCOL_ID", "FastNoiseTransport", "FastSecureConn", "trio_socket_of"]
