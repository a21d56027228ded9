"""blobnet's network layer: a libp2p node that serves and fetches verified blobs.

Public surface: :func:`open_node` and :class:`Node` for trio programs,
:class:`BlockingNode` for plain ones, :class:`Ticket`, :class:`Progress`,
:func:`fetch_tensors` (named tensors of a safetensors blob, fetching only their chunks),
and the errors.
Imported lazily so that ``import p2p.protocol`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2p.blocking import BlockingNode, NodeStopped
    from p2p.downloader import Progress
    from p2p.errors import BadTicket, FetchFailed, NoProviders, P2PError, PeerUnreachable
    from p2p.node import Node, NodeConfig, open_node
    from p2p.tensors import TensorFetch, fetch_tensors
    from p2p.ticket import Ticket

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
    "BlockingNode": "p2p.blocking",
    "NodeStopped": "p2p.blocking",
    "Progress": "p2p.downloader",
    "BadTicket": "p2p.errors",
    "FetchFailed": "p2p.errors",
    "NoProviders": "p2p.errors",
    "P2PError": "p2p.errors",
    "PeerUnreachable": "p2p.errors",
    "Node": "p2p.node",
    "NodeConfig": "p2p.node",
    "open_node": "p2p.node",
    "TensorFetch": "p2p.tensors",
    "fetch_tensors": "p2p.tensors",
    "Ticket": "p2p.ticket",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'p2p' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
