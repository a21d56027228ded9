"""Name records, the record cache and the names protocol's messages, without sockets.

The story: a publisher signs ``PUBLISHER/NAME -> blob``; anyone verifies it offline; every
forgery, replay of an older version or expired record is refused with its reason; all
nodes pick the same newest record; the cache keeps only the newest and survives a
restart; hostile bytes on the names protocol are refused before they are believed.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import types
from pathlib import Path

import msgpack
import pytest
import trio
import trio.testing

from blobstore import Store
from identity import Authority, MachineKey, SoftwareSigner, TrustStore
from p2p.names import cache as names_cache
from p2p.names import protocol as wire
from p2p.names.cache import MAX_RECORDS_PER_PUBLISHER, NameCache
from p2p.names.record import (
    MAX_NAME_LENGTH,
    MAX_NAME_RECORD_SIZE,
    BadName,
    NameReason,
    NameRecord,
    NameRejected,
    dht_key,
    newest,
    parse_ref,
    sign_record,
    supersedes,
    verify,
)
from p2p.names.service import (
    MAX_CONCURRENT_REQUESTS,
    PUSH_WINDOW_S,
    NameService,
    NameValidator,
    PushLimiter,
    install,
    resolve,
)

NOW = 1_800_000_000  # a fixed "now": time is an argument, never read by the code under test
BLOB_A = "a" * 64
BLOB_B = "b" * 64


@pytest.fixture
def signer() -> SoftwareSigner:
    return SoftwareSigner(MachineKey.generate())


def _record(signer: SoftwareSigner, seq: int = 1, **kw: object) -> NameRecord:
    fields: dict[str, object] = {"name": "run-x/adapter", "blob_id": BLOB_A, "time": NOW}
    fields.update(kw)
    return sign_record(signer, seq=seq, **fields)  # type: ignore[arg-type]


def _reason(data: bytes | NameRecord, **kw: object) -> NameReason:
    with pytest.raises(NameRejected) as caught:
        verify(data, now=kw.pop("now", NOW), **kw)  # type: ignore[arg-type]
    return caught.value.reason


# --- records ---------------------------------------------------------------------------
def test_a_signed_record_round_trips_and_verifies_offline(signer: SoftwareSigner) -> None:
    record = _record(signer, expires=NOW + 60)
    data = record.encode()
    assert data == NameRecord.decode(data).encode()
    checked = verify(data, now=NOW, publisher=signer.peer_id, name="run-x/adapter")
    assert checked == record
    assert checked.blob_id == BLOB_A
    # py-libp2p resets FIND_NODE for keys over 50 bytes that are not multihashes.
    assert len(dht_key(signer.peer_id, "a" * MAX_NAME_LENGTH).encode()) <= 50
    assert dht_key(signer.peer_id, "a" * MAX_NAME_LENGTH) != dht_key(signer.peer_id, "a")


def test_an_altered_record_is_refused_as_badly_signed(signer: SoftwareSigner) -> None:
    record = _record(signer)
    assert _reason(dataclasses.replace(record, blob_id=BLOB_B)) is NameReason.BAD_SIGNATURE
    assert _reason(dataclasses.replace(record, seq=99)) is NameReason.BAD_SIGNATURE
    # Re-signed by another key but claiming the first publisher: still refused.
    other = SoftwareSigner(MachineKey.generate())
    forged = dataclasses.replace(record, signature=other.sign(record.signed_message()))
    assert _reason(forged.encode()) is NameReason.BAD_SIGNATURE


def test_an_unsigned_record_is_refused_as_unsigned(signer: SoftwareSigner) -> None:
    fields = msgpack.unpackb(_record(signer).encode())
    for sig in (None, b""):
        fields["sig"] = sig
        assert _reason(msgpack.packb(fields)) is NameReason.UNSIGNED
    del fields["sig"]
    assert _reason(msgpack.packb(fields)) is NameReason.UNSIGNED


def test_a_record_for_another_publisher_or_name_is_refused(signer: SoftwareSigner) -> None:
    record = _record(signer)
    someone = MachineKey.generate().peer_id
    assert _reason(record, publisher=someone) is NameReason.WRONG_PUBLISHER
    assert _reason(record, name="run-x/final") is NameReason.WRONG_NAME


def test_an_expired_record_is_refused_from_its_expiry_on(signer: SoftwareSigner) -> None:
    record = _record(signer, expires=NOW + 60)
    verify(record, now=NOW + 59)
    assert _reason(record, now=NOW + 60) is NameReason.EXPIRED


def test_a_trusting_resolver_wants_an_admitted_publisher(signer: SoftwareSigner) -> None:
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    trust = TrustStore(frozenset({authority.public_key_bytes}))
    cert = authority.admit(
        signer.peer_id,
        operator="lab-a",
        kernel_class="cuda-sm90-bf16",
        not_before=NOW - 10,
        not_after=NOW + 10,
        serial=7,
    )
    assert _reason(_record(signer), trust=trust) is NameReason.MISSING_CERTIFICATE
    admitted = _record(signer, certificate=cert)
    assert verify(admitted.encode(), now=NOW, trust=trust).certificate == cert
    assert _reason(admitted, now=NOW + 10, trust=trust) is NameReason.CERTIFICATE
    stranger = TrustStore(frozenset({MachineKey.generate().public_key_bytes}))
    assert _reason(admitted, trust=stranger) is NameReason.CERTIFICATE
    with pytest.raises(NameRejected, match="not the publisher"):
        _record(SoftwareSigner(MachineKey.generate()), certificate=cert)


def test_non_canonical_and_oversized_bytes_are_malformed(signer: SoftwareSigner) -> None:
    data = _record(signer).encode()
    fields = msgpack.unpackb(data)
    reordered = dict(reversed(list(fields.items())))
    assert _reason(msgpack.packb(reordered)) is NameReason.MALFORMED
    assert _reason(msgpack.packb({**fields, "extra": 1})) is NameReason.MALFORMED
    # seq as a 64-bit integer where one byte suffices: same value, another spelling.
    wide = data.replace(b"\xa3seq\x01", b"\xa3seq\xcf" + struct.pack(">Q", 1))
    assert wide != data
    assert _reason(wide) is NameReason.MALFORMED
    assert _reason(b"\x00" * (MAX_NAME_RECORD_SIZE + 1)) is NameReason.MALFORMED
    assert _reason(msgpack.packb({**fields, "name": "../etc"})) is NameReason.MALFORMED


@pytest.mark.parametrize("name", ["", "/x", "x/", "a//b", "a/../b", ".hidden", "a b", "é"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(BadName):
        parse_ref(f"{MachineKey.generate().peer_id}/{name}")


def test_a_reference_needs_a_peer_id_publisher() -> None:
    for text in ("adapter", "alice/adapter", "Qmfoo/adapter"):
        with pytest.raises(BadName):
            parse_ref(text)
    peer = MachineKey.generate().peer_id
    assert parse_ref(f"{peer}/run-x/adapter").name == "run-x/adapter"


def test_every_node_selects_the_same_newest_record(signer: SoftwareSigner) -> None:
    v1 = _record(signer, seq=1)
    v2 = _record(signer, seq=2, blob_id=BLOB_B)
    twin = _record(signer, seq=2, blob_id="c" * 64)  # equivocation: same seq, other blob
    later = _record(signer, seq=2, blob_id=BLOB_A, time=NOW + 1)
    pool = [v1, v2, twin, later]
    picks = {newest(order) for order in itertools.permutations(pool)}
    assert picks == {later}
    assert supersedes(v2, v1)
    assert not supersedes(v1, v2)
    assert supersedes(twin, v2) != supersedes(v2, twin)  # a strict, total order


# --- the DHT validator ------------------------------------------------------------------
def test_the_dht_validator_refuses_forgeries_and_keeps_the_newest(
    signer: SoftwareSigner,
) -> None:
    validator = NameValidator(clock=lambda: NOW)
    v1, v2 = _record(signer, seq=1), _record(signer, seq=2)
    key = dht_key(signer.peer_id, v1.name)
    validator.validate(key, v1.encode())
    with pytest.raises(NameRejected):  # a valid record under another name's key
        validator.validate(dht_key(signer.peer_id, "other"), v1.encode())
    forged = dataclasses.replace(v2, blob_id=BLOB_B).encode()
    with pytest.raises(NameRejected):
        validator.validate(key, forged)
    assert validator.select(key, [v1.encode(), v2.encode()]) == 1
    assert validator.select(key, [v2.encode(), v1.encode()]) == 0
    assert validator.select(key, [v1.encode(), forged]) == 0  # a forgery never wins


def test_one_peer_s_pushes_are_rate_limited() -> None:
    """Guards against a peer re-signing its names in a loop to make this node write and
    relay without end."""
    limiter = PushLimiter(limit=3)
    assert [limiter.allow("p", NOW + i * 0.1) for i in range(4)] == [True, True, True, False]
    assert limiter.allow("q", NOW)  # another peer has its own budget
    assert limiter.allow("p", NOW + PUSH_WINDOW_S)  # a new window


# --- the cache -------------------------------------------------------------------------
def _cache(tmp_path: Path) -> NameCache:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "locks").mkdir(exist_ok=True)
    return NameCache.for_store_root(tmp_path, tmp_path / "tmp")


def test_the_cache_keeps_the_newest_and_refuses_an_older_replay(
    signer: SoftwareSigner, tmp_path: Path
) -> None:
    cache = _cache(tmp_path)
    v1, v2 = _record(signer, seq=1), _record(signer, seq=2, blob_id=BLOB_B)
    assert cache.offer(v2, now=NOW).changed
    replay = cache.offer(v1, now=NOW)
    assert not replay.accepted
    assert "older" in replay.reason
    again = cache.offer(v2, now=NOW)
    assert again.accepted
    assert not again.changed
    assert cache.get(v1.key) == v2


def test_saved_records_survive_a_restart_and_damaged_ones_are_dropped(
    signer: SoftwareSigner, tmp_path: Path
) -> None:
    cache = _cache(tmp_path)
    good = _record(signer, name="good")
    doomed = _record(signer, name="doomed", expires=NOW + 5)
    for record in (good, doomed):
        cache.offer(record, now=NOW)
        cache.persist(record.key, now=NOW)
    damaged = _record(signer, name="damaged")
    encoded = damaged.encode()  # its signature's last byte flipped (never left as it was)
    (tmp_path / "names" / damaged.key.hex()).write_bytes(encoded[:-1] + bytes([encoded[-1] ^ 1]))
    misfiled = _record(signer, name="misfiled")  # a valid record under another name's file
    (tmp_path / "names" / ("0" * 64)).write_bytes(misfiled.encode())

    reopened = _cache(tmp_path)
    assert reopened.load(now=NOW + 10) == 1
    assert reopened.get(good.key) == good
    assert reopened.get(doomed.key) is None  # expired while the node was down
    assert reopened.get(damaged.key) is None
    assert sorted(p.name for p in (tmp_path / "names").iterdir()) == [good.key.hex()]


def test_another_process_s_newer_record_is_seen(signer: SoftwareSigner, tmp_path: Path) -> None:
    serving, publishing = _cache(tmp_path), _cache(tmp_path)
    v1, v2 = _record(signer, seq=1), _record(signer, seq=2, blob_id=BLOB_B)
    serving.offer(v1, now=NOW)
    serving.persist(v1.key, now=NOW)
    publishing.offer(v2, now=NOW)
    publishing.persist(v2.key, now=NOW)
    serving.reload_key(v1.key, now=NOW)
    assert serving.get(v1.key) == v2


def test_a_process_never_overwrites_a_newer_record_another_saved(
    signer: SoftwareSigner, tmp_path: Path
) -> None:
    """``blob publish`` saved v2 beside a serving node that has not seen it; the node
    then takes v1 from a peer. Its save must keep v2 on disk (and adopt it), not put
    the replayed v1 back."""
    serving, publishing = _cache(tmp_path), _cache(tmp_path)
    v1, v2 = _record(signer, seq=1), _record(signer, seq=2, blob_id=BLOB_B)
    publishing.offer(v2, now=NOW)
    publishing.persist(v2.key, now=NOW)
    assert serving.offer(v1, now=NOW).changed
    serving.persist(v1.key, now=NOW)
    assert serving.get(v1.key) == v2
    reopened = _cache(tmp_path)
    reopened.load(now=NOW)
    assert reopened.get(v1.key) == v2


def test_one_publisher_cannot_fill_the_cache(signer: SoftwareSigner) -> None:
    cache = NameCache()
    for i in range(MAX_RECORDS_PER_PUBLISHER):
        assert cache.offer(_record(signer, name=f"n{i}"), now=NOW).accepted
    refused = cache.offer(_record(signer, name="one-more"), now=NOW)
    assert not refused.accepted
    assert "full" in refused.reason
    assert cache.offer(_record(signer, name="mine"), now=NOW, own=True).accepted
    other = SoftwareSigner(MachineKey.generate())
    assert cache.offer(_record(other), now=NOW).accepted
    assert len(cache.by_publisher(signer.peer_id)) == MAX_RECORDS_PER_PUBLISHER


# --- the names protocol --------------------------------------------------------------
def test_protocol_messages_round_trip(signer: SoftwareSigner) -> None:
    raw = _record(signer).encode()
    pairs: list[tuple[wire.Request, wire.Response]] = [
        (wire.GetRequest(b"k" * 32), wire.RecordResponse(raw)),
        (wire.GetRequest(b"k" * 32), wire.RecordResponse(None)),
        (wire.PutRequest(raw), wire.PutResponse(False, "older")),
        (wire.ListRequest(signer.peer_id), wire.RecordsResponse((raw, raw))),
        (wire.ListRequest(signer.peer_id), wire.ErrorResponse("busy")),
    ]
    for request, response in pairs:
        req_frame, resp_frame = wire.encode(request), wire.encode(response)
        assert wire.body_length(req_frame[:4], limit=wire.MAX_REQUEST_SIZE) == len(req_frame) - 4
        assert wire.decode_request(req_frame[4:]) == request
        assert wire.decode_response(resp_frame[4:], request) == response


def test_hostile_protocol_bytes_are_refused_before_use(signer: SoftwareSigner) -> None:
    with pytest.raises(wire.NamesProtocolError, match="over the limit"):
        wire.body_length(struct.pack(">I", wire.MAX_REQUEST_SIZE + 1), limit=wire.MAX_REQUEST_SIZE)
    hostile = [
        msgpack.packb({"op": "get", "key": b"short"}),
        msgpack.packb({"op": "get", "key": b"k" * 32, "more": 1}),
        msgpack.packb({"key": b"k" * 32, "op": "get"}),  # other key order
        msgpack.packb({"op": "delete", "key": b"k" * 32}),
        msgpack.packb([1, 2]),
        b"\xc1",
    ]
    for body in hostile:
        with pytest.raises(wire.NamesProtocolError):
            wire.decode_request(body)
    listing = wire.ListRequest(signer.peer_id)
    too_many = msgpack.packb({"op": "records", "records": [b"r"] * (wire.MAX_LISTED_RECORDS + 1)})
    with pytest.raises(wire.NamesProtocolError):
        wire.decode_response(too_many, listing)
    wrong_kind = wire.encode(wire.RecordResponse(None))[4:]  # a get answer to a list
    with pytest.raises(wire.NamesProtocolError):
        wire.decode_response(wrong_kind, listing)


# --- the names service, in memory --------------------------------------------------------
class _PushStream:
    """A names stream whose far end sends one framed request and then reads the answer."""

    def __init__(self, request: bytes, peer: str) -> None:
        self._inbound = bytearray(request)
        self.answered = trio.Event()
        self.was_reset = False
        self.muxed_conn = types.SimpleNamespace(peer_id=peer)

    async def read(self, n: int) -> bytes:
        await trio.lowlevel.checkpoint()
        out = bytes(self._inbound[:n])
        del self._inbound[:n]
        return out

    async def write(self, data: bytes) -> None:
        self.answered.set()

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.was_reset = True


class _SilentHost:
    """Every peer it dials accepts the connection and never answers."""

    async def new_stream(self, peer: object, protocols: object) -> None:
        await trio.sleep_forever()


async def test_a_relay_in_flight_counts_against_the_request_cap(
    signer: SoftwareSigner, mock_clock: trio.testing.MockClock
) -> None:
    """Guards against a flood of pushes: each new record is relayed to up to 32 peers
    for up to PUBLISH_TIMEOUT after its request ended; uncounted, relays would pile up
    without bound while the request cap saw nothing."""
    slow_peer = SoftwareSigner(MachineKey.generate()).peer_id
    node = types.SimpleNamespace(
        peer_id="me", dht=None, host=_SilentHost(), connected_peers=lambda: [slow_peer]
    )
    service = NameService(node, NameCache(), clock=lambda: NOW)  # type: ignore[arg-type]
    stream = _PushStream(wire.encode(wire.PutRequest(_record(signer).encode())), "pusher")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service.handle_stream, stream)
        await stream.answered.wait()
        await trio.testing.wait_all_tasks_blocked()  # relaying to the peer that never answers
        active_while_relaying = service._active
        nursery.cancel_scope.cancel()
    assert active_while_relaying == 1
    assert service._active == 0


def test_a_reload_verifies_only_new_or_replaced_files(
    signer: SoftwareSigner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer alternating pushes (each changes the directory) and listings (each reloads
    it) must not make every listing re-verify the whole cache."""
    saving = _cache(tmp_path)
    for i in range(5):
        record = _record(signer, name=f"n{i}")
        saving.offer(record, now=NOW)
        saving.persist(record.key, now=NOW)
    serving = _cache(tmp_path)
    assert serving.load(now=NOW) == 5
    verified: list[bytes] = []
    real_verify = names_cache.verify

    def counting_verify(data: bytes, *, now: float) -> NameRecord:
        verified.append(data)
        return real_verify(data, now=now)

    newer = _record(signer, seq=2, name="n3", blob_id=BLOB_B)
    saving.offer(newer, now=NOW)
    saving.persist(newer.key, now=NOW)
    monkeypatch.setattr(names_cache, "verify", counting_verify)
    assert serving.load(now=NOW) == 1
    assert verified == [newer.encode()]
    assert serving.get(newer.key) == newer


async def test_requests_over_the_cap_are_reset_unanswered(
    signer: SoftwareSigner, mock_clock: trio.testing.MockClock
) -> None:
    """A flood of pushes: the first MAX_CONCURRENT_REQUESTS are answered (and relayed to a
    peer that never answers); the next is reset at once, before anything is read. (The
    mock clock stands still: no relay times out while the flood builds up.)"""
    slow_peer = SoftwareSigner(MachineKey.generate()).peer_id
    node = types.SimpleNamespace(
        peer_id="me", dht=None, host=_SilentHost(), connected_peers=lambda: [slow_peer]
    )
    service = NameService(node, NameCache(), clock=lambda: NOW)  # type: ignore[arg-type]
    streams = [
        _PushStream(wire.encode(wire.PutRequest(_record(signer, name=f"n{i}").encode())), f"p{i}")
        for i in range(MAX_CONCURRENT_REQUESTS + 1)
    ]
    async with trio.open_nursery() as nursery:
        for stream in streams[:-1]:
            nursery.start_soon(service.handle_stream, stream)
            await stream.answered.wait()
        nursery.start_soon(service.handle_stream, streams[-1])
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert streams[-1].was_reset
    assert not streams[-1].answered.is_set()


class _AnsweringStream:
    """A stream to a peer that answers any request with ``answer`` after ``delay`` s."""

    def __init__(self, answer: bytes, delay: float) -> None:
        self._answer = bytearray(answer)
        self._delay = delay

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()

    async def read(self, n: int) -> bytes:
        await trio.sleep(self._delay)
        self._delay = 0
        out = bytes(self._answer[:n])
        del self._answer[:n]
        return out

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


class _PeersHost:
    """Connected peers, each answering a names ``get`` with its record, in its time."""

    def __init__(self, answers: dict[str, tuple[bytes, float]]) -> None:
        self.answers = answers

    def set_stream_handler(self, protocol: object, handler: object) -> None:
        pass

    async def new_stream(self, peer: object, protocols: object) -> _AnsweringStream:
        record, delay = self.answers[str(peer)]
        return _AnsweringStream(wire.encode(wire.RecordResponse(record)), delay)


class _Node:
    def __init__(self, store: Store, host: _PeersHost) -> None:
        self.store, self.host, self.dht, self.peer_id = store, host, None, "me"
        self.name_service = None  # the node holds its names service (install sets it)

    def connected_peers(self) -> list[str]:
        return list(self.host.answers)


async def test_resolving_keeps_the_newest_valid_answer_whoever_answers_first(
    signer: SoftwareSigner, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Three peers answer: an old version at once, a forgery (the newest seq, a bad
    signature), and the current version a little later, within the resolve's grace."""
    old, current = _record(signer, seq=1), _record(signer, seq=3, blob_id=BLOB_B)
    forged = dataclasses.replace(_record(signer, seq=9), blob_id="f" * 64).encode()
    peers = [SoftwareSigner(MachineKey.generate()).peer_id for _ in range(3)]
    host = _PeersHost(
        {peers[0]: (old.encode(), 0.0), peers[1]: (forged, 0.0), peers[2]: (current.encode(), 0.2)}
    )
    node = _Node(Store.open(tmp_path / "store"), host)
    install(node, clock=lambda: NOW)  # type: ignore[arg-type]
    found = await resolve(node, f"{signer.peer_id}/run-x/adapter", now=NOW, use_dht=False)  # type: ignore[arg-type]
    assert found == current
