"""Peers that sent bad data, remembered across processes: ``<store>/peers/scores.json``.

Each ``blob get`` is its own process, so a liar banned in one download would otherwise be
trusted again by the next. A node loads the file when it starts and merges its own scores
into it when it stops (the larger score of a peer wins, so two processes sharing a store
lose nothing but the last few seconds of decay). The file holds wall-clock time; scores
decay by the time that passed between saving and loading.

The file is ours (the store's private modes), but it is parsed as untrusted input all the
same: bounded in size and entries, and a malformed file is ignored with one log line rather
than stopping a fetch.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from blobstore import Store
from blobstore.durable import write_file_atomic
from p2p.fetch.scores import PeerScores

log = logging.getLogger(__name__)

FORMAT = 1
# 4096 peers (ScoreConfig.max_peers) x about 80 bytes of JSON each, with room to spare.
MAX_FILE_BYTES = 1 << 20
# A peer ID in text is about 52 characters; anything much longer is not one.
MAX_PEER_ID_CHARS = 128


def scores_path(store: Store) -> Path:
    return store.root / "peers" / "scores.json"


def encode(scores: dict[str, float], wall_now: float) -> bytes:
    return json.dumps(
        {"format": FORMAT, "saved_at": wall_now, "scores": scores}, sort_keys=True
    ).encode()


def decode(data: bytes) -> tuple[float, dict[str, float]]:
    """``(saved_at, scores)``; ValueError for anything else."""
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"over {MAX_FILE_BYTES} bytes")
    obj: Any = json.loads(data)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError("not a peer-score file of this format")
    saved_at, raw = obj.get("saved_at"), obj.get("scores")
    if not isinstance(saved_at, int | float) or not math.isfinite(saved_at):
        raise ValueError("bad saved_at")
    if not isinstance(raw, dict):
        raise ValueError("bad scores")
    scores: dict[str, float] = {}
    for peer, value in raw.items():
        if (
            not isinstance(peer, str)
            or len(peer) > MAX_PEER_ID_CHARS
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"bad entry for {peer!r:.40}")
        scores[peer] = float(value)
    return float(saved_at), scores


def load(store: Store, scores: PeerScores, now: float) -> None:
    """Merge the saved scores into ``scores`` (``now``: the clock ``scores`` runs on)."""
    path = scores_path(store)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        saved_at, saved = decode(data)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        log.warning("ignoring the saved peer scores in %s: %s", path, exc)
        return
    scores.restore(saved, now, elapsed_s=time.time() - saved_at)


def save(store: Store, scores: PeerScores, now: float) -> None:
    """Merge ``scores`` into the saved file (a no-op in another user's read-only store)."""
    if store.read_only:
        return
    merged = PeerScores()
    load(store, merged, now)
    merged.restore(scores.snapshot(now), now, elapsed_s=0.0)
    snapshot = merged.snapshot(now)
    path = scores_path(store)
    if not snapshot and not path.exists():
        return
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_file_atomic(
            path,
            encode(snapshot, time.time()),
            tmp_dir=store.tmp_dir,
            replace=True,
            mode=0o600,  # who lied to us is nobody else's business, even in a shared store
        )
    except OSError as exc:  # a full disk must not turn a finished fetch into a failure
        log.warning("could not save peer scores to %s: %s", path, exc)
