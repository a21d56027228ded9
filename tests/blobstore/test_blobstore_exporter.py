"""Exports (blobstore.exporting.Exporter), built without a Store."""

from __future__ import annotations

from pathlib import Path

import pytest

from blobstore import StoreError
from blobstore.exporting import Exporter
from blobstore.lease import Leases
from tests.blobstore.conftest import C, Parts


def test_a_read_only_store_exports_without_a_lease(parts: Parts, tmp_path: Path) -> None:
    """Another user's shared store cannot be leased (its locks/ is its owner's alone):
    the export must not try. Here leases point where nothing can be written."""
    blob_id = parts.writer().put_bytes(b"weights", chunk_size=C)
    nowhere = Leases(tmp_path / "no-such-locks", parts.lock)
    reader = Exporter(parts.layout, reader=parts.reader, leases=nowhere, read_only=True)
    reader.export(blob_id, tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == b"weights"
    owner = Exporter(parts.layout, reader=parts.reader, leases=nowhere)
    with pytest.raises(StoreError, match="taking a gc lease"):
        owner.export(blob_id, tmp_path / "again.bin")
