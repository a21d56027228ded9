"""The local API of a running node: a Unix socket in its store, and TCP when asked (``API.md``).

Theory of operation
1. One daemon per store. A daemon holds an exclusive lock on ``<store>/api.lock`` while it
   runs (the kernel lets go when the process ends, however it ends); another ``serve`` on
   the store finds it held and is refused (``DaemonRunning``, exit 5), leaving the first
   untouched. Holding it, the daemon binds the socket under a temporary name, gives it
   mode 0600 and renames it to ``<store>/api.sock`` (replacing one a killed daemon left):
   no moment exists where another user could connect. It is removed when the daemon stops.
2. Each connection carries one request (p2p.daemon.api rule 1), whose line must arrive
   within ``REQUEST_TIMEOUT``. Each listener has budgets of its own (p2p.daemon.slots):
   at most ``MAX_PENDING`` connections waiting for their line (a newcomer ends the oldest)
   and ``MAX_CLIENTS`` requests served (one more is answered ``busy``), so a flood on the
   TCP port never takes the socket's room. On TCP the token is checked first (api rule 4).
3. Nothing a client does ends the daemon: every event is written within ``SEND_TIMEOUT``,
   a client that left or stopped reading is taken for gone, and every failure of a request
   is one ``error`` event to its client (api rule 3), or nothing if it is gone.
4. A request runs while its client stays. The daemon watches each connection; a client
   that closes it (Ctrl-C) cancels its request: a fetch stops (what verified stays, the
   next resumes), a put stops reading at its next block and stores, tags and provides
   nothing. Long requests send a ``progress`` event every ``PROGRESS_INTERVAL``, which is
   also a heartbeat: a client whose read waits longer knows the daemon is gone.
5. ``put`` reads only what p2p.daemon.paths allows (the socket caller's own files, the TCP
   API's listed directories; regular files and directories), in threads of its own
   limiter (``USER_PATH_THREADS``), never those the blob server reads the store with or
   trio's default ones: a hung file system stalls at most those puts. A put whose client
   is gone and whose thread is stuck in a read is left behind, holding its place in that
   limiter, while the daemon answers on. The blob is provided on the DHT at once.
6. ``fetch``, ``publish``, ``resolve`` and ``catalog`` run on the daemon's node (its
   connections, DHT table, banned peers, key) as the commands would on their own.
7. With ``api_listen`` the same API also listens on TCP (loopback unless the operator
   forces otherwise); a new token is written to ``<store>/api.token`` (mode 0600, through
   the store's durable write) before the listener opens, and every TCP request must carry
   it (api rule 4). The file is removed when the daemon stops.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from blobstore.exitcodes import ExitCode
from p2p.daemon import api, paths
from p2p.daemon.scrape import Exposition
from p2p.daemon.slots import ListenerSlots
from p2p.daemon.status import DaemonInfo, NodeCollector, StoreCount, node_status

if TYPE_CHECKING:
    from p2p.fetch.download_parts import Progress
    from p2p.node.node import Node

log = logging.getLogger(__name__)

# A client sends its request line right after connecting: two seconds cover a loaded
# machine and a remote client's round trips, and a silent connection goes that soon.
REQUEST_TIMEOUT = 2.0
# Connections waiting for their line, per listener: far more than clients connect at once;
# past it a newcomer ends the oldest (p2p.daemon.slots rule 2).
MAX_PENDING = 256
# Requests served at once, per listener: a few scripts and an operator's status calls.
MAX_CLIENTS = 64
# An event a client does not take within this long (its socket buffer full) means it stopped
# reading: it is taken for gone, and its request cancelled.
SEND_TIMEOUT = 10.0
# Progress (and heartbeat) events of a long request: 5 a second is smooth for a bar, and cheap.
PROGRESS_INTERVAL = 0.2
READ_SIZE = 64 * 1024
# Threads that read files named by clients (rule 5): each put holds one while it reads.
# A few puts run at once; a file system that hangs holds these and nothing else.
USER_PATH_THREADS = 4
LOCK_NAME = "api.lock"
# The socket's listen backlog: the daemon accepts at once, this absorbs a burst (a thousand
# connections together; the kernel caps it at net.core.somaxconn, 4096 by default).
LISTEN_BACKLOG = 1024


class DaemonRunning(Exception):
    """Another daemon already serves this store (rule 1): exit 5, as a busy store."""

    exit_code = ExitCode.LOCAL_IO


class PutCancelled(Exception):
    """Internal: a put's client left; its thread stops reading (rule 4)."""


@dataclass(frozen=True)
class Listener:
    """One way in: the Unix socket (no token; puts checked by the caller's uid) or the
    TCP port (its ``token``; puts only under ``put_dirs``)."""

    slots: ListenerSlots
    token: str | None = None
    put_dirs: tuple[Path, ...] = ()

    @property
    def tcp(self) -> bool:
        return self.token is not None


def listener_slots(name: str) -> ListenerSlots:
    return ListenerSlots(name, max_pending=MAX_PENDING, max_clients=MAX_CLIENTS)


class Client:
    """One connection's request while it runs: its stream, and whether its client left
    (a ``threading.Event``, so a worker thread can see it too). Sending never raises: a
    client that cannot be written to is gone, and its request's scope is cancelled."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.gone = threading.Event()
        self.scope = trio.CancelScope()

    def leave(self) -> None:
        self.gone.set()
        self.scope.cancel()

    async def send(self, event: dict[str, Any]) -> None:
        if self.gone.is_set():
            return
        with trio.move_on_after(SEND_TIMEOUT) as sending:
            try:
                await self.stream.send_all(api.encode_line(event))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.leave()
        if sending.cancelled_caught:
            self.leave()

    async def watch(self) -> None:
        """Rule 4: the client sends nothing after its request; its end of the connection
        closing means it left."""
        try:
            while await self.stream.receive_some(READ_SIZE):
                pass  # not ours to read; dropped
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.leave()

    def check(self) -> None:
        """In a worker thread: stop if the client left (PutCancelled)."""
        if self.gone.is_set():
            raise PutCancelled


class Daemon:
    """The API of one node: status, metrics, fetches, puts, names."""

    def __init__(self, node: Node, info: DaemonInfo) -> None:
        self.node = node
        self.info = info
        self.store_count = StoreCount()
        node.metrics.registry.register(NodeCollector(node, self.store_count, info))
        self.exposition = Exposition(node.metrics)
        self.socket = Listener(listener_slots("socket"))
        self.tcp: Listener | None = None  # with api_listen (rule 7)
        self.user_paths = trio.CapacityLimiter(USER_PATH_THREADS)
        self._uid = os.geteuid()

    @property
    def token(self) -> str | None:
        return None if self.tcp is None else self.tcp.token

    def status(self) -> dict[str, Any]:
        return node_status(self.node, self.info, self.store_count)

    async def handle(self, stream: trio.SocketStream) -> None:
        await self._handle(stream, self.socket)

    async def handle_tcp(self, stream: trio.SocketStream) -> None:
        assert self.tcp is not None
        await self._handle(stream, self.tcp)

    async def _handle(self, stream: trio.SocketStream, listener: Listener) -> None:
        """One connection (rules 2 to 4); nothing it does escapes into the listener."""
        try:
            async with stream:
                await self._serve(Client(stream), listener)
        except Exception as exc:  # rule 3: a daemon bug costs one connection
            log.warning("local API connection failed: %r", exc)

    async def _serve(self, client: Client, listener: Listener) -> None:
        slots = listener.slots
        line: bytes | None = None
        refused: api.ApiError | None = None
        with trio.CancelScope() as pending:
            key = slots.arrive(pending.cancel)
            try:
                line = await _read_line(client.stream)
            except api.ApiError as exc:
                refused = exc
            finally:
                slots.read(key)
        if refused is not None:
            # On TCP nothing is said to a client that has not shown the token (api rule 4).
            unauthorized = api.ApiError("unauthorized", api.UNAUTHORIZED)
            await client.send(api.error_event(unauthorized if listener.tcp else refused))
            return
        if line is None:
            return  # gone, or ended to make room for a newer connection: no answer
        try:
            request = api.decode_request(line, listener.token)
        except api.ApiError as exc:
            await client.send(api.error_event(exc))
            return
        if not slots.take():
            busy = api.ApiError(
                "busy", f"the daemon serves {slots.max_clients} clients at once on its {slots.name}"
            )
            await client.send(api.error_event(busy))
            return
        try:
            await self._run(client, request, listener)
        finally:
            slots.leave()

    async def _run(self, client: Client, request: api.Request, listener: Listener) -> None:
        """Rule 4: the request, cancelled when its client leaves; its result or error."""
        event: dict[str, Any] | None = None
        try:
            with client.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client.watch)
                    try:
                        result = await self._answer(client, request, listener)
                        event = {"event": "result", **result}
                    except Exception as exc:
                        error = _one(exc)
                        event = api.error_event(error)
                        if not isinstance(error, api.ApiError):
                            log.info("local API request %s failed: %r", request.op, error)
                    nursery.cancel_scope.cancel()
            if event is not None:
                await client.send(event)
        finally:
            client.gone.set()  # whatever ended it, a put's thread stops at its next block

    async def _answer(
        self, client: Client, request: api.Request, listener: Listener
    ) -> dict[str, Any]:
        if request.op == "hello":
            return {"api": api.API_VERSION, "peer_id": self.node.peer_id}
        if request.op == "status":
            return await trio.to_thread.run_sync(self.status)
        if request.op == "metrics":
            return {"text": (await self.exposition.text()).decode()}
        if request.op == "resolve":
            return await self._resolve(request)
        if request.op == "announce":
            blob_id, _providers, _recursive = api.fetch_args(request)
            return {"id": blob_id, "provided": await self.node.provide(blob_id)}
        if request.op == "put":
            return await self._put(client, api.put_args(request), listener)
        if request.op == "publish":
            return await self._publish(api.publish_args(request))
        if request.op == "catalog":
            return await self._catalog(request)
        return await self._fetch(client, request)

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

    async def _put(self, client: Client, args: api.PutArgs, listener: Listener) -> dict[str, Any]:
        """Rules 4 and 5: the store's put of a path this caller may have read, then a DHT
        provide."""
        from blobstore.catalog import check_tag_name
        from blobstore.cli import parse_size
        from blobstore.errors import StoreError
        from blobstore.manifest import DEFAULT_CHUNK_SIZE, check_chunk_size

        if args.tag is not None:
            check_tag_name(args.tag)
        chunk_size = DEFAULT_CHUNK_SIZE
        if args.chunk_size is not None:
            try:
                chunk_size = parse_size(args.chunk_size)
                check_chunk_size(chunk_size)
            except (ValueError, StoreError) as exc:
                raise api.ApiError("bad_request", str(exc), api.EXIT_USAGE) from None
        if listener.tcp:
            if args.follow_symlinks:
                raise api.ApiError(
                    "forbidden", "the TCP API follows no symbolic links", api.EXIT_LOCAL_IO
                )
        else:
            paths.check_caller(paths.peer_uid(client.stream.socket), self._uid)
        store = self.node.store
        done, total = [0], [0]

        def progress(count: int) -> None:
            done[0] = count
            client.check()

        def put() -> tuple[str, int, bool]:
            path = Path(args.path)
            if listener.tcp:
                path = paths.check_under(args.path, listener.put_dirs)
            is_dir = paths.check_kind(path)
            if is_dir and args.move:
                raise api.ApiError(
                    "bad_request", f"--move takes files, and {path} is a directory", api.EXIT_USAGE
                )
            total[0] = _size_of(path)
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
                client.check()  # gone before its tag: nothing tagged, nothing provided
                if args.tag is not None:
                    store.tag(args.tag, blob_id)
            return blob_id, store.manifest(blob_id).size, is_dir

        async def report() -> None:
            while True:
                await trio.sleep(PROGRESS_INTERVAL)
                event = {"event": "progress", "done_bytes": done[0], "total_bytes": total[0]}
                await client.send(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            blob_id, size, is_dir = await trio.to_thread.run_sync(
                put,
                limiter=self.user_paths,
                abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it
            )
            provided = await self.node.provide(blob_id)  # up to 30 s: progress goes on
            nursery.cancel_scope.cancel()
        return {
            "id": blob_id, "path": args.path, "size": size, "collection": is_dir,
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

    async def _fetch(self, client: Client, request: api.Request) -> dict[str, Any]:
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
                await client.send(progress_event(latest[0] if latest else None))

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
    try:
        if not path.is_dir():
            return path.stat().st_size
    except OSError:
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def _one(exc: BaseException) -> BaseException:
    """An operation's own error: it comes out of its nursery (progress beside it) wrapped
    in a group."""
    from p2p.errors import unwrap_single

    return unwrap_single(exc) if isinstance(exc, BaseExceptionGroup) else exc


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


async def _read_line(stream: trio.SocketStream) -> bytes | None:
    """The request line (rule 2); None when the client left before it; ApiError for a
    line too long or not whole within REQUEST_TIMEOUT."""
    reader = api.LineReader(api.MAX_REQUEST_BYTES)
    with trio.move_on_after(REQUEST_TIMEOUT):
        try:
            while data := await stream.receive_some(READ_SIZE):
                lines = reader.feed(data)
                if lines:
                    return lines[0]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        return None
    raise api.ApiError("bad_request", f"no whole request within {REQUEST_TIMEOUT:g} s")


@contextmanager
def claim_store(store_root: Path) -> Iterator[None]:
    """Hold the store's daemon lock for the block (rule 1); DaemonRunning when another
    daemon holds it."""
    root = Path(store_root)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise DaemonRunning(
                f"another daemon (pid {holder}) already serves the store {root}; stop it "
                "first, or give this one a --store of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def check_store_free(store_root: Path) -> None:
    """DaemonRunning if a daemon serves ``store_root`` now: a serving command says so
    before its node starts (rule 1; ``serve_api`` claims the store for good)."""
    with claim_store(store_root):
        pass


def bind_socket(path: Path) -> socket.socket | None:
    """The listening socket at ``path`` (rule 1; the caller holds the store's daemon
    lock), or None (said why in the log) when the path is too long for a Unix socket."""
    # The staging name is no longer than the socket's own (".a" and 6 hex digits against
    # "api.sock"), so every path that fits a Unix socket gets its API. One binder at a
    # time (the daemon lock), so 24 random bits only have to miss a crash's leftover.
    staging = path.with_name(f".a{secrets.token_hex(3)}")
    if len(os.fsencode(path)) > api.MAX_SOCKET_PATH:
        log.warning("local API off: the socket path %s is longer than a Unix socket takes", path)
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(staging))
        os.chmod(staging, api.SOCKET_MODE)
        os.replace(staging, path)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        staging.unlink(missing_ok=True)
        raise
    return sock


def write_token(store_root: Path) -> str:
    """A new token for the TCP listener, durably in ``<store>/api.token`` (rule 7)."""
    from blobstore.durable import write_file_atomic

    token = secrets.token_hex(api.TOKEN_BYTES)
    write_file_atomic(
        api.token_path(store_root), token.encode() + b"\n", replace=True, mode=api.TOKEN_MODE
    )
    return token


@asynccontextmanager
async def serve_api(
    node: Node,
    info: DaemonInfo,
    api_listen: tuple[str, int] | None = None,
    put_dirs: tuple[Path, ...] = (),
) -> AsyncIterator[Daemon]:
    """Run ``node``'s local API for the ``async with`` block: DaemonRunning when another
    daemon serves the store (rule 1); off, with a warning, when the socket path is too
    long (the node serves peers either way); on TCP at ``api_listen`` too (rule 7;
    ListenFailed when that address cannot be had), reading paths for ``put`` only under
    ``put_dirs`` there (absolute, links resolved; p2p.daemon.paths rule 2)."""
    daemon = Daemon(node, info)
    root = node.store.root
    token_file = api.token_path(root)
    with claim_store(root):
        path = api.socket_path(root)
        sock = bind_socket(path)
        listeners: list[trio.SocketListener] = []
        if sock is not None:
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        tcp: list[trio.SocketListener] = []
        try:
            if api_listen is not None:
                from p2p.errors import ListenFailed

                token = await trio.to_thread.run_sync(write_token, root)
                daemon.tcp = Listener(listener_slots("tcp port"), token, tuple(put_dirs))
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
