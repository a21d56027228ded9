"""Fetching a round's missing inputs over the network (``--peer``).

``p2p`` (the transfer layer) is imported here, lazily, so training touches the network
only when a peer is named. A collection counts as present only with all its children
(the base model is a collection whose two files are separate blobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from blobstore import Store
from training.errors import MissingInput


def incomplete(store: Store, blob_id: str) -> bool:
    """True if ``blob_id``, or any child of it as a collection, is not complete locally."""
    if not store.has(blob_id):
        return True
    if store.is_collection(blob_id):
        return any(not store.has(e.blob_id) for e in store.read_collection(blob_id))
    return False


def fetch_missing(
    store: Store,
    blob_ids: Sequence[str],
    peers: Sequence[str],
    *,
    key_path: Path | None = None,
) -> list[str]:
    """Fetch each of ``blob_ids`` (with a collection's children) that is incomplete in
    ``store`` from ``peers`` (multiaddrs ending in /p2p/<peer ID>); returns those fetched.
    Without peers, a missing input is a ``MissingInput`` error naming it."""
    missing = [b for b in blob_ids if incomplete(store, b)]
    if not missing:
        return []
    if not peers:
        raise MissingInput(
            f"round input {missing[0]} is not in the store; name a peer that has it "
            "(--peer MULTIADDR) or put it locally"
        )
    from p2p import BlockingNode  # libp2p: see the module doc

    # The peers are named, so no DHT: a one-shot fetcher has nothing to look up or announce.
    with BlockingNode(
        store.root, key_path=key_path, listen=["/ip4/127.0.0.1/tcp/0"], dht=False
    ) as node:
        for blob_id in missing:
            node.fetch(blob_id, providers=list(peers))
    still = [b for b in missing if incomplete(store, b)]
    if still:
        raise MissingInput(f"round input {still[0]} could not be fetched from the peers given")
    return missing
