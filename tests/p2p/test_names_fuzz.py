"""Property tests of the name-record and names-protocol parsers.

Invariant: whatever bytes a peer sends, a record either verifies (and then it is exactly
the canonical encoding of a correctly signed record) or is refused with NameRejected;
a names-protocol body either decodes to a message that re-encodes to the same bytes or
raises NamesProtocolError. Nothing else escapes (no msgpack, Unicode or type errors).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from identity import MachineKey, SoftwareSigner
from p2p.names import protocol as wire
from p2p.names.record import NameRecord, NameRejected, sign_record, verify

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOW = 1_800_000_000
SIGNER = SoftwareSigner(MachineKey.generate())
GOOD = sign_record(
    SIGNER, name="run-x/adapter", blob_id="ab" * 32, seq=7, time=NOW, expires=NOW + 60
).encode()


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """The good record with a few bytes flipped, cut or inserted."""
    data = bytearray(GOOD)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, len(data) - 1)) if data else 0
        if action == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del data[at : at + draw(st.integers(1, 8))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@FUZZ
@given(st.one_of(damaged(), st.binary(max_size=300)))
def test_only_a_refusal_escapes_record_verification(data: bytes) -> None:
    try:
        record = verify(data, now=NOW)
    except NameRejected:
        return
    assert record.encode() == data
    assert data == GOOD  # no other spelling of a record verifies


@FUZZ
@given(
    st.one_of(st.binary(max_size=200), damaged().map(lambda r: wire.encode(wire.PutRequest(r))[4:]))
)
def test_only_a_protocol_error_escapes_the_names_decoders(body: bytes) -> None:
    try:
        request = wire.decode_request(body)
    except wire.NamesProtocolError:
        pass
    else:
        assert wire.encode(request)[4:] == body
    for asked in (wire.GetRequest(b"k" * 32), wire.ListRequest(SIGNER.peer_id)):
        try:
            response = wire.decode_response(body, asked)
        except wire.NamesProtocolError:
            continue
        assert wire.encode(response)[4:] == body


def test_the_fuzzed_record_is_itself_valid() -> None:
    """Guards the tests above: they start from a record that does verify."""
    assert verify(GOOD, now=NOW) == NameRecord.decode(GOOD)
