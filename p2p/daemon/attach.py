"""Plain Python programs on a store that a `blob serve` already runs on: attach to it rather
than start a second node (a second peer ID, a fresh DHT entry, cold connections).

    from p2p.daemon.attach import open_blocking

    with open_blocking(store_root, bootstrap=[...]) as node:   # attached, or its own node
        node.fetch(blob_id, providers=[addr])
        path = node.store.path(blob_id)

``open_blocking`` returns an :class:`AttachedNode` when a daemon answers on the store, else
a :class:`p2p.node.blocking.BlockingNode` with the options given; both have ``start``
(which the ``with`` statement calls), ``fetch``, ``store``, ``peer_id`` and ``close``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from blobstore import Store
from p2p.daemon.client import DaemonClient, DaemonRefused, connect
from p2p.errors import P2PError


class AttachedNode:
    """The daemon serving a store, driven from plain Python over its local API."""

    def __init__(self, client: DaemonClient, store_root: Path) -> None:
        self._client = client
        self.store = Store.open(store_root)
        self.peer_id = str(client.request("hello")["peer_id"])

    def fetch(self, ref: str, *, providers: Sequence[str] = ()) -> str:
        """Fetch a blob by ID (and a collection's children) in the daemon; its ID."""
        from p2p import errors

        try:
            return str(self._client.fetch(ref, providers)["id"])
        except DaemonRefused as exc:
            kind = getattr(errors, exc.code, None)
            if isinstance(kind, type) and issubclass(kind, P2PError):
                raise kind(str(exc)) from None
            raise

    def status(self) -> dict[str, Any]:
        return self._client.status()

    def start(self) -> AttachedNode:
        """Nothing to start: the daemon runs already."""
        return self

    def close(self) -> None:
        """Nothing to stop: the daemon runs on."""

    def __enter__(self) -> AttachedNode:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_blocking(store_root: str | os.PathLike[str], **options: Any) -> Any:
    """An AttachedNode if a daemon serves ``store_root``, else a BlockingNode built with
    ``options`` (those of BlockingNode), not yet started."""
    root = Path(store_root).expanduser()
    client = connect(root)
    if client is not None:
        return AttachedNode(client, root)
    from p2p.node.blocking import BlockingNode

    return BlockingNode(root, **options)
