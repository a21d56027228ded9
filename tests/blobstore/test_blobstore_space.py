"""Free space (blobstore.space.Space), built without a Store."""

from __future__ import annotations

import os

import pytest

from blobstore import Manifest, NoSpace
from blobstore.space import Space
from tests.blobstore.conftest import C, Parts


def test_check_says_what_is_missing_and_passes_what_fits(parts: Parts) -> None:
    space = Space(parts.layout, free_bytes=lambda: 100)
    space.check(100, "fit exactly")
    with pytest.raises(NoSpace, match="need 101 bytes, 100 available") as info:
        space.check(101, "copy one byte too many")
    assert (info.value.needed, info.value.available) == (101, 100)


def test_a_download_still_needs_what_its_partial_does_not_hold(parts: Parts) -> None:
    m = Manifest.of_bytes(os.urandom(3 * C), C)
    assert parts.space.to_finish(m) == 3 * C
    pdir = parts.layout.partial_dir(m.blob_id)
    pdir.mkdir()
    (pdir / "data").write_bytes(os.urandom(2 * C))
    os.sync()
    assert parts.space.to_finish(m) == C
