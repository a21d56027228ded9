"""Machine keys and key files: creation, permissions, encryption, libp2p peer IDs."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from identity import (
    BadKeyFile,
    BadPeerId,
    IdentityError,
    KeyExists,
    KeyNotFound,
    KeyPermissionsTooOpen,
    MachineKey,
    PassphraseRequired,
    Signer,
    SoftwareSigner,
    WrongPassphrase,
    create_key_file,
    ensure_key,
    load_key_file,
    load_or_create_key,
    peer_id_from_public_key,
    public_key_from_peer_id,
    save_key_file,
    verify_signature,
)
from identity._files import PRIVATE_FILE_MODE, write_file
from identity.keyfile import ScryptCost, encode_key_file

FAST = ScryptCost(log_n=12)  # new key files quick to seal; the file records the cost


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """A permissive umask, so modes we get are modes we set, not the umask's."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_file_is_created_0600_in_a_new_0700_directory(tmp_path: Path) -> None:
    path = tmp_path / "config" / "blobnet" / "machine.key"
    key = create_key_file(path)
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    assert mode(path.parent.parent) == 0o700
    assert sorted(os.listdir(path.parent)) == ["machine.key"], "temp file left behind"
    assert load_key_file(path) == key


def test_existing_key_file_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "machine.key"
    first = create_key_file(path)
    before = path.read_bytes()
    with pytest.raises(KeyExists, match="never overwritten"):
        create_key_file(path)
    with pytest.raises(KeyExists):
        save_key_file(path, MachineKey.generate(), "a passphrase")
    assert path.read_bytes() == before
    assert load_key_file(path) == first
    assert load_or_create_key(path) == first


def test_racing_creators_make_exactly_one_key(tmp_path: Path) -> None:
    """Regression guard for check-then-write: two creators must not both 'win'."""
    path = tmp_path / "machine.key"
    winners: list[MachineKey] = []
    losers: list[Exception] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait(timeout=10)
        try:
            winners.append(save_and_return(path))
        except KeyExists as exc:
            losers.append(exc)

    def save_and_return(p: Path) -> MachineKey:
        key = MachineKey.generate()
        # Bypass save_key_file's early exists() check to race on the atomic link itself.
        write_file(p, encode_key_file(key), mode=PRIVATE_FILE_MODE, overwrite=False)
        return key

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(winners) == 1
    assert len(losers) == 7
    assert load_key_file(path) == winners[0]
    assert sorted(os.listdir(tmp_path)) == ["machine.key"]


def test_ensure_key_creates_once_then_loads(tmp_path: Path) -> None:
    path = tmp_path / "k" / "machine.key"
    key, created = ensure_key(path)
    assert created
    again, created_again = ensure_key(path)
    assert not created_again
    assert again == key


@pytest.mark.parametrize("bad_mode", [0o644, 0o640, 0o604, 0o660, 0o602, 0o610])
def test_key_accessible_by_others_is_refused_with_the_fix(tmp_path: Path, bad_mode: int) -> None:
    path = tmp_path / "machine.key"
    create_key_file(path)
    os.chmod(path, bad_mode)
    with pytest.raises(KeyPermissionsTooOpen) as info:
        load_key_file(path)
    message = str(info.value)
    assert f"{bad_mode:04o}" in message
    assert f"chmod 600 {path}" in message
    assert info.value.exit_code == 5
    os.chmod(path, 0o600)
    load_key_file(path)  # fixed as the message says, it loads


def test_missing_key_file(tmp_path: Path) -> None:
    with pytest.raises(KeyNotFound) as info:
        load_key_file(tmp_path / "nope.key")
    assert info.value.exit_code == 3


def test_encrypted_key_round_trip_and_no_plaintext_seed(tmp_path: Path) -> None:
    path = tmp_path / "machine.key"
    key = create_key_file(path, "correct horse")
    data = path.read_bytes()
    assert key.seed not in data
    fields = msgpack.unpackb(data[len(b"blobnet-key\n") :])
    assert (fields["kdf"], fields["log_n"], fields["r"]) == ("scrypt", 15, 8)
    assert load_key_file(path, "correct horse") == key
    with pytest.raises(PassphraseRequired):
        load_key_file(path)


def test_wrong_passphrase_is_a_clear_error_and_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "machine.key"
    key = create_key_file(path, "correct horse", cost=FAST)
    before = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    with pytest.raises(WrongPassphrase, match="wrong passphrase") as info:
        load_key_file(path, "battery staple")
    assert info.value.exit_code == 4
    with pytest.raises(WrongPassphrase):
        load_or_create_key(path, "battery staple")
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == mtime
    assert load_key_file(path, "correct horse") == key


def test_damaged_unencrypted_key_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "machine.key"
    key = create_key_file(path)
    data = bytearray(path.read_bytes())
    i = bytes(data).index(key.seed)
    data[i] ^= 0x01
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))
    with pytest.raises(BadKeyFile, match="does not match"):
        load_key_file(path)


def test_damaged_encrypted_key_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "machine.key"
    key = create_key_file(path, "pw", cost=FAST)
    good = path.read_bytes()
    # the public key (associated data), then the last byte (the tag)
    for i in (good.index(key.public_key_bytes) + 3, len(good) - 1):
        data = bytearray(good)
        data[i] ^= 0x80
        path.unlink()
        path.write_bytes(bytes(data))
        os.chmod(path, 0o600)
        with pytest.raises((WrongPassphrase, BadKeyFile)):
            load_key_file(path, "pw")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEI...\n-----END PRIVATE KEY-----\n",
        b"blobnet-key\n",
        b"blobnet-key\n\x80",
        b"blobnet-key\n" + b"\xff" * 40,
        b"blobnet-key\n" + b"x" * 5000,
    ],
)
def test_not_a_key_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "machine.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(BadKeyFile) as info:
        load_key_file(path)
    assert info.value.exit_code == 4


def test_peer_id_matches_py_libp2p_and_the_keypair_is_the_same_key() -> None:
    from libp2p.crypto.ed25519 import Ed25519PublicKey
    from libp2p.peer.id import ID

    key = MachineKey.generate()
    pair = key.libp2p_keypair()
    assert pair.public_key.to_bytes() == key.public_key_bytes
    assert ID.from_pubkey(pair.public_key).to_base58() == key.peer_id
    assert key.peer_id.startswith("12D3KooW")
    assert len(key.peer_id) == 52
    message = b"hello libp2p"
    # libp2p's private key signs what our verifier accepts, and the other way round
    assert verify_signature(key.public_key_bytes, message, pair.private_key.sign(message))
    assert pair.public_key.verify(message, key.sign(message))
    assert not pair.public_key.verify(message + b"!", key.sign(message))
    assert isinstance(pair.public_key, Ed25519PublicKey)


def test_peer_id_of_keys_made_by_py_libp2p() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    for _ in range(20):
        pair = create_new_key_pair()
        expected = ID.from_pubkey(pair.public_key).to_base58()
        assert peer_id_from_public_key(pair.public_key.to_bytes()) == expected
        assert public_key_from_peer_id(expected) == pair.public_key.to_bytes()
        assert MachineKey(pair.private_key.to_bytes()).peer_id == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # an RSA (sha2-256) peer ID
        "12D3KooW",
        "12D3KooWMeWJMC4nmjsSZeRECoKuMSFYhMitaraJVwNs1kqxpGE0",  # '0' is not base58
        "112D3KooWMeWJMC4nmjsSZeRECoKuMSFYhMitaraJVwNs1kqxpGEU",  # extra leading zero byte
        "12D3KooWMeWJMC4nmjsSZeRECoKuMSFYhMitaraJVwNs1kqxpGEU" * 2,
    ],
)
def test_bad_peer_ids_are_rejected(text: str) -> None:
    with pytest.raises(BadPeerId):
        public_key_from_peer_id(text)


def test_software_signer_is_a_signer_that_says_its_kind() -> None:
    key = MachineKey.generate()
    signer = SoftwareSigner(key)
    assert isinstance(signer, Signer)
    assert signer.kind == "software"
    assert signer.peer_id == key.peer_id
    assert verify_signature(signer.public_key_bytes, b"m", signer.sign(b"m"))
    assert not verify_signature(MachineKey.generate().public_key_bytes, b"m", signer.sign(b"m"))
    assert key.seed.hex() not in repr(key) + repr(signer)


def test_all_errors_carry_an_exit_code() -> None:
    import identity

    for name in identity.__all__:
        obj = getattr(identity, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, IdentityError)
            assert obj.exit_code in {1, 2, 3, 4, 5}, name


def test_without_hard_links_keys_are_still_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some mounts refuse link(); the O_EXCL fallback must keep the no-overwrite rule."""

    def no_link(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    path = tmp_path / "machine.key"
    key = create_key_file(path)
    assert mode(path) == 0o600
    assert load_key_file(path) == key
    assert sorted(os.listdir(tmp_path)) == ["machine.key"]
    with pytest.raises(KeyExists):
        write_file(path, b"other", mode=PRIVATE_FILE_MODE, overwrite=False)
    assert load_key_file(path) == key


def test_a_sealed_key_records_the_cost_it_was_given_within_the_readers_bounds(
    tmp_path: Path,
) -> None:
    path = tmp_path / "machine.key"
    key = create_key_file(path, "pw", cost=FAST)
    fields = msgpack.unpackb(path.read_bytes()[len(b"blobnet-key\n") :])
    assert (fields["log_n"], fields["r"], fields["p"]) == (12, 8, 1)
    assert load_key_file(path, "pw") == key
    with pytest.raises(ValueError, match="outside what key files may carry"):
        ScryptCost(log_n=21)  # a reader would refuse the file
