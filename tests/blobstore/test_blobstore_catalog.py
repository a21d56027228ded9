"""IDs, prefixes and tags (blobstore.catalog.Catalog), built without a Store."""

from __future__ import annotations

import pytest

from blobstore import AmbiguousPrefix, BlobNotFound
from tests.blobstore.conftest import C, Parts


def test_a_reference_is_an_id_a_unique_prefix_or_a_tag(parts: Parts) -> None:
    writer, catalog = parts.writer(), parts.catalog()
    a, b = (writer.put_bytes(data, chunk_size=C) for data in (b"a", b"b"))
    catalog.tag("first", a)
    assert catalog.resolve("first") == a
    assert catalog.resolve(b) == b
    assert catalog.resolve(b[:12]) == b
    twins = ["abcdef01" + "0" * 56, "abcdef01" + "1" * 56]
    for blob_id in twins:  # two partials whose IDs share 8 characters
        (parts.layout.partial_dir(blob_id)).mkdir()
        (parts.layout.partial_dir(blob_id) / "manifest").write_bytes(b"m")
    with pytest.raises(AmbiguousPrefix, match="matches 2 blobs"):
        catalog.resolve("abcdef01")
    assert catalog.resolve("abcdef011") == twins[1]
    with pytest.raises(BlobNotFound, match="ID prefixes need at least 8"):
        catalog.resolve(b[:5])
    catalog.untag("first")
    assert catalog.tags() == {}
