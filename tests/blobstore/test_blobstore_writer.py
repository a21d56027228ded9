"""Puts and partials (blobstore.writing.Writer), built without a Store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blobstore import Manifest, NoSpace
from blobstore.space import Space
from tests.blobstore.conftest import C, Parts


def test_a_file_is_read_in_pieces_of_the_io_buffer(parts: Parts, tmp_path: Path) -> None:
    src = tmp_path / "f"
    data = os.urandom(4 * C)
    src.write_bytes(data)
    seen: list[int] = []
    blob_id = parts.writer(io_buffer=C).put_path(src, chunk_size=C, progress=seen.append)
    assert seen == [C, 2 * C, 3 * C, 4 * C]
    assert parts.layout.data_path(blob_id).read_bytes() == data


def test_a_partial_claims_only_the_space_it_lacks(parts: Parts) -> None:
    """Resuming with two of three chunks on disk needs one chunk free; a new one all."""
    data = os.urandom(3 * C)
    m = Manifest.of_bytes(data, C)
    with parts.writer().begin_partial(m) as p:
        p.write_chunk(0, data[:C])
        p.write_chunk(1, data[C : 2 * C])
    tight = parts.writer(space=Space(parts.layout, free_bytes=lambda: C))
    with tight.begin_partial(m) as p:
        p.write_chunk(2, data[2 * C :])
        assert p.publish() == m.blob_id
    with pytest.raises(NoSpace, match=f"need {3 * C} bytes"):
        tight.begin_partial(Manifest.of_bytes(os.urandom(3 * C), C))
