"""Fixtures for the store tests: a fresh store with the smallest chunk size, and a
consistency check used after every fault."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from blake3 import blake3

from blobstore import MIN_CHUNK_SIZE, Manifest, Store
from blobstore.catalog import Catalog
from blobstore.layout import IO_BUFFER_SIZE, PRIVATE_MODES, FileModes, Layout
from blobstore.lease import Leases
from blobstore.manifests import Manifests
from blobstore.partial import OpenPartials
from blobstore.quarantine import Quarantine
from blobstore.reading import Reader
from blobstore.space import Space
from blobstore.store_lock import StoreLock
from blobstore.writing import Writer

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


@dataclass
class Parts:
    """The store's parts built by hand over a laid-out directory, without a Store: each
    part's test builds the one it tests from these (and may swap a collaborator)."""

    layout: Layout
    lock: StoreLock
    modes: FileModes
    space: Space
    leases: Leases
    manifests: Manifests
    partials: OpenPartials
    quarantine: Quarantine
    reader: Reader

    def writer(self, *, space: Space | None = None, io_buffer: int = IO_BUFFER_SIZE) -> Writer:
        return Writer(
            self.layout,
            self.lock,
            self.modes,
            space=space or self.space,
            manifests=self.manifests,
            partials=self.partials,
            quarantine=self.quarantine,
            leases=self.leases,
            io_buffer=io_buffer,
        )

    def catalog(self) -> Catalog:
        return Catalog(
            self.layout, self.lock, self.modes, reader=self.reader, quarantine=self.quarantine
        )


def make_parts(root: Path, modes: FileModes = PRIVATE_MODES) -> Parts:
    root.mkdir(mode=0o700)
    layout = Layout(root)
    layout.make_dirs(modes)
    lock = StoreLock(root, timeout=2.0)
    manifests = Manifests(layout)
    partials = OpenPartials()
    quarantine = Quarantine(layout, lock, manifests, modes)
    return Parts(
        layout=layout,
        lock=lock,
        modes=modes,
        space=Space(layout),
        leases=Leases(layout.locks, lock),
        manifests=manifests,
        partials=partials,
        quarantine=quarantine,
        reader=Reader(layout, manifests, partials, quarantine),
    )


@pytest.fixture
def parts(tmp_path: Path) -> Parts:
    return make_parts(tmp_path / "parts")
