"""blobnet's network layer: a libp2p node that serves and fetches verified blobs.

Public surface: :func:`open_node` and :class:`Node` for trio programs,
:class:`BlockingNode` for plain ones, :class:`Ticket`, :class:`Progress`,
:func:`fetch_tensors` (named tensors of a safetensors blob, fetching only their chunks),
and the errors.
Imported lazily so that ``import p2p.blob.protocol`` stays light.

Layout, rooms by job, in import order (a room imports only rooms below it; ``make lint``
checks it with import-linter):

- ``cli/``: the ``blob`` command;
- ``node/``: the node, its blocking facade, dialling, gossip;
- ``names/`` and ``nat/``: mutable names; relays and hole punching;
- ``fetch/``: the multi-peer, verified downloader and its scheduler;
- ``blob/``: the blob protocol's core, client and server;
- ``transport/``: py-libp2p's host, patches and the fast data path.

``errors`` is shared by every room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2p.blob.ticket import Ticket
    from p2p.errors import BadTicket, FetchFailed, NoProviders, P2PError, PeerUnreachable
    from p2p.fetch.download_parts import Progress
    from p2p.fetch.tensors import TensorFetch, fetch_tensors
    from p2p.node.blocking import BlockingNode, NodeStopped
    from p2p.node.node import Node, NodeConfig, open_node

__all__ = [
    "BadTicket",
    "BlockingNode",
    "FetchFailed",
    "NoProviders",
    "Node",
    "NodeConfig",
    "NodeStopped",
    "P2PError",
    "PeerUnreachable",
    "Progress",
    "TensorFetch",
    "Ticket",
    "fetch_tensors",
    "open_node",
]

_WHERE = {
    "BlockingNode": "p2p.node.blocking",
    "NodeStopped": "p2p.node.blocking",
    "Progress": "p2p.fetch.download_parts",
    "BadTicket": "p2p.errors",
    "FetchFailed": "p2p.errors",
    "NoProviders": "p2p.errors",
    "P2PError": "p2p.errors",
    "PeerUnreachable": "p2p.errors",
    "Node": "p2p.node.node",
    "NodeConfig": "p2p.node.node",
    "open_node": "p2p.node.node",
    "TensorFetch": "p2p.fetch.tensors",
    "fetch_tensors": "p2p.fetch.tensors",
    "Ticket": "p2p.blob.ticket",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'p2p' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
