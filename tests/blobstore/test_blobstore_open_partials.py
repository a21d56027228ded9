"""The partials this process holds open (blobstore.partial.OpenPartials)."""

from __future__ import annotations

import os

import pytest

from blobstore import Manifest, PartialBusy
from tests.blobstore.conftest import C, Parts


def test_a_partial_is_registered_while_open_and_only_it_is_forgotten(parts: Parts) -> None:
    m = Manifest.of_bytes(os.urandom(2 * C), C)
    writer = parts.writer()
    first = writer.begin_partial(m)
    assert parts.partials.get(m.blob_id) is first
    with pytest.raises(PartialBusy):
        parts.partials.add(first)
    first.close()
    assert parts.partials.get(m.blob_id) is None
    second = writer.begin_partial(m)
    parts.partials.forget(first)  # a stale release: the live one stays
    assert parts.partials.get(m.blob_id) is second
    second.close()
