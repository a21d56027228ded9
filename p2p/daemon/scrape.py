"""The metrics endpoint (``serve --metrics HOST:PORT``): Prometheus' text exposition over
HTTP/1.1, served from the node's own event loop, with every wait and count bounded.

Rules
1. One request per connection (``Connection: close``), read by h11. Its head must arrive
   whole within ``READ_TIMEOUT`` and ``MAX_HEAD_BYTES``, else the connection is closed
   unanswered. ``GET`` or ``HEAD`` of ``/metrics`` (or ``/``) gets the exposition, another
   path 404, another method 405, a malformed request 400; the answer is written within
   ``SEND_TIMEOUT``.
2. Connections are counted as the local API's are (p2p.daemon.slots): at most
   ``MAX_PENDING`` waiting for their head (a newcomer ends the oldest), at most
   ``MAX_SCRAPES`` being answered (one more is closed unanswered). No thread is spent on a
   connection, and none outlives ``READ_TIMEOUT`` plus ``SEND_TIMEOUT``.
3. The exposition is rendered at most once per ``EXPOSITION_TTL``, one render at a time, in
   a worker thread (counting the store may read the disk); every scrape in between gets the
   same bytes, so a scrape flood costs the node one render a second and the copying.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11
import trio
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from p2p.daemon.slots import ListenerSlots

if TYPE_CHECKING:
    from p2p.metrics import Metrics

log = logging.getLogger(__name__)

# Prometheus' request head is a few hundred bytes; curl's less.
MAX_HEAD_BYTES = 8 * 1024
# Scrapers send their request as soon as they connect; Prometheus' own scrape timeout is 10 s.
READ_TIMEOUT = 5.0
# The exposition is tens of KiB: a reader that takes 10 s over it is not reading.
SEND_TIMEOUT = 10.0
# Connections waiting for their head: far above what scrapers open; a newcomer ends the
# oldest past it (rule 2).
MAX_PENDING = 64
# Answers being written at once: a few Prometheus servers and an operator's curl.
MAX_SCRAPES = 16
# Prometheus scrapes every 15 to 60 s: an answer a second old is as fresh to it (rule 3).
EXPOSITION_TTL = 1.0
READ_SIZE = 16 * 1024
PATHS = (b"/metrics", b"/")
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class Exposition:
    """The node's metrics text, rendered at most every ``ttl`` seconds (rule 3)."""

    def __init__(self, metrics: Metrics, ttl: float = EXPOSITION_TTL) -> None:
        self.metrics = metrics
        self.ttl = ttl
        self.renders = 0
        self._lock = trio.Lock()
        self._text = b""
        self._at = -math.inf

    async def text(self) -> bytes:
        async with self._lock:
            if trio.current_time() - self._at >= self.ttl:
                self._text = await trio.to_thread.run_sync(self.metrics.render)
                self._at = trio.current_time()
                self.renders += 1
            return self._text


class MetricsServer:
    """The HTTP side of rules 1 and 2, over one ``Exposition``."""

    def __init__(self, exposition: Exposition) -> None:
        self.exposition = exposition
        self.slots = ListenerSlots("metrics", max_pending=MAX_PENDING, max_clients=MAX_SCRAPES)

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                await self._serve(stream)
        except Exception as exc:  # one scraper's trouble is its own
            log.debug("metrics connection failed: %r", exc)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        request: h11.Request | None = None
        malformed = False
        with trio.CancelScope() as pending:
            key = self.slots.arrive(pending.cancel)
            try:
                with trio.move_on_after(READ_TIMEOUT):
                    request = await _read_head(stream, conn)
            except h11.RemoteProtocolError:
                malformed = True
            finally:
                self.slots.read(key)
        if malformed:
            with trio.move_on_after(SEND_TIMEOUT):
                await stream.send_all(_BAD_REQUEST)
            return
        if request is None or not self.slots.take():
            return
        try:
            status, body = await self._answer(request)
            headers = [
                ("Content-Type", CONTENT_TYPE_PLAIN_0_0_4 if status == 200 else "text/plain"),
                ("Content-Length", str(len(body))),
                ("Connection", "close"),
            ]
            response = h11.Response(
                status_code=status, headers=headers, reason=HTTPStatus(status).phrase.encode()
            )
            out = conn.send(response) or b""
            if request.method != b"HEAD":
                out += conn.send(h11.Data(data=body)) or b""
            out += conn.send(h11.EndOfMessage()) or b""
            with trio.move_on_after(SEND_TIMEOUT):
                await stream.send_all(out)
        finally:
            self.slots.leave()

    async def _answer(self, request: h11.Request) -> tuple[int, bytes]:
        if request.method not in (b"GET", b"HEAD"):
            return 405, b"GET /metrics\n"
        if request.target.split(b"?")[0] not in PATHS:
            return 404, b"metrics are at /metrics\n"
        return 200, await self.exposition.text()


async def _read_head(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The request's head; None when the connection ends first (h11.RemoteProtocolError
    for a malformed or oversize one)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            conn.receive_data(data)
            continue
        return event if isinstance(event, h11.Request) else None


@asynccontextmanager
async def serve_metrics(
    exposition: Exposition, host: str, port: int
) -> AsyncIterator[tuple[str, int]]:
    """Serve ``exposition`` at ``http://HOST:PORT/metrics`` for the block, which gets the
    address bound; ListenFailed when it cannot be had."""
    from p2p.errors import ListenFailed

    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenFailed(
            f"could not serve metrics on {host}:{port}: {exc.strerror or exc}"
        ) from None
    server = MetricsServer(exposition)
    bound = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, server.handle, listeners)
        try:
            yield str(bound[0]), int(bound[1])
        finally:
            nursery.cancel_scope.cancel()
