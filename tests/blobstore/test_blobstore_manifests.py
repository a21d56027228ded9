"""The stored manifests (blobstore.manifests.Manifests), built without a Store."""

from __future__ import annotations

import pytest

from blobstore import BlobNotFound, Manifest, StoreCorrupt
from tests.blobstore.conftest import C, Parts


def test_a_complete_blobs_manifest_is_cached_until_forgotten(parts: Parts) -> None:
    blob_id = parts.writer().put_bytes(b"x" * (2 * C), chunk_size=C)
    first = parts.manifests.get(blob_id)
    parts.layout.manifest_path(blob_id).unlink()
    assert parts.manifests.get(blob_id) is first  # immutable: not read again
    parts.manifests.forget(blob_id)
    with pytest.raises(BlobNotFound):
        parts.manifests.get(blob_id)


def test_a_manifest_filed_under_another_id_is_store_corrupt(parts: Parts) -> None:
    blob_id = parts.writer().put_bytes(b"one", chunk_size=C)
    path = parts.layout.manifest_path(blob_id)
    path.chmod(0o600)
    path.write_bytes(Manifest.of_bytes(b"two", C).encode())
    with pytest.raises(StoreCorrupt, match="does not match its ID"):
        parts.manifests.get(blob_id)
