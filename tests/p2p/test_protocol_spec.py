"""PROTOCOL.md is the whole contract: the manifest and collection encodings and
the constants it states must be what blobstore and the protocol core really do."""

from __future__ import annotations

import re
from pathlib import Path

from blake3 import blake3

from blobstore import CollectionEntry, Manifest
from blobstore.collection import COLLECTION_MAGIC, encode_collection
from p2p.blob import messages, protocol

SPEC = (Path(protocol.__file__).parent / "PROTOCOL.md").read_text()
ID = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_manifest_examples_match_blobstore() -> None:
    empty = Manifest.of_bytes(b"", 1 << 20)
    assert f"`{empty.encode().hex()}`" in SPEC
    # The length the text gives is the example's own (it once said 33 beside 30 bytes).
    assert f"has the {len(empty.encode())}-byte manifest\n`{empty.encode().hex()}`" in SPEC
    assert f"`{empty.blob_id}`" in SPEC
    hello = Manifest.of_bytes(b"hello", 65536)
    digest = blake3(b"hello").hexdigest()
    assert hello.encode().hex() == hello.encode()[:-32].hex() + digest
    assert f"`{hello.encode()[:-32].hex()}`" in SPEC
    assert f"`{digest}`" in SPEC
    assert f"`{hello.blob_id}`" in SPEC


def test_the_fellow_count_bound_is_the_wires_and_says_what_a_server_reaches() -> None:
    """5.3 (a server remembers 64 peers per blob) and 5.5 (f up to 64) read as a
    contradiction: with 64 or more other fetchers blobnet's server says 63. The spec says
    which bound wins and why a server may stay below it."""
    from p2p.blob.swarm import MAX_SWARM_PEERS

    section = SPEC[SPEC.index("### 5.5") : SPEC.index("### 5.6")]
    assert messages.MAX_FELLOWS_COUNTED == MAX_SWARM_PEERS == 64
    assert "wins" in section and f"says {MAX_SWARM_PEERS - 1}" in section


def test_collection_example_matches_blobstore() -> None:
    encoded = encode_collection([CollectionEntry("config.json", ID, 0)])
    assert f"{len(encoded)}\nbytes" in SPEC or f"{len(encoded)} bytes" in SPEC
    magic = " ".join(f"{b:02x}" for b in COLLECTION_MAGIC)
    assert magic in SPEC
    # Each hex row of the example is a slice of the real encoding.
    block = SPEC[SPEC.index('fixmap(2), "collection", 1') - 60 :]
    rows = [line.split("   ")[0].strip() for line in block.splitlines()[:6]]
    hexed = encoded.hex()
    for row in rows:
        piece = row.replace(" ", "").replace("...", "")
        if re.fullmatch(r"[0-9a-f]+", piece):
            assert piece in hexed, row
    assert hexed.endswith(ID.encode().hex() + "00")


def test_spec_states_the_protocol_ids_limits_and_security() -> None:
    assert messages.Version.V1_0.protocol_id == "/blobnet/blob/1.0.0"
    assert messages.Version.V1_1.protocol_id == "/blobnet/blob/1.1.0"
    for protocol_id in messages.SERVED_PROTOCOL_IDS:
        assert f"`{protocol_id}`" in SPEC
    assert f"| `MAX_PIPELINED_REQUESTS` | {messages.MAX_PIPELINED_REQUESTS} |" in SPEC
    assert "DESIGN.md" not in SPEC  # the spec needs no other document
    assert "TLS" not in SPEC.replace("no TLS", "")
