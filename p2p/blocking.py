"""A blocking facade over :class:`p2p.node.Node` for plain (non-async) programs, such as
training scripts: the node's trio loop runs in a background thread and each method call
is carried into it and waited for::

    with BlockingNode(store_root, listen=["/ip4/127.0.0.1/tcp/0"]) as node:
        node.fetch(blob_id, providers=[addr])
        path = node.store.path(blob_id)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import trio

from blobstore import Store
from p2p.downloader import ProgressCallback
from p2p.errors import P2PError
from p2p.node import DEFAULT_LISTEN, Node, open_node

T = TypeVar("T")

START_TIMEOUT = 60.0


class NodeNotRunning(RuntimeError):
    """The facade was used before ``start()`` or after ``close()`` (a caller bug)."""


class NodeStopped(P2PError):
    """The node's thread ended on its own (it crashed) while the facade was open; the
    message says why. Start a new BlockingNode to go on."""


class BlockingNode:
    def __init__(
        self,
        store_root: str | os.PathLike[str],
        *,
        key_path: str | os.PathLike[str] | None = None,
        listen: Sequence[str] = DEFAULT_LISTEN,
        bootstrap: Sequence[str] = (),
        dht: bool = True,
        fast: bool = True,
    ) -> None:
        self._store_root = Path(store_root).expanduser()
        self._kwargs: dict[str, Any] = {
            "key_path": key_path,
            "listen": tuple(listen),
            "bootstrap": tuple(bootstrap),
            "dht": dht,
            "fast": fast,
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
        self._thread = threading.Thread(target=self._thread_main, name="blobnet-node", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise TimeoutError(f"blobnet node did not start within {START_TIMEOUT:.0f} s")
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
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

    @property
    def node(self) -> Node:
        self._check_alive()
        assert self._node is not None
        return self._node

    # --- the node's API ------------------------------------------------------------------
    @property
    def store(self) -> Store:
        return self.node.store

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def addrs(self) -> list[str]:
        return self.node.addrs

    def ticket(self, blob_id: str) -> str:
        return self.node.ticket(blob_id)

    def connect(self, addr: str) -> str:
        return str(self._call(self.node.connect, addr))

    def add(self, path: str | os.PathLike[str], *, tag: str | None = None) -> str:
        return str(self._call(self.node.add, path, tag=tag))

    def fetch(
        self,
        ref: str,
        *,
        providers: Sequence[str] = (),
        progress: ProgressCallback | None = None,
    ) -> str:
        return str(self._call(self.node.fetch, ref, providers=providers, progress=progress))

    def export(self, blob_id: str, dest: str | os.PathLike[str]) -> None:
        self._call(self.node.export, blob_id, dest)
