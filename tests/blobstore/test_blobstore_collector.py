"""rm and gc (blobstore.removal.Collector), built without a Store."""

from __future__ import annotations

from blobstore.removal import Collector
from tests.blobstore.conftest import C, Parts


def collector(parts: Parts) -> Collector:
    return Collector(
        parts.layout,
        parts.lock,
        catalog=parts.catalog(),
        reader=parts.reader,
        manifests=parts.manifests,
        quarantine=parts.quarantine,
        leases=parts.leases,
    )


def test_gc_keeps_what_is_tagged_or_leased_and_takes_the_rest(parts: Parts) -> None:
    writer, gc = parts.writer(), collector(parts)
    tagged, leased, loose = (writer.put_bytes(d, chunk_size=C) for d in (b"t", b"l", b"x"))
    parts.catalog().tag("keep", tagged)
    with parts.leases.take([leased]):
        assert gc.gc(0) == [loose]
    assert gc.gc(0) == [leased]
    assert parts.layout.complete_ids() == [tagged]


def test_rm_takes_the_blob_and_the_tags_naming_it(parts: Parts) -> None:
    writer, catalog, gc = parts.writer(), parts.catalog(), collector(parts)
    blob_id = writer.put_bytes(b"r", chunk_size=C)
    other = writer.put_bytes(b"o", chunk_size=C)
    catalog.tag("a", blob_id)
    catalog.tag("b", other)
    gc.rm(blob_id)
    assert not parts.layout.has(blob_id)
    assert catalog.tags() == {"b": other}
