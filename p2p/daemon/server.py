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
    """The API of one node: status, metrics, fetches."""

    def __init__(self, node: Node, info: DaemonInfo) -> None:
        self.node = node
        self.info = info
        self.store_count = StoreCount()
        node.metrics.registry.register(NodeCollector(node, self.store_count, info))
        self._clients = 0

    def status(self) -> dict[str, Any]:
        return node_status(self.node, self.info, self.store_count)

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if self._clients >= MAX_CLIENTS:
                busy = api.ApiError("busy", f"the daemon serves {MAX_CLIENTS} clients at once")
                await _send(stream, api.error_event(busy))
                return
            self._clients += 1
            try:
                request = await _read_request(stream)
                await self._answer(stream, request)
            except api.ApiError as exc:
                await _send(stream, api.error_event(exc))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away (rule 3)
            except Exception as exc:  # rule 4: one client's failure is its own
                log.info("local API request failed: %r", exc)
                try:
                    await _send(stream, api.error_event(exc))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            finally:
                self._clients -= 1

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
        else:
            result = await self._fetch(stream, request)
        await _send(stream, {"event": "result", **result})

    async def _resolve(self, request: api.Request) -> dict[str, Any]:
        """The newest valid record for a name, found by the daemon's node (its peers, its
        DHT table, the store's record cache), as ``blob resolve`` would."""
        from identity import TrustStore
        from p2p.errors import P2PError
        from p2p.names import service as names

        ref, wait_s, keys, peers, use_dht = api.resolve_args(request)
        for addr in peers:
            try:
                await self.node.connect(addr)
            except P2PError as exc:
                log.info("resolve: %s", exc)
        trust = TrustStore(frozenset(keys)) if keys else None
        record = await names.resolve(self.node, ref, trust=trust, wait_s=wait_s, use_dht=use_dht)
        return {"id": record.blob_id, "record": record.encode().hex()}

    async def _fetch(self, stream: trio.SocketStream, request: api.Request) -> dict[str, Any]:
        blob_id, providers, recursive = api.fetch_args(request)
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
        result: dict[str, Any] = {"id": blob_id, "source": "network", "via": "daemon"}
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


@asynccontextmanager
async def serve_api(node: Node, info: DaemonInfo) -> AsyncIterator[Daemon]:
    """Run ``node``'s local API for the ``async with`` block (off, with a warning, when
    the socket cannot be had: the node serves peers either way)."""
    daemon = Daemon(node, info)
    path = api.socket_path(node.store.root)
    sock = bind_socket(path)
    if sock is None:
        yield daemon
        return
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, daemon.handle, [listener])
            try:
                yield daemon
            finally:
                nursery.cancel_scope.cancel()
    finally:
        path.unlink(missing_ok=True)
