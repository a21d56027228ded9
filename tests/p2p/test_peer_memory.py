"""A peer that lied is remembered beyond one download, and beyond one
process (each `blob get` is its own), with decay; the saved file is untrusted input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from blobstore import Store
from p2p.fetch import peer_memory
from p2p.fetch.scores import PeerScores
from p2p.node.node import open_node

LIAR = "12D3KooWLiarLiarLiarLiarLiarLiarLiarLiarLiarLiarLiar"


def test_a_saved_liar_is_distrusted_by_the_next_table_and_forgiven_with_time(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "s")
    first = PeerScores()
    first.penalize(LIAR, now=10.0)
    peer_memory.save(store, first, now=10.0)

    # Another process: its own clock, same store.
    second = PeerScores()
    peer_memory.load(store, second, now=5_000.0)
    assert second.distrusted(LIAR, 5_000.0)
    assert not second.distrusted("12D3KooWHonest", 5_000.0)

    # Saved three days ago: decayed past the threshold on load.
    path = peer_memory.scores_path(store)
    obj = json.loads(path.read_bytes())
    obj["saved_at"] -= 3 * 24 * 3600
    path.chmod(0o600)
    path.write_text(json.dumps(obj))
    third = PeerScores()
    peer_memory.load(store, third, now=0.0)
    assert not third.distrusted(LIAR, 0.0)


def test_saving_merges_with_what_another_process_saved(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    a, b = PeerScores(), PeerScores()
    a.penalize(LIAR, now=0.0)
    b.penalize("12D3KooWOtherLiar", now=0.0)
    peer_memory.save(store, a, now=0.0)
    peer_memory.save(store, b, now=0.0)
    merged = PeerScores()
    peer_memory.load(store, merged, now=0.0)
    assert merged.distrusted(LIAR, 0.0) and merged.distrusted("12D3KooWOtherLiar", 0.0)
    assert peer_memory.scores_path(store).stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'{"format": 1, "saved_at": 0, "scores": {"p": "high"}}',
        b'{"format": 1, "saved_at": 0, "scores": {"p": -1}}',
        b'{"format": 2, "saved_at": 0, "scores": {}}',
        b'{"format": 1, "saved_at": 0, "scores": {"' + b"x" * 200 + b'": 1}}',
        b" " * (peer_memory.MAX_FILE_BYTES + 10),
    ],
)
def test_a_malformed_or_oversized_file_is_ignored(tmp_path: Path, content: bytes) -> None:
    store = Store.open(tmp_path / "s")
    path = peer_memory.scores_path(store)
    path.parent.mkdir(mode=0o700)
    path.write_bytes(content)
    scores = PeerScores()
    peer_memory.load(store, scores, now=0.0)  # no exception: a fetch must go on
    assert len(scores) == 0


async def test_a_node_remembers_the_liars_an_earlier_node_on_its_store_banned(
    tmp_path: Path,
) -> None:
    async with open_node(tmp_path / "s", dht=False) as node:
        node.scores.penalize(LIAR, trio.current_time())  # what a download does on a bad chunk
    async with open_node(tmp_path / "s", dht=False) as node:
        assert node.scores.distrusted(LIAR, trio.current_time())
