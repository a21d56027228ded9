"""Machine and authority key files.

Rules (DESIGN 7, research 1.4):

1. A key file is created once and never overwritten: it is written to a temp file with
   mode 0600 and linked into place, which fails if the name exists (``KeyExists``). A
   directory we create for it is 0700.
2. A key file that group or others can access is refused before it is read, as ssh does,
   with the ``chmod 600`` that fixes it.
3. With a passphrase, the 32-byte seed is sealed with ChaCha20-Poly1305 under a key
   derived by scrypt from the passphrase, a random 16-byte salt and a random nonce. The
   header (format version, KDF parameters, salt, nonce, public key) is the AEAD's
   associated data, so nothing in the file can be changed without detection. A wrong
   passphrase fails the tag check: ``WrongPassphrase``, and the file is never written.
4. The public key is stored in the clear and checked against the seed on load, so a
   damaged unencrypted file is detected too.

File layout: the magic line ``blobnet-key\\n`` then one canonical msgpack map::

    {"v": 1, "alg": "ed25519", "public": bin32, "seed": bin32}
    {"v": 1, "alg": "ed25519", "public": bin32, "kdf": "scrypt", "log_n": 15, "r": 8,
     "p": 1, "salt": bin16, "nonce": bin12, "sealed": bin48}
"""

from __future__ import annotations

import os
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from blobstore.canonical import CodecError, decode_map, require_canonical
from blobstore.canonical import encode as encode_canonical

from . import _codec
from ._files import PRIVATE_FILE_MODE, make_private_dir, write_file
from .errors import (
    BadKeyFile,
    KeyExists,
    KeyFileIOError,
    KeyNotFound,
    KeyPermissionsTooOpen,
    PassphraseRequired,
    WrongPassphrase,
)
from .keys import ED25519_SEED_SIZE, MachineKey
from .peerid import ED25519_PUBLIC_KEY_SIZE

MAGIC = b"blobnet-key\n"
FORMAT_VERSION = 1
# A key file is about 200 bytes; anything much larger is not one of ours.
MAX_KEY_FILE_SIZE = 1024

# scrypt cost for new files: N = 2**15, r = 8 (32 MiB, ~0.1 s), the "interactive" setting
# of the scrypt paper and libsodium. Files may carry other costs within the bounds below;
# the upper bound keeps a tampered file from asking for more than 1 GiB of memory.
SCRYPT_LOG_N = 15
SCRYPT_R = 8
SCRYPT_P = 1
_SCRYPT_LOG_N_RANGE = range(10, 21)
_SCRYPT_R_RANGE = range(1, 33)
_SCRYPT_P_RANGE = range(1, 17)


@dataclass(frozen=True)
class ScryptCost:
    """The scrypt cost a new sealed key file is written with (and records): N = 2**log_n.
    A cheaper one (tests) must still lie within the bounds every reader accepts."""

    log_n: int = SCRYPT_LOG_N
    r: int = SCRYPT_R
    p: int = SCRYPT_P

    def __post_init__(self) -> None:
        if (
            self.log_n not in _SCRYPT_LOG_N_RANGE
            or self.r not in _SCRYPT_R_RANGE
            or self.p not in _SCRYPT_P_RANGE
        ):
            raise ValueError(f"scrypt cost {self} is outside what key files may carry")


_SCRYPT_MAX_MEMORY = 1 << 30
SALT_SIZE = 16
NONCE_SIZE = 12
_SEALED_SIZE = ED25519_SEED_SIZE + 16  # seed + Poly1305 tag

_PLAIN_KEYS = ("v", "alg", "public", "seed")
_SEALED_KEYS = ("v", "alg", "public", "kdf", "log_n", "r", "p", "salt", "nonce", "sealed")


def _derive(passphrase: str, salt: bytes, log_n: int, r: int, p: int) -> bytes:
    secret = unicodedata.normalize("NFC", passphrase).encode("utf-8")
    return Scrypt(salt=salt, length=32, n=1 << log_n, r=r, p=p).derive(secret)


def encode_key_file(
    key: MachineKey, passphrase: str | None = None, *, cost: ScryptCost = ScryptCost()
) -> bytes:
    """The bytes of a key file holding ``key``, sealed under ``passphrase`` if given (at
    scrypt ``cost``)."""
    if passphrase is None:
        fields: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "alg": "ed25519",
            "public": key.public_key_bytes,
            "seed": key.seed,
        }
        return MAGIC + encode_canonical(fields)
    if not passphrase:
        raise ValueError("an empty passphrase protects nothing; pass None for no encryption")
    salt, nonce = os.urandom(SALT_SIZE), os.urandom(NONCE_SIZE)
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "alg": "ed25519",
        "public": key.public_key_bytes,
        "kdf": "scrypt",
        "log_n": cost.log_n,
        "r": cost.r,
        "p": cost.p,
        "salt": salt,
        "nonce": nonce,
    }
    kek = _derive(passphrase, salt, cost.log_n, cost.r, cost.p)
    aad = MAGIC + encode_canonical(header)
    sealed = ChaCha20Poly1305(kek).encrypt(nonce, key.seed, aad)
    return MAGIC + encode_canonical({**header, "sealed": sealed})


def decode_key_file(
    data: bytes, passphrase: str | None = None, *, name: str = "key file"
) -> MachineKey:
    """Parse key-file bytes (raises BadKeyFile, PassphraseRequired, WrongPassphrase)."""
    if not data.startswith(MAGIC):
        raise BadKeyFile(
            f"{name} is not a blobnet key file (it lacks the 'blobnet-key' header); "
            "blobnet does not read PEM or libp2p key files"
        )
    body = data[len(MAGIC) :]
    what = name
    try:
        fields = decode_map(body, max_size=MAX_KEY_FILE_SIZE, what=what)
        version = _codec.take(fields, "v", int, what=what)
        if version != FORMAT_VERSION:
            raise CodecError(
                f"{what} has format version {version}; this blobnet reads version "
                f"{FORMAT_VERSION} (upgrade blobnet)"
            )
        if _codec.take(fields, "alg", str, what=what) != "ed25519":
            raise CodecError(f"{what} holds a {fields['alg']!r} key, not ed25519")
        public = _codec.take_bytes(fields, "public", ED25519_PUBLIC_KEY_SIZE, what=what)
        if "seed" in fields:
            _codec.check_keys(fields, _PLAIN_KEYS, what=what)
            seed = _codec.take_bytes(fields, "seed", ED25519_SEED_SIZE, what=what)
            rebuilt = encode_canonical({k: fields[k] for k in _PLAIN_KEYS})
        else:
            _codec.check_keys(fields, _SEALED_KEYS, what=what)
            if _codec.take(fields, "kdf", str, what=what) != "scrypt":
                raise CodecError(f"{what} uses the unknown KDF {fields['kdf']!r}")
            log_n = _codec.take(fields, "log_n", int, what=what)
            r = _codec.take(fields, "r", int, what=what)
            p = _codec.take(fields, "p", int, what=what)
            if (
                log_n not in _SCRYPT_LOG_N_RANGE
                or r not in _SCRYPT_R_RANGE
                or p not in _SCRYPT_P_RANGE
                or 128 * r * (1 << log_n) > _SCRYPT_MAX_MEMORY
            ):
                raise CodecError(f"{what} has out-of-range scrypt parameters")
            salt = _codec.take_bytes(fields, "salt", SALT_SIZE, what=what)
            nonce = _codec.take_bytes(fields, "nonce", NONCE_SIZE, what=what)
            sealed = _codec.take_bytes(fields, "sealed", _SEALED_SIZE, what=what)
            rebuilt = encode_canonical({k: fields[k] for k in _SEALED_KEYS})
        require_canonical(body, rebuilt, what=what)
    except CodecError as exc:
        raise BadKeyFile(f"{exc}; the key file is damaged") from None

    if "seed" not in fields:
        if passphrase is None:
            raise PassphraseRequired(
                f"{name} is encrypted: give its passphrase (set BLOBNET_PASSPHRASE or run "
                "the command in a terminal to be asked)"
            )
        header = {k: fields[k] for k in _SEALED_KEYS if k != "sealed"}
        aad = MAGIC + encode_canonical(header)
        kek = _derive(passphrase, salt, log_n, r, p)
        try:
            seed = ChaCha20Poly1305(kek).decrypt(nonce, sealed, aad)
        except InvalidTag:
            raise WrongPassphrase(
                f"wrong passphrase for {name} (or the file is damaged); the file is unchanged"
            ) from None
    key = MachineKey(seed)
    if key.public_key_bytes != public:
        raise BadKeyFile(f"{name} is damaged: its public key does not match its private key")
    return key


def _check_permissions(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise BadKeyFile(f"{path} is not a regular file")
    if os.name == "posix" and st.st_mode & 0o077:
        raise KeyPermissionsTooOpen(
            f"permissions {stat.S_IMODE(st.st_mode):04o} for {path} are too open: a private "
            f"key must not be accessible by group or others; fix it with `chmod 600 {path}`"
        )


def read_key_file_bytes(path: Path) -> bytes:
    """The bytes of a key file, after the ssh-style permission check."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyNotFound(f"no key file at {path}") from None
    except OSError as exc:
        raise KeyFileIOError(f"cannot open key file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)  # of the file we opened, not of whatever the name points to now
        _check_permissions(path, st)
        if st.st_size > MAX_KEY_FILE_SIZE + len(MAGIC):
            raise BadKeyFile(f"{path} is {st.st_size} bytes, too large to be a key file")
        chunks = []
        while chunk := os.read(fd, MAX_KEY_FILE_SIZE + len(MAGIC) + 1):
            chunks.append(chunk)
            if sum(map(len, chunks)) > MAX_KEY_FILE_SIZE + len(MAGIC):
                raise BadKeyFile(f"{path} is too large to be a key file")
        return b"".join(chunks)
    except OSError as exc:
        raise KeyFileIOError(f"cannot read key file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def load_key_file(path: Path, passphrase: str | None = None) -> MachineKey:
    """Load a key file.

    Raises KeyNotFound, KeyPermissionsTooOpen, PassphraseRequired, WrongPassphrase,
    BadKeyFile, KeyFileIOError. A passphrase given for an unencrypted file is ignored.
    """
    path = Path(path)
    return decode_key_file(read_key_file_bytes(path), passphrase, name=str(path))


def save_key_file(
    path: Path, key: MachineKey, passphrase: str | None = None, *, cost: ScryptCost = ScryptCost()
) -> None:
    """Write ``key`` to a new key file (0600, missing directories 0700; KeyExists if present)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise KeyExists(
            f"{path} already exists and is never overwritten; "
            "choose another path or move the old file away first"
        )
    make_private_dir(path.parent)
    data = encode_key_file(key, passphrase, cost=cost)
    write_file(path, data, mode=PRIVATE_FILE_MODE, overwrite=False)


def create_key_file(
    path: Path, passphrase: str | None = None, *, cost: ScryptCost = ScryptCost()
) -> MachineKey:
    """Generate a key and write it to a new key file (see :func:`save_key_file`)."""
    key = MachineKey.generate()
    save_key_file(path, key, passphrase, cost=cost)
    return key


def load_or_create_key(path: Path, passphrase: str | None = None) -> MachineKey:
    """Load the key at ``path``, creating it first if there is none."""
    key, _created = ensure_key(path, passphrase)
    return key


def ensure_key(path: Path, passphrase: str | None = None) -> tuple[MachineKey, bool]:
    """Like :func:`load_or_create_key`, also saying whether the key was just created."""
    try:
        return load_key_file(path, passphrase), False
    except KeyNotFound:
        pass
    try:
        return create_key_file(path, passphrase), True
    except KeyExists:  # another process created it between our two calls
        return load_key_file(path, passphrase), False
