"""The local API of a running node: a Unix socket in its store (``API.md``).

Theory of operation
1. The socket is bound under a temporary name, given mode 0600, then renamed to
   ``<store>/api.sock``: no moment exists where another user could connect. It is
   removed when the daemon stops. A socket file left by a killed daemon (connecting to it
   is refused) is replaced; a live one (another daemon on this store) is left alone and
   this node runs without an API, saying so once.
2. Each connection carries one request (p2p.daemon.api rule 1), read within
   ``REQUEST_TIMEOUT``; at most ``MAX_CLIENTS`` are served at once, the rest get ``busy``.
3. ``fetch`` runs on the daemon's node (its connections, DHT table, banned peers) and
   sends a ``progress`` event every ``PROGRESS_INTERVAL`` (also a heartbeat: a client
   whose read waits longer knows the daemon is gone). A client that goes away cancels its
   fetch; what verified stays in the store, so the next fetch resumes.
4. Every failure of a request is one ``error`` event to that client (api rule 3); none
   ends the daemon.
5. ``put`` reads the client's file in a worker thread (the store's own put, with a lease
   until it is tagged) and provides the blob on the DHT at once; ``publish`` and
   ``catalog`` run on the daemon's node as the commands would on their own. Long ones send
   ``progress`` events as ``fetch`` does (rule 3's heartbeat).
6. With ``api_listen`` the same API also listens on TCP (loopback unless the operator
   forces otherwise); a new token is written to ``<store>/api.token`` (mode 0600, through
   the store's durable write) before the listener opens, and every TCP request must carry
   it (api rule 4). The file is removed when the daemon stops.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2p.daemon import api
from p2p.daemon.status import DaemonInfo, NodeCollector, StoreCount, node_status

if TYPE_CHECKING:
    from p2p.fetch.downloader import Progress
    from p2p.node.node import Node

log = logging.getLogger(__name__)

# A local client sends its request line at once; a second covers a loaded machine.
REQUEST_TIMEOUT = 5.0
# Clients served at once: a few scripts and an operator's status calls.
MAX_CLIENTS = 64
# Progress (and heartbeat) events of a fetch: 5 a second is smooth for a bar, and cheap.
PROGRESS_INTERVAL = 0.2
READ_SIZE = 64 * 1024


class Daemon:
    """The API of one node: status, metrics, fetches, puts, names."""

    def __init__(self, node: Node, info: DaemonInfo) -> None:
        self.node = node
        self.info = info
        self.store_count = StoreCount()
        node.metrics.registry.register(NodeCollector(node, self.store_count, info))
        self._clients = 0
        self.token: str | None = None  # the TCP listener's (rule 6)

    def status(self) -> dict[str, Any]:
        return node_status(self.node, self.info, self.store_count)

    async def handle(self, stream: trio.SocketStream) -> None:
        await self._handle(stream, tcp=False)

    async def handle_tcp(self, stream: trio.SocketStream) -> None:
        await self._handle(stream, tcp=True)

    async def _handle(self, stream: trio.SocketStream, *, tcp: bool) -> None:
        async with stream:
            if self._clients >= MAX_CLIENTS:
                busy = api.ApiError("busy", f"the daemon serves {MAX_CLIENTS} clients at once")
                await _send(stream, api.error_event(busy))
                return
            self._clients += 1
            try:
                request = await _read_request(stream)
                if tcp:
                    self._check_token(request)
                await self._answer(stream, request)
            except api.ApiError as exc:
                await _send(stream, api.error_event(exc))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away (rule 3)
            except Exception as exc:  # rule 4: one client's failure is its own
                from p2p.errors import unwrap_single

                # An operation's own error comes out of its nursery (progress beside it)
                # wrapped in a group.
                error = unwrap_single(exc) if isinstance(exc, BaseExceptionGroup) else exc
                log.info("local API request failed: %r", error)
                try:
                    await _send(stream, api.error_event(error))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            finally:
                self._clients -= 1

    def _check_token(self, request: api.Request) -> None:
        """Rule 6: a TCP request without this daemon's token is refused, whatever it asks."""
        given = (request.token or "").encode()
        if self.token is None or not secrets.compare_digest(given, self.token.encode()):
            raise api.ApiError(
                "unauthorized",
                "the local API's TCP listener wants the token in the store's api.token "
                "(blob --api-token FILE)",
            )

    async def _answer(self, stream: trio.SocketStream, request: api.Request) -> None:
        if request.op == "hello":
            result = {"api": api.API_VERSION, "peer_id": self.node.peer_id}
        elif request.op == "status":
            result = await trio.to_thread.run_sync(self.status)
        elif request.op == "metrics":
            text = await trio.to_thread.run_sync(self.node.metrics.render)
            result = {"text": text.decode()}
        elif request.op == "resolve":
            result = await self._resolve(request)
        elif request.op == "announce":
            blob_id, _providers, _recursive = api.fetch_args(request)
            result = {"id": blob_id, "provided": await self.node.provide(blob_id)}
        elif request.op == "put":
            result = await self._put(stream, api.put_args(request))
        elif request.op == "publish":
            result = await self._publish(api.publish_args(request))
        elif request.op == "catalog":
            result = await self._catalog(request)
        else:
            result = await self._fetch(stream, request)
        await _send(stream, {"event": "result", **result})

    async def _resolve(self, request: api.Request) -> dict[str, Any]:
        """The newest valid record for a name, found by the daemon's node (its peers, its
        DHT table, the store's record cache), as ``blob resolve`` would."""
        from identity import TrustStore
        from p2p.names import service as names

        ref, wait_s, keys, peers, use_dht = api.resolve_args(request)
        await self._dial(peers)
        trust = TrustStore(frozenset(keys)) if keys else None
        record = await names.resolve(self.node, ref, trust=trust, wait_s=wait_s, use_dht=use_dht)
        return record.to_json()  # "id" and "record" (hex) among its fields

    async def _dial(self, peers: list[str]) -> None:
        from p2p.errors import P2PError

        _check_addrs(peers)
        for addr in peers:
            try:
                await self.node.connect(addr)
            except P2PError as exc:
                log.info("local API: %s", exc)

    async def _put(self, stream: trio.SocketStream, args: api.PutArgs) -> dict[str, Any]:
        """Rule 5: the store's put of the client's path, then a DHT provide."""
        from blobstore.cli import parse_size
        from blobstore.errors import StoreError
        from blobstore.manifest import DEFAULT_CHUNK_SIZE, check_chunk_size
        from blobstore.store import check_tag_name

        if args.tag is not None:
            check_tag_name(args.tag)
        chunk_size = DEFAULT_CHUNK_SIZE
        if args.chunk_size is not None:
            try:
                chunk_size = parse_size(args.chunk_size)
                check_chunk_size(chunk_size)
            except (ValueError, StoreError) as exc:
                raise api.ApiError("bad_request", str(exc), api.EXIT_USAGE) from None
        store = self.node.store
        path = Path(args.path)
        done = [0]

        def progress(count: int) -> None:
            done[0] = count

        total = await trio.to_thread.run_sync(_size_of, path)

        def put() -> tuple[str, int, bool]:
            is_dir = path.is_dir()
            if is_dir and args.move:
                raise api.ApiError(
                    "bad_request", f"--move takes files, and {path} is a directory", api.EXIT_USAGE
                )
            with store.lease() as lease:
                if is_dir:
                    blob_id = store.put_dir(
                        path, chunk_size=chunk_size, progress=progress,
                        follow_symlinks=args.follow_symlinks, lease=lease,
                    )  # fmt: skip
                else:
                    blob_id = store.put_path(
                        path, chunk_size=chunk_size, move=args.move, progress=progress,
                        lease=lease,
                    )  # fmt: skip
                if args.tag is not None:
                    store.tag(args.tag, blob_id)
            return blob_id, store.manifest(blob_id).size, is_dir

        async def report() -> None:
            while True:
                await trio.sleep(PROGRESS_INTERVAL)
                event = {"event": "progress", "done_bytes": done[0], "total_bytes": total}
                await _send(stream, event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            blob_id, size, is_dir = await trio.to_thread.run_sync(put)
            provided = await self.node.provide(blob_id)  # up to 30 s: progress goes on
            nursery.cancel_scope.cancel()
        return {
            "id": blob_id, "path": str(path), "size": size, "collection": is_dir,
            "tag": args.tag, "provided": provided, "via": "daemon",
        }  # fmt: skip

    async def _publish(self, args: api.PublishArgs) -> dict[str, Any]:
        """``blob publish`` on the daemon's node: its key signs, its peers and DHT spread."""
        from blobstore import BlobNotFound
        from identity import AdmissionCertificate
        from p2p.names import service as names
        from p2p.names.record import check_name

        check_name(args.name)
        store = self.node.store
        blob_id = await trio.to_thread.run_sync(store.resolve, args.ref)
        if not await trio.to_thread.run_sync(store.has, blob_id):
            raise BlobNotFound(f"blob {blob_id} is not complete in this store; get it first")
        certificate = (
            None if args.certificate is None else AdmissionCertificate.decode(args.certificate)
        )
        await self._dial(args.peers)
        spread = await names.publish(
            self.node, args.name, blob_id, seq=args.seq, expiry_s=args.expires_in_s,
            certificate=certificate, use_dht=args.dht,
        )  # fmt: skip
        return {**spread.to_json(), "via": "daemon"}

    async def _catalog(self, request: api.Request) -> dict[str, Any]:
        from identity import TrustStore
        from p2p.names import service as names
        from p2p.names.record import parse_ref

        publisher, keys, peers = api.catalog_args(request)
        parse_ref(f"{publisher}/x")
        await self._dial(peers)
        trust = TrustStore(frozenset(keys)) if keys else None
        records = await names.catalog(self.node, publisher, trust=trust)
        return {"records": [r.to_json() for r in records], "via": "daemon"}

    async def _blob_ref(self, ref: str) -> tuple[str, list[str]]:
        """(blob ID, a ticket's addresses) for ``fetch``'s reference (as ``blob get``)."""
        from blobstore import BadBlobId, BlobNotFound, parse_blob_id

        if ref.startswith("blob1"):
            from p2p.blob.ticket import Ticket

            ticket = Ticket.decode(ref)
            return ticket.blob_id, list(ticket.addrs)
        try:
            return await trio.to_thread.run_sync(self.node.store.resolve, ref), []
        except BlobNotFound as exc:
            local = exc
        try:
            return parse_blob_id(ref), []
        except BadBlobId:
            raise BlobNotFound(
                f"{local}; to fetch it from elsewhere, give its full 64-hex ID or a ticket"
            ) from None

    async def _fetch(self, stream: trio.SocketStream, request: api.Request) -> dict[str, Any]:
        ref, providers, recursive = api.fetch_args(request)
        _check_addrs(providers)
        blob_id, ticket_addrs = await self._blob_ref(ref)
        providers = [*providers, *ticket_addrs]
        store = self.node.store
        if await trio.to_thread.run_sync(self._complete, blob_id, recursive, bool(providers)):
            return {"id": blob_id, "source": "local", "via": "daemon", "store_path": str(
                store.path(blob_id))}  # fmt: skip
        latest: list[Progress] = []
        first_byte: list[float] = []
        started = time.time()

        def on_progress(progress: Progress) -> None:
            latest[:] = [progress]
            if not first_byte and sum(progress.new_bytes.values()) > 0:
                first_byte.append(time.time())

        async def report() -> None:
            while True:
                await trio.sleep(PROGRESS_INTERVAL)
                await _send(stream, progress_event(latest[0] if latest else None))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            await self.node.fetch(
                blob_id, providers=providers, progress=on_progress, recursive=recursive
            )
            nursery.cancel_scope.cancel()
        result: dict[str, Any] = {
            "id": blob_id, "source": "network", "via": "daemon",
            "store_path": str(store.path(blob_id)),
        }  # fmt: skip
        if latest:
            final = latest[-1]
            result["seconds"] = final.elapsed
            result["rate_bytes_per_s"] = final.rate_bytes_per_s
            result["peers"] = {
                peer: {"bytes": final.new_bytes.get(peer, 0), "banned": s.banned}
                for peer, s in final.peers.items()
            }
        if first_byte:
            result["first_byte_s"] = round(first_byte[0] - started, 3)
        return result

    def _complete(self, blob_id: str, recursive: bool, repair: bool) -> bool:
        """Whether ``blob_id`` (and, ``recursive``, a collection's files) is here already.
        With named sources (``repair``) a local copy is verified first, as ``blob get``
        does: a rotten one is quarantined and fetched again."""
        store = self.node.store
        if not store.has(blob_id):
            return False
        if repair and store.verify(blob_id):
            log.warning("the local copy of %s is corrupt (quarantined); fetching it", blob_id)
            return False
        if not recursive or not store.is_collection(blob_id):
            return True
        return all(store.has(e.blob_id) for e in store.read_collection(blob_id))


def _check_addrs(addrs: list[str]) -> None:
    """A malformed peer address is the client's mistake, said as the command says it
    (exit 2), before anything is dialled."""
    from p2p.blob.ticket import validate_peer_addr
    from p2p.errors import BadAddress

    for addr in addrs:
        try:
            validate_peer_addr(addr, error=BadAddress)
        except BadAddress as exc:
            raise api.ApiError("bad_request", str(exc), api.EXIT_USAGE) from None


def _size_of(path: Path) -> int:
    """Bytes a put of ``path`` reads (0 for what is missing: the put says why)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def progress_event(progress: Progress | None) -> dict[str, Any]:
    if progress is None:
        return {"event": "progress"}
    return {
        "event": "progress",
        "id": progress.blob_id,
        "done_bytes": progress.done_bytes,
        "total_bytes": progress.total_bytes,
        "rate_bytes_per_s": round(progress.rate_bytes_per_s),
        "peers": len(progress.peers),
    }


async def _send(stream: trio.SocketStream, event: dict[str, Any]) -> None:
    await stream.send_all(api.encode_line(event))


async def _read_request(stream: trio.SocketStream) -> api.Request:
    reader = api.LineReader(api.MAX_REQUEST_BYTES)
    with trio.move_on_after(REQUEST_TIMEOUT):
        while True:
            data = await stream.receive_some(READ_SIZE)
            if not data:
                raise api.ApiError("bad_request", "connection closed before a whole request")
            lines = reader.feed(data)
            if lines:
                return api.decode_request(lines[0])
    raise api.ApiError("bad_request", f"no whole request within {REQUEST_TIMEOUT:g} s")


def _live(path: Path) -> bool:
    """Whether a daemon answers at ``path`` (rule 1)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True


def bind_socket(path: Path) -> socket.socket | None:
    """The listening socket at ``path`` (rule 1), or None (said why in the log) when
    another daemon holds it or the path is too long for a Unix socket."""
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    if len(os.fsencode(staging)) > api.MAX_SOCKET_PATH:
        log.warning("local API off: the socket path %s is longer than a Unix socket takes", path)
        return None
    if path.exists() and _live(path):
        log.warning("local API off: another daemon already answers at %s", path)
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(staging))
        os.chmod(staging, api.SOCKET_MODE)
        os.replace(staging, path)
        sock.listen(MAX_CLIENTS)
    except BaseException:
        sock.close()
        staging.unlink(missing_ok=True)
        raise
    return sock


def write_token(store_root: Path) -> str:
    """A new token for the TCP listener, durably in ``<store>/api.token`` (rule 6)."""
    from blobstore.durable import write_file_atomic

    token = secrets.token_hex(api.TOKEN_BYTES)
    write_file_atomic(
        api.token_path(store_root), token.encode() + b"\n", replace=True, mode=api.TOKEN_MODE
    )
    return token


@asynccontextmanager
async def serve_api(
    node: Node, info: DaemonInfo, api_listen: tuple[str, int] | None = None
) -> AsyncIterator[Daemon]:
    """Run ``node``'s local API for the ``async with`` block (off, with a warning, when
    the socket cannot be had: the node serves peers either way), and on TCP at
    ``api_listen`` (rule 6; ListenFailed when that address cannot be had)."""
    daemon = Daemon(node, info)
    path = api.socket_path(node.store.root)
    sock = bind_socket(path)
    listeners: list[trio.SocketListener] = []
    if sock is not None:
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    tcp: list[trio.SocketListener] = []
    token_file = api.token_path(node.store.root)
    try:
        if api_listen is not None:
            from p2p.errors import ListenFailed

            daemon.token = await trio.to_thread.run_sync(write_token, node.store.root)
            host, port = api_listen
            try:
                tcp = list(await trio.open_tcp_listeners(port, host=host))
            except OSError as exc:
                raise ListenFailed(
                    f"the local API cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from None
            bound = tcp[0].socket.getsockname()
            info.api_addr = f"{bound[0]}:{bound[1]}"
            log.warning("local API on tcp %s (token in %s)", info.api_addr, token_file)
        async with trio.open_nursery() as nursery:
            if listeners:
                nursery.start_soon(trio.serve_listeners, daemon.handle, listeners)
            if tcp:
                nursery.start_soon(trio.serve_listeners, daemon.handle_tcp, tcp)
            try:
                yield daemon
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if sock is not None:
            path.unlink(missing_ok=True)
        if api_listen is not None:
            token_file.unlink(missing_ok=True)
