"""The outer loop's wire formats and announcement rules, without sockets or torch:
the global-state blob, the pubsub announcements and the Ledger that judges them."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from identity import (
    Authority,
    MachineKey,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
)
from training.outer.loop import OuterState, state_root
from training.outer.messages import (
    MAX_MESSAGE_SIZE,
    STATE_KIND,
    UPDATE_KIND,
    BadMessage,
    Candidate,
    ClosureAnnouncement,
    ClosureRefAnnouncement,
    Disagreement,
    Hello,
    Ledger,
    Message,
    Rejection,
    StateAnnouncement,
    StateHeard,
    UpdateAnnouncement,
    VerdictAnnouncement,
    decode_message,
    encode_message,
    topic,
)
from training.outer.state_blob import BadStateBlob, decode_state, encode_state

NOW = 1_700_000_000
KC = "cpu-test"
BLOB = "ab" * 32
ROOT = "cd" * 32
ADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWAi8dmB8VbY76251m5j2dw5chrEKyCJF1VFHs8t6uGXGQ"


def small_state(round_: int = 3) -> OuterState:
    rng = np.random.default_rng(0)
    params = {
        "b.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "a.bias": rng.standard_normal(5).astype(np.float32),
    }
    momentum = {n: (v * np.float32(0.5)) for n, v in params.items()}
    return OuterState(round_, params, momentum)


# --- the state blob ------------------------------------------------------------------


def test_state_blob_round_trips_with_the_same_root_and_bytes() -> None:
    state = small_state()
    data = encode_state(state)
    back = decode_state(data, expected={"a.bias": (5,), "b.weight": (3, 4)})
    assert back.round == 3
    assert state_root(back) == state_root(state)
    assert encode_state(back) == data
    # Insertion order of the dicts does not change the bytes.
    shuffled = OuterState(3, dict(reversed(state.params.items())), state.momentum)
    assert encode_state(shuffled) == data


def test_a_state_put_from_its_blocks_is_the_blob_of_its_bytes(tmp_path: Path) -> None:
    """Workers put the state blob from views of the arrays (no 1 GB join at 124M): the
    same blob ID and size as its canonical bytes, also for arrays that are not contiguous
    (those blocks are copies)."""
    from blobstore import Store
    from training.outer.state_blob import state_blocks, state_size

    state = small_state()
    odd = OuterState(
        3,
        {"a.bias": state.params["a.bias"], "b.weight": state.params["b.weight"].T.copy().T},
        {"a.bias": state.momentum["a.bias"], "b.weight": state.momentum["b.weight"].T.copy().T},
    )
    store = Store.open(tmp_path / "store")
    data = encode_state(state)
    for s in (state, odd):
        blocks = state_blocks(s)
        assert state_size(blocks) == len(data)
        assert store.put_blocks(blocks) == store.put_bytes(data)
    assert encode_state(odd) == data


def test_state_blob_rejects_every_truncation_and_trailing_bytes() -> None:
    data = encode_state(small_state())
    for cut in range(len(data)):
        with pytest.raises(BadStateBlob):
            decode_state(data[:cut])
    with pytest.raises(BadStateBlob, match="payload"):
        decode_state(data + b"\0")


def test_state_blob_rejects_malformed_headers_and_values() -> None:
    data = encode_state(small_state())
    with pytest.raises(BadStateBlob, match="magic"):
        decode_state(b"XXXX" + data[4:])
    with pytest.raises(BadStateBlob, match="version"):
        decode_state(data[:4] + b"\x03" + data[5:])
    # count 0 and an absurd count are refused before anything is allocated
    head = struct.Struct("<4sBBHQI")
    magic, version, dtype, reserved, round_, _count = head.unpack(data[: head.size])
    for count in (0, 1 << 20):
        bad = head.pack(magic, version, dtype, reserved, round_, count) + data[head.size :]
        with pytest.raises(BadStateBlob, match="tensors"):
            decode_state(bad)
    with pytest.raises(BadStateBlob, match="do not match"):
        decode_state(data, expected={"a.bias": (5,), "b.weight": (4, 3)})
    state = small_state()
    state.params["a.bias"][0] = np.nan
    with pytest.raises(BadStateBlob, match="NaN"):
        decode_state(encode_state(state))


def test_state_blob_rejects_unsorted_names_and_zero_dims() -> None:
    data = bytearray(encode_state(small_state()))
    # The first name is "a.bias"; renaming it to "c.bias" breaks the strict order.
    at = data.index(b"a.bias")
    data[at] = ord("c")
    with pytest.raises(BadStateBlob, match="order"):
        decode_state(bytes(data))
    data = bytearray(encode_state(small_state()))
    dims_at = data.index(b"a.bias") + len(b"a.bias") + 1
    data[dims_at : dims_at + 8] = struct.pack("<Q", 0)
    with pytest.raises(BadStateBlob, match="dimension"):
        decode_state(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_state_blob_mutations_raise_only_bad_state_blob(data: st.DataObject) -> None:
    """Any byte flipped: either a clean BadStateBlob or a state that re-encodes to the
    same bytes (only the float payload can change without breaking the format)."""
    blob = bytearray(encode_state(small_state()))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= data.draw(st.integers(1, 255))
    try:
        state = decode_state(bytes(blob))
    except BadStateBlob:
        return
    assert encode_state(state) == bytes(blob)


# --- announcements -------------------------------------------------------------------


MESSAGES: list[Message] = [
    Hello("run-1", b"cert bytes"),
    UpdateAnnouncement("run-1", 7, BLOB, b"attestation", (ADDR,)),
    StateAnnouncement("run-1", 8, ROOT, BLOB, b"attestation", (ADDR, ADDR)),
    ClosureAnnouncement("run-1", b"closure body", b"attestation", (ADDR,)),
    ClosureRefAnnouncement("run-1", b"compact body", b"attestation", BLOB, (ADDR,)),
    VerdictAnnouncement("run-1", 3, "12D3KooWAuthor", BLOB, ROOT, "match", b"attestation"),
]


@pytest.mark.parametrize("msg", MESSAGES)
def test_announcements_round_trip(msg: Message) -> None:
    data = encode_message(msg)
    assert decode_message(data) == msg
    assert len(data) < MAX_MESSAGE_SIZE


def _raw(msg: Message) -> dict[str, object]:
    out: dict[str, object] = msgpack.unpackb(encode_message(msg), raw=False)
    return out


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m.update(round=-1), "out of range"),
        (lambda m: m.update(round=True), "int"),
        (lambda m: m.update(blob="AB" * 32), "hex"),
        (lambda m: m.update(run="bad run/id"), "run ID"),
        (lambda m: m.update(type="vote"), "unknown announcement type"),
        (lambda m: m.update(v=2), "version"),
        (lambda m: m.update(addrs=["/ip4/1.2.3.4/tcp/1"]), "multiaddr"),
        (lambda m: m.update(addrs=[ADDR] * 9), "more than"),
        (lambda m: m.update(extra=1), "unknown fields"),
        (lambda m: m.pop("attestation"), "lacks"),
    ],
)
def test_malformed_announcements_are_rejected(change: object, match: str) -> None:
    fields = _raw(MESSAGES[1])
    change(fields)  # type: ignore[operator]
    with pytest.raises(BadMessage, match=match):
        decode_message(msgpack.packb(fields, use_bin_type=True))


def test_non_canonical_spellings_are_rejected() -> None:
    fields = _raw(MESSAGES[1])
    reordered = dict(reversed(list(fields.items())))
    with pytest.raises(BadMessage, match="canonical"):
        decode_message(msgpack.packb(reordered, use_bin_type=True))
    # The same round as a wider integer (uint32 instead of a fixint).
    data = encode_message(MESSAGES[1])
    wide = data.replace(b"\xa5round\x07", b"\xa5round\xce\x00\x00\x00\x07")
    assert wide != data
    with pytest.raises(BadMessage, match="canonical"):
        decode_message(wide)
    with pytest.raises(BadMessage, match="bytes"):
        decode_message(b"\x80" * (MAX_MESSAGE_SIZE + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_bad_message(data: bytes) -> None:
    try:
        msg = decode_message(data)
    except BadMessage:
        return
    assert encode_message(msg) == data


def test_topic_names_the_run() -> None:
    assert topic("run-1") == "blobnet/outer/run-1"
    with pytest.raises(ValueError, match="run ID"):
        topic("../x")


# --- the ledger ----------------------------------------------------------------------


@dataclasses.dataclass
class Machine:
    key: MachineKey
    signer: SoftwareSigner

    @property
    def peer(self) -> str:
        return self.key.peer_id


def machine() -> Machine:
    key = MachineKey.generate()
    return Machine(key, SoftwareSigner(key))


AUTHORITY = Authority(SoftwareSigner(MachineKey.generate()))
ROGUE = Authority(SoftwareSigner(MachineKey.generate()))
TRUST = TrustStore(frozenset({AUTHORITY.public_key_bytes}))


def admit(m: Machine, authority: Authority = AUTHORITY, operator: str = "op") -> bytes:
    cert = authority.admit(
        m.peer, operator=operator, kernel_class=KC, not_before=0, not_after=NOW + 10**6, serial=1
    )
    return cert.encode()


def update_msg(
    m: Machine,
    *,
    round_: int = 0,
    blob: str = BLOB,
    root: str = ROOT,
    authority: Authority | None = AUTHORITY,
    digest: str | None = None,
    tamper: bool = False,
) -> bytes:
    from identity import AdmissionCertificate

    cert = None if authority is None else AdmissionCertificate.decode(admit(m, authority))
    attestation = sign_attestation(
        m.signer,
        kind=UPDATE_KIND,
        digest=bytes.fromhex(digest or blob),
        kernel_class=KC,
        subjects=[blob, root, "c0" * 32],  # a commitment blob (never fetched here)
        time=NOW,
        certificate=cert,
    )
    if tamper:
        sig = bytearray(attestation.signature)
        sig[0] ^= 1
        attestation = dataclasses.replace(attestation, signature=bytes(sig))
    return encode_message(UpdateAnnouncement("run-1", round_, blob, attestation.encode(), (ADDR,)))


def state_msg(m: Machine, round_: int, root: str, blob: str = BLOB) -> bytes:
    from identity import AdmissionCertificate

    attestation = sign_attestation(
        m.signer,
        kind=STATE_KIND,
        digest=bytes.fromhex(blob),
        kernel_class=KC,
        subjects=[blob, root],
        time=NOW,
        certificate=AdmissionCertificate.decode(admit(m)),
    )
    return encode_message(StateAnnouncement("run-1", round_, root, blob, attestation.encode(), ()))


def test_a_valid_update_is_a_candidate_once() -> None:
    me, peer = machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    assert ledger.open_round(0, ROOT, NOW) == []
    data = update_msg(peer)
    events = ledger.hear(data, peer.peer, NOW)
    attestation = decode_message(data).attestation  # type: ignore[union-attr]
    assert events == [Candidate(0, peer.peer, BLOB, (ADDR,), "op", attestation)]
    # Re-published (with back-off): heard again, no new event.
    assert ledger.hear(update_msg(peer), peer.peer, NOW) == []
    assert peer.peer in ledger.present


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"authority": None}, "missing certificate"),
        ({"authority": ROGUE}, "unknown authority"),
        ({"tamper": True}, "bad signature"),
        ({"root": "ee" * 32}, "wrong state root"),
        ({"digest": "ff" * 32}, "digest is not the blob ID"),
    ],
)
def test_bad_updates_are_rejected_with_their_reason(kwargs: dict[str, object], reason: str) -> None:
    me, peer = machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    ledger.open_round(0, ROOT, NOW)
    events = ledger.hear(update_msg(peer, **kwargs), peer.peer, NOW)  # type: ignore[arg-type]
    assert events == [Rejection(0, peer.peer, BLOB, reason)]
    assert ledger.hear(update_msg(peer, **kwargs), peer.peer, NOW) == []  # type: ignore[arg-type]
    assert ledger.rejections(0) == events
    assert peer.peer not in ledger.present


def test_an_update_relayed_by_another_sender_is_rejected() -> None:
    me, signer, relay = machine(), machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    ledger.open_round(0, ROOT, NOW)
    events = ledger.hear(update_msg(signer), relay.peer, NOW)
    assert events == [Rejection(0, relay.peer, BLOB, "signer is not the sender")]


def test_early_updates_wait_for_their_round_and_equivocation_is_refused() -> None:
    me, peer = machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    ledger.open_round(0, ROOT, NOW)
    # Round 1 is heard before this worker has S_1: judged when round 1 opens.
    first = update_msg(peer, round_=1, root="11" * 32)
    assert ledger.hear(first, peer.peer, NOW) == []
    other = update_msg(peer, round_=1, root="11" * 32, blob="22" * 32)
    assert ledger.hear(other, peer.peer, NOW) == []
    # Far-future rounds are not buffered at all.
    assert ledger.hear(update_msg(peer, round_=9), peer.peer, NOW) == []
    assert 9 not in ledger.rounds
    events = ledger.open_round(1, "11" * 32, NOW)
    attestation = decode_message(first).attestation  # type: ignore[union-attr]
    assert events == [
        Candidate(1, peer.peer, BLOB, (ADDR,), "op", attestation),
        Rejection(1, peer.peer, "22" * 32, "equivocation"),
    ]
    # Round 0 is closed: its updates are no longer judged.
    assert ledger.hear(update_msg(peer, round_=0), peer.peer, NOW) == []


def test_an_undecodable_blob_stays_refused() -> None:
    me, peer = machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    ledger.open_round(0, ROOT, NOW)
    assert len(ledger.hear(update_msg(peer), peer.peer, NOW)) == 1
    ledger.reject(0, peer.peer, BLOB, "undecodable")
    assert ledger.hear(update_msg(peer), peer.peer, NOW) == []
    assert [r.reason for r in ledger.rejections(0)] == ["undecodable"]


def test_state_roots_are_compared_and_disagreement_reported_once() -> None:
    me, a, b = machine(), machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    heard = ledger.hear(state_msg(a, 1, ROOT), a.peer, NOW)
    assert heard == [StateHeard(1, a.peer, ROOT, BLOB, ())]
    assert ledger.own_root(1, ROOT) == []
    events = ledger.hear(state_msg(b, 1, "99" * 32), b.peer, NOW)
    assert events[1:] == [Disagreement(1, b.peer, ROOT, "99" * 32)]
    assert ledger.hear(state_msg(b, 1, "99" * 32), b.peer, NOW) == []
    assert ledger.latest_state is not None and ledger.latest_state.peer == a.peer
    ledger.hear(state_msg(b, 2, "98" * 32), b.peer, NOW)
    assert ledger.latest_state.round == 2


def test_presence_needs_an_admitted_hello_and_own_and_foreign_runs_are_ignored() -> None:
    me, friend, stranger = machine(), machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    ledger.hear(encode_message(Hello("run-1", admit(friend))), friend.peer, NOW)
    ledger.hear(encode_message(Hello("run-1", admit(stranger, ROGUE))), stranger.peer, NOW)
    # A valid certificate, but for someone else than the sender.
    ledger.hear(encode_message(Hello("run-1", admit(friend))), stranger.peer, NOW)
    ledger.hear(encode_message(Hello("run-2", admit(stranger))), stranger.peer, NOW)
    ledger.hear(b"\x00garbage", stranger.peer, NOW)
    assert ledger.present == {friend.peer}
    assert ledger.malformed == 1
    assert ledger.other_runs == 1
    ledger.open_round(0, ROOT, NOW)
    assert ledger.hear(update_msg(me), me.peer, NOW) == []  # our own echo


def test_an_update_that_comes_after_its_round_closed_is_counted_for_the_next() -> None:
    """Rule 2 of outer_agreement waits, in round r, for every worker whose update for r - 1
    was heard, also one heard after r - 1 closed here (a joiner, or a worker slower than
    the first K): the ledger keeps who, for admitted workers only and one round back."""
    me, late, stranger = machine(), machine(), machine()
    ledger = Ledger("run-1", me.peer, TRUST)
    ledger.hear(encode_message(Hello("run-1", admit(late))), late.peer, NOW)
    ledger.open_round(0, ROOT, NOW)
    ledger.open_round(1, "ee" * 32, NOW)
    assert ledger.hear(update_msg(late, round_=0), late.peer, NOW) == []
    assert ledger.hear(update_msg(stranger, round_=0), stranger.peer, NOW) == []
    assert ledger.late == {0: {late.peer: BLOB}}
    assert ledger.operators[late.peer] == "op"
    ledger.open_round(2, "ff" * 32, NOW)
    assert ledger.late == {}
