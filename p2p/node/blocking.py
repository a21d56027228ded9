"""A blocking facade over :class:`p2p.node.node.Node` for plain (non-async) programs, such as
training scripts: the node's trio loop runs in a background thread and each method call
is carried into it and waited for::

    with BlockingNode(store_root, listen=["/ip4/127.0.0.1/tcp/0"]) as node:
        node.fetch(blob_id, providers=[addr])
        path = node.store.path(blob_id)
        layer = node.fetch_tensor(blob_id, "model.layers.3.mlp.up_proj.weight", providers=[addr])

Calls block the calling thread until the node's loop has done the work; errors are the
node's own (``P2PError`` subclasses, the store's errors), raised in the caller's thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import trio

from blobstore import BadBlobId, BlobNotFound, Store, parse_blob_id
from p2p.blob.ticket import MAX_TICKET_ADDRS, Ticket
from p2p.errors import P2PError
from p2p.fetch.download_parts import ProgressCallback
from p2p.fetch.tensors import fetch_tensors
from p2p.node.node import DEFAULT_LISTEN, Node, open_node
from p2p.transport.addresses import dialable_addrs

if TYPE_CHECKING:
    from p2p.names.record import NameRecord

T = TypeVar("T")

START_TIMEOUT = 60.0


class NodeNotRunning(RuntimeError):
    """The facade was used before ``start()`` or after ``close()`` (a caller bug)."""


class NodeStopped(P2PError):
    """The node's thread ended on its own (it crashed) while the facade was open; the
    message says why. Start a new BlockingNode to go on."""


class BlockingNode:
    """A blobnet node for plain Python: use it as a context manager (or call
    :meth:`start` and :meth:`close`).

    ``store_root``: the store directory (created if missing). ``key_path``: the machine
    key file (created on first use; a fresh ephemeral key if None). ``listen``: addresses
    to accept peers on. ``bootstrap``: DHT peers dialled at start. ``dht``: run the
    Kademlia DHT. ``fast``: blobnet's fast Noise + yamux path (False: stock py-libp2p).
    ``dht_server``: False for a short-lived script that only fetches: it queries the DHT
    as a client, and servers do not keep it in their routing tables once it is gone.
    ``pubsub``: join gossip topics (an outer-loop worker, ``training.outer.api``, needs it).
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str],
        *,
        key_path: str | os.PathLike[str] | None = None,
        listen: Sequence[str] = DEFAULT_LISTEN,
        bootstrap: Sequence[str] = (),
        dht: bool = True,
        fast: bool = True,
        dht_server: bool = True,
        pubsub: bool = False,
    ) -> None:
        self._store_root = Path(store_root).expanduser()
        self.key_path = Path(key_path) if key_path is not None else None
        self._kwargs: dict[str, Any] = {
            "key_path": key_path,
            "listen": tuple(listen),
            "bootstrap": tuple(bootstrap),
            "dht": dht,
            "fast": fast,
            "dht_server": dht_server,
            "pubsub": pubsub,
        }
        self._node: Node | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # Why the node's loop ended while the facade was open (None while it runs).
        self._stopped: str | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> BlockingNode:
        """Start the node's thread and wait (up to ``START_TIMEOUT``) until it listens;
        raises what starting the node raised (a bad address, a busy port)."""
        self._thread = threading.Thread(target=self._thread_main, name="blobnet-node", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise TimeoutError(f"blobnet node did not start within {START_TIMEOUT:.0f} s")
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
        """Stop the node and wait for its thread; quiet if it already stopped."""
        if self._token is not None and self._stop is not None:
            stop = self._stop
            try:
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._node = None
        self._token = None

    def __enter__(self) -> BlockingNode:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported through start(), or by the next call
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                self._stopped = f"{type(exc).__name__}: {exc}"
        else:
            stop = self._stop
            if stop is not None and not stop.is_set():
                self._stopped = "its event loop ended"

    async def _main(self) -> None:
        async with open_node(self._store_root, **self._kwargs) as node:
            self._node = node
            self._stop = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    def _check_alive(self) -> None:
        if self._stopped is not None:
            raise NodeStopped(f"the blobnet node stopped: {self._stopped}")
        if self._node is None or self._token is None:
            raise NodeNotRunning("BlockingNode is not running: use it in a with block")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)`` in the node's loop and return its result (for
        libraries that run their own tasks on the node, such as an outer-loop worker)."""
        return self._call(fn, *args, **kwargs)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._check_alive()

        async def run() -> Any:
            return await fn(*args, **kwargs)

        try:
            return trio.from_thread.run(run, trio_token=self._token)
        except trio.RunFinishedError:
            # The loop ended between the check and the call, or while the call ran.
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._check_alive()
            raise NodeStopped("the blobnet node stopped during the call") from None

    # --- the node's API ------------------------------------------------------------------
    @property
    def node(self) -> Node:
        """The underlying trio :class:`~p2p.node.node.Node` (only for calls carried into its
        loop; most programs need the methods below)."""
        self._check_alive()
        assert self._node is not None
        return self._node

    @property
    def store(self) -> Store:
        """The node's :class:`~blobstore.Store`: ``store.path(blob_id)`` is a read-only
        file to memory-map."""
        return self.node.store

    @property
    def peer_id(self) -> str:
        """This node's libp2p peer ID (from its machine key)."""
        return self.node.peer_id

    @property
    def addrs(self) -> list[str]:
        """Addresses other nodes can dial, each ending in ``/p2p/<peer id>`` (a wildcard
        listen address appears as each interface's address); behind NAT, once it holds
        reservations, only its circuit addresses (``Node.reachable_addrs``)."""
        return dialable_addrs(self.node.reachable_addrs)

    def ticket(self, blob_id: str) -> str:
        """A ticket for ``blob_id`` naming this node's addresses (for ``blob get``)."""
        return Ticket(blob_id, tuple(self.addrs[:MAX_TICKET_ADDRS])).encode()

    def connect(self, addr: str) -> str:
        """Dial ``/ip4/.../tcp/.../p2p/<id>``; returns the peer ID (PeerUnreachable if
        it cannot)."""
        return str(self._call(self.node.connect, addr))

    def add(self, path: str | os.PathLike[str], *, tag: str | None = None) -> str:
        """Put a file (or a directory, as a collection) into the store, optionally tag
        it, and announce it on the DHT; returns its blob ID."""
        return str(self._call(self.node.add, path, tag=tag))

    def add_bytes(self, data: bytes, *, tag: str | None = None) -> str:
        """Put ``data`` into the store as a blob (optionally tagged) and announce it;
        returns its blob ID."""
        blob_id = str(self._call(self.node.add_bytes, data))
        if tag is not None:
            self.store.tag(tag, blob_id)
        return blob_id

    def publish_name(self, name: str, blob_id: str, **options: Any) -> NameRecord:
        """Sign ``<this peer ID>/name -> blob_id`` and spread it (Node.publish_name)."""
        return cast("NameRecord", self._call(self.node.publish_name, name, blob_id, **options))

    def resolve(self, ref: str, **options: Any) -> NameRecord:
        """The newest valid record for ``PUBLISHER/NAME`` (Node.resolve)."""
        return cast("NameRecord", self._call(self.node.resolve, ref, **options))

    def fetch(
        self,
        ref: str,
        *,
        providers: Sequence[str] = (),
        progress: ProgressCallback | None = None,
    ) -> str:
        """Make blob ``ref`` complete in the store (a collection with all its files);
        returns its ID.

        ``ref``: a blob ID, a ticket, or a local tag or 8+ character ID prefix (what the
        store holds, complete or partial: a partial one is resumed). ``providers``:
        multiaddrs ending in ``/p2p/<id>``; connected peers and the DHT are asked too.
        ``progress`` is called from the node's thread with a
        :class:`~p2p.fetch.download_parts.Progress`. Raises NoProviders or FetchFailed (network),
        BlobNotFound (an unknown tag), NoSpace.
        """
        blob_id = self._local_ref(ref)
        if blob_id is not None and self._complete(blob_id):
            return blob_id
        target = blob_id if blob_id is not None else ref
        return str(self._call(self.node.fetch, target, providers=providers, progress=progress))

    def _local_ref(self, ref: str) -> str | None:
        """The blob ID a tag or prefix names in the store; None for a ticket or a full
        ID the store does not know (those go to the network as they are)."""
        if ref.startswith("blob1"):
            return None
        try:
            return self.store.resolve(ref)
        except BlobNotFound as not_here:
            try:
                parse_blob_id(ref)
            except BadBlobId:
                # Neither a known tag or prefix nor a full ID: the store's own error.
                raise not_here from None
            return None

    def _complete(self, blob_id: str) -> bool:
        store = self.store
        if not store.has(blob_id):
            return False
        if not store.is_collection(blob_id):
            return True
        return all(store.has(e.blob_id) for e in store.read_collection(blob_id))

    def fetch_tensors(
        self, ref: str, names: Sequence[str], *, providers: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Tensors ``names`` (numpy arrays; BF16 widened to float32) of safetensors blob
        ``ref``, fetching only the chunks that hold its header and those tensors (each
        verified against the manifest; they stay in the store's partial blob). A complete
        local blob is read from the store. ``providers``: multiaddrs to fetch from, as for
        :meth:`fetch`, besides connected peers."""
        blob_id = self._local_ref(ref)
        peers = [self.connect(addr) for addr in providers]
        if blob_id is None:
            if ref.startswith("blob1"):
                ticket = Ticket.decode(ref)
                blob_id = ticket.blob_id
                peers += [self.connect(addr) for addr in ticket.addrs]
            else:
                blob_id = ref
        result = self._call(fetch_tensors, self.node, blob_id, list(names), peers=peers)
        return dict(result.tensors)

    def fetch_tensor(self, ref: str, name: str, *, providers: Sequence[str] = ()) -> Any:
        """One tensor of safetensors blob ``ref`` as a numpy array (see
        :meth:`fetch_tensors`)."""
        return self.fetch_tensors(ref, [name], providers=providers)[name]

    def export(self, blob_id: str, dest: str | os.PathLike[str]) -> None:
        """Write the blob (or a collection's directory) to ``dest``, verified."""
        self._call(self.node.export, blob_id, dest)
