"""Reads (blobstore.reading.Reader), built without a Store."""

from __future__ import annotations

import os

import pytest

from blobstore import CorruptChunk
from blobstore.reading import Reader
from tests.blobstore.conftest import C, Parts


def test_whole_reads_go_in_pieces_of_the_io_buffer(parts: Parts) -> None:
    data = os.urandom(4 * C + 5)
    blob_id = parts.writer().put_bytes(data, chunk_size=C)
    reader = Reader(parts.layout, parts.manifests, parts.partials, parts.quarantine, io_buffer=C)
    pieces = [bytes(p) for p in reader.iter_verified(blob_id)]
    assert max(map(len, pieces)) == C
    assert b"".join(pieces) == data


def test_a_rotten_chunk_is_found_on_read_and_quarantined(parts: Parts) -> None:
    blob_id = parts.writer().put_bytes(os.urandom(2 * C), chunk_size=C)
    path = parts.layout.data_path(blob_id)
    path.chmod(0o600)
    with open(path, "r+b") as f:
        f.seek(C + 1)
        f.write(b"rot")
    assert parts.reader.read_chunk(blob_id, 0)
    with pytest.raises(CorruptChunk, match=r"chunk 1 .*quarantined it"):
        parts.reader.read_chunk(blob_id, 1)
    assert parts.layout.quarantined_ids() == [blob_id]
