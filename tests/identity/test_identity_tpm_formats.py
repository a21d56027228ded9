"""The TPM admission's messages and registry, without a TPM: canonical, bounded, and the
answer's own checks (the authority's rules that need no TPM structures)."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from identity import AdmissionReason, AdmissionRefused, BadTpmData, MachineKey
from identity.tpm import Answer, Challenge, Evidence, Pending, Registry
from identity.tpm.admission import MAX_PENDING, Admitted, BoundMachine
from identity.tpm.formats import MAX_EK_CERT_SIZE, MAX_EK_CHAIN

NOW = 1_800_000_000
KEY = MachineKey.generate()
AK = bytes([4]) + bytes(64)  # shape only: these tests never check a signature by it


def evidence(**changes: object) -> Evidence:
    fields: dict[str, object] = {
        "peer_id": KEY.peer_id,
        "ek_cert": b"\x30" * 100,
        "ek_chain": (),
        "ek_public": b"\x01" * 300,
        "ak_public": b"\x02" * 90,
        "binding": bytes(64),
        **changes,
    }
    return Evidence(**fields)  # type: ignore[arg-type]


def test_messages_round_trip_and_refuse_other_spellings() -> None:
    ev = evidence(ek_chain=(b"\x30" * 10,))
    assert Evidence.decode(ev.encode()) == ev
    challenge = Challenge(bytes(16), NOW, bytes(32), bytes(32), b"\x03" * 70, b"\x04" * 258)
    assert Challenge.decode(challenge.encode()) == challenge
    answer = Answer.sign(KEY, bytes(16), bytes(32))
    assert Answer.decode(answer.encode()) == answer and answer.signature_valid()
    for data, kind in ((ev.encode(), Evidence), (challenge.encode(), Challenge)):
        with pytest.raises(BadTpmData):
            kind.decode(data[:-1])  # type: ignore[attr-defined]
        with pytest.raises(BadTpmData):
            kind.decode(data + b"\x00")  # type: ignore[attr-defined]


def test_evidence_is_bounded_before_it_is_parsed() -> None:
    with pytest.raises(ValueError, match="chain certificates"):
        evidence(ek_chain=(b"\x30",) * (MAX_EK_CHAIN + 1))
    with pytest.raises(ValueError, match="EK certificate"):
        evidence(ek_cert=b"\x30" * (MAX_EK_CERT_SIZE + 1))
    with pytest.raises(BadTpmData, match="more than the limit"):
        Evidence.decode(b"\x00" * (200_000))


def _registry(expires: int = NOW + 300) -> tuple[Registry, bytes]:
    credential = bytes(range(32))
    pending = Pending(
        nonce=bytes(16),
        expires=expires,
        credential_hash=hashlib.sha256(credential).digest(),
        peer_id=KEY.peer_id,
        ak=AK,
        ek_hash=b"\xee" * 32,
    )
    return Registry(pending=(pending,)), credential


def test_the_registry_round_trips() -> None:
    registry, _ = _registry()
    registry = registry.with_admission(Admitted(b"\xee" * 32, KEY.peer_id, 9, NOW + 10))
    assert Registry.decode(registry.encode()) == registry
    with pytest.raises(BadTpmData):
        Registry.decode(registry.encode()[:-3])


def test_an_answer_signed_by_another_key_is_refused() -> None:
    """Guards the answer's signature check: the key being admitted must sign the answer."""
    registry, credential = _registry()
    stranger = MachineKey.generate()
    forged = dataclasses.replace(Answer.sign(stranger, bytes(16), credential), peer_id=KEY.peer_id)
    with pytest.raises(AdmissionRefused) as info:
        registry.answer(forged, now=NOW, replace=False)
    assert info.value.reason is AdmissionReason.BAD_ANSWER
    good = Answer.sign(KEY, bytes(16), credential)
    rest, pending, replaced = registry.answer(good, now=NOW, replace=False)
    assert pending.peer_id == KEY.peer_id and replaced is None and rest.pending == ()


def test_open_challenges_are_bounded_and_expired_ones_dropped() -> None:
    registry, credential = _registry(expires=NOW + 1)
    machine = BoundMachine(KEY.peer_id, AK, b"n", b"\xee" * 32, b"", bytes(32))
    full = dataclasses.replace(registry, pending=registry.pending * MAX_PENDING)
    challenge = Challenge(bytes(16), NOW + 300, bytes(32), bytes(32), b"\x03", b"\x04")
    with pytest.raises(AdmissionRefused) as info:
        full.with_challenge(machine, challenge, credential, NOW)
    assert info.value.reason is AdmissionReason.TOO_MANY_CHALLENGES
    # once they have expired they no longer count
    assert len(full.with_challenge(machine, challenge, credential, NOW + 1).pending) == 1


_KEYS = ("v", "peer", "ek_cert", "ek_chain", "ek_pub", "ak_pub", "binding", "nonce", "expires",
         "evidence", "authority", "credential", "secret", "sig", "pending", "admitted", "ek", "ak",
         "serial", "not_after")  # fmt: skip
_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-1, 2**64 - 1), st.binary(max_size=80),
        st.text(max_size=60), st.just(KEY.peer_id), st.just(1),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(_KEYS), inner),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.binary(max_size=600), st.dictionaries(st.sampled_from(_KEYS), _VALUES)))
def test_hostile_input_raises_only_bad_tpm_data(value: bytes | dict[str, object]) -> None:
    """Whatever a peer sends as evidence, a challenge or an answer, and whatever a registry
    file holds, decoding ends in a value or BadTpmData, never another exception."""
    data = value if isinstance(value, bytes) else msgpack.packb(value, use_bin_type=True)
    for kind in (Evidence, Challenge, Answer):
        try:
            kind.decode(data)  # type: ignore[attr-defined]
        except BadTpmData:
            pass
    try:
        Registry.decode(data)
    except BadTpmData:
        pass


def test_without_tpm2_pytss_the_tpm_commands_say_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the tpm extra is not installed, a TPM operation is TpmUnavailable (exit 5)
    naming the extra and how this checkout installs it (`pip install 'blobnet[tpm]'` asked
    the registry for a package of that name), not an ImportError traceback."""
    import sys

    from identity import TpmUnavailable
    from identity.tpm import _pytss, device

    monkeypatch.setitem(sys.modules, "tpm2_pytss", None)  # makes `import tpm2_pytss` fail
    _pytss.pytss.cache_clear()
    try:
        with pytest.raises(TpmUnavailable, match=r"install the tpm extra") as info:
            device.bind(KEY, "swtpm:port=1")
        assert info.value.exit_code == 5
        # blobnet is no registry's package: the checkout's own install, not a registry's.
        assert "make tpm" in str(info.value) and "pip install -e '.[tpm]'" in str(info.value)
        assert "blobnet[tpm]" not in str(info.value)
        assert _pytss.unavailable_reason() is not None
    finally:
        _pytss.pytss.cache_clear()
