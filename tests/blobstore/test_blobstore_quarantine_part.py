"""Quarantine (blobstore.quarantine.Quarantine), built without a Store."""

from __future__ import annotations

import pytest

from blobstore import StoreError
from blobstore.quarantine import Quarantine
from tests.blobstore.conftest import C, Parts


def test_quarantine_unpublishes_and_keeps_a_one_line_reason(parts: Parts) -> None:
    blob_id = parts.writer().put_bytes(b"w" * C, chunk_size=C)
    assert parts.quarantine.quarantine(blob_id, "peer said \x1b[31mbad\nchunk 0")
    assert not parts.layout.has(blob_id)
    assert parts.layout.quarantined_ids() == [blob_id]
    reason = parts.quarantine.reason(blob_id)
    assert reason is not None and reason.endswith("peer said ?[31mbad chunk 0")
    assert not parts.quarantine.quarantine(blob_id, "again")  # not complete any more
    with parts.lock.hold():
        parts.quarantine.clear(blob_id)
    assert parts.quarantine.reason(blob_id) is None


def test_another_users_store_is_left_to_its_owner(parts: Parts) -> None:
    blob_id = parts.writer().put_bytes(b"w" * C, chunk_size=C)
    reader = Quarantine(parts.layout, parts.lock, parts.manifests, parts.modes, read_only=True)
    with pytest.raises(StoreError, match="belongs to another user"):
        reader.quarantine(blob_id, "rot")
    assert parts.layout.has(blob_id)
