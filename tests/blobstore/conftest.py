"""Fixtures for the store tests: a fresh store with the smallest chunk size, and a
consistency check used after every fault."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from blake3 import blake3

from blobstore import MIN_CHUNK_SIZE, Manifest, Store

C = MIN_CHUNK_SIZE  # 64 KiB keeps multi-chunk tests small and fast


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "store")


def consistency_problems(root: Path) -> list[str]:
    """Everything wrong with a store at rest: temp leftovers, orphan manifests, and
    blobs whose bytes do not match their ID."""
    problems = []
    for name in os.listdir(root / "tmp"):
        problems.append(f"temp file left: {name}")
    for shard in sorted((root / "blobs").iterdir()):
        names = set(os.listdir(shard))
        for name in sorted(names):
            if name.endswith(".manifest"):
                if name[: -len(".manifest")] not in names:
                    problems.append(f"orphan manifest: {name}")
                continue
            data = (shard / name).read_bytes()
            mbytes = (shard / f"{name}.manifest").read_bytes()
            if blake3(mbytes).hexdigest() != name:
                problems.append(f"manifest of {name} does not hash to its name")
            manifest = Manifest.decode(mbytes)
            if Manifest.of_bytes(data, manifest.chunk_size) != manifest:
                problems.append(f"data of {name} does not match its manifest")
            if (shard / name).stat().st_mode & 0o222:
                problems.append(f"blob {name} is writable")
    return problems


@pytest.fixture
def check_consistent() -> Callable[[Path], None]:
    def check(root: Path) -> None:
        assert consistency_problems(root) == []

    return check


Problems = Callable[[Path], list[str]]


@pytest.fixture
def store_problems() -> Problems:
    """The consistency check as a function returning its findings (for messages)."""
    return consistency_problems
