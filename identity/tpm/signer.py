"""A TPM-bound machine's signer, and the small file that says a machine key is TPM-bound.

``blob tpm bind`` writes ``KEY.tpm`` beside the machine key (public, canonical msgpack)::

    {"v": 1, "peer": "12D3KooW...", "tcti": "device:/dev/tpmrm0", "ak": bin65}

:func:`machine_signer` is how commands that attest pick their signer: a
:class:`TpmSigner` when that file is there (its attestations carry the AK's co-signature),
else the :class:`~identity.signer.SoftwareSigner`. The TPM is reached at the file's
``tcti``, or at ``$BLOBNET_TCTI`` when that is set (a TPM simulator or resource manager
moved to another address), and an error that cannot reach it says which. A TpmSigner
checks, on every co-signature, that the TPM it reaches still makes the recorded AK, so a
moved key file or another address fails loudly instead of signing with another TPM's key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from blobstore.canonical import CodecError, decode_map, require_canonical
from blobstore.canonical import encode as encode_canonical

from .. import _codec
from ..errors import BadPeerId, BadTpmData, KeyFileIOError, TpmRefused
from ..hardware import AK_POINT_SIZE, TPM_SIGNER_KIND, parse_ak_point
from ..keys import MachineKey
from ..peerid import parse_peer_id
from ..signer import Signer, SoftwareSigner
from . import device

BINDING_SUFFIX = ".tpm"
# Where a TPM is reached when the command line does not say: every TPM command's --tcti
# default, and for a bound key the override of the address its binding records.
TCTI_ENV = "BLOBNET_TCTI"
BINDING_VERSION = 1
# A TCTI string is a short name and a config (a device path, host and port).
MAX_TCTI_LENGTH = 256
MAX_BINDING_FILE_SIZE = 1024
_FIELDS = ("v", "peer", "tcti", "ak")


def binding_path(key_path: Path) -> Path:
    """Where the TPM binding of the machine key at ``key_path`` is recorded."""
    return key_path.with_name(key_path.name + BINDING_SUFFIX)


@dataclasses.dataclass(frozen=True)
class MachineBinding:
    """This machine key is vouched for by the AK ``ak`` of the TPM reached by ``tcti``."""

    peer_id: str
    tcti: str
    ak: bytes

    def __post_init__(self) -> None:
        what = "TPM binding"
        try:
            parse_peer_id(self.peer_id)
        except BadPeerId as exc:
            raise CodecError(f"{what} peer: {exc}") from None
        _codec.check_text(self.tcti, MAX_TCTI_LENGTH, f"{what} tcti")
        try:
            parse_ak_point(self.ak)
        except ValueError as exc:
            raise CodecError(f"{what} ak: {exc}") from None

    def encode(self) -> bytes:
        return encode_canonical(
            {"v": BINDING_VERSION, "peer": self.peer_id, "tcti": self.tcti, "ak": self.ak}
        )

    @classmethod
    def decode(cls, data: bytes, *, source: str) -> MachineBinding:
        try:
            fields = decode_map(data, max_size=MAX_BINDING_FILE_SIZE, what=source)
            _codec.check_keys(fields, _FIELDS, what=source)
            if _codec.take(fields, "v", int, what=source) != BINDING_VERSION:
                raise CodecError(f"{source} has an unknown version")
            binding = cls(
                peer_id=_codec.take(fields, "peer", str, what=source),
                tcti=_codec.take(fields, "tcti", str, what=source),
                ak=_codec.take_bytes(fields, "ak", AK_POINT_SIZE, what=source),
            )
            require_canonical(data, binding.encode(), what=source)
        except CodecError as exc:
            raise BadTpmData(f"bad TPM binding file: {exc}") from None
        return binding


def read_binding(key_path: Path) -> MachineBinding | None:
    """The binding recorded beside the key at ``key_path``, or None."""
    path = binding_path(key_path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BINDING_FILE_SIZE + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KeyFileIOError(f"cannot read {path}: {exc.strerror}") from exc
    return MachineBinding.decode(data, source=str(path))


class TpmSigner:
    """Signs with the Ed25519 machine key and co-signs with the TPM's AK.

    The TPM is reached at ``tcti`` when given, else at the binding's; ``source`` says where
    that address came from, for the errors that name it."""

    def __init__(
        self,
        key: MachineKey,
        binding: MachineBinding,
        *,
        tcti: str | None = None,
        source: str = "recorded in the key's TPM binding",
    ) -> None:
        if binding.peer_id != key.peer_id:
            raise TpmRefused(
                f"the TPM binding is for {binding.peer_id}, not this key's {key.peer_id}; "
                "bind this key (`blob tpm bind`)"
            )
        self._key = key
        self._binding = binding
        self._tcti = tcti or binding.tcti
        self._source = source

    @property
    def kind(self) -> str:
        return TPM_SIGNER_KIND

    @property
    def peer_id(self) -> str:
        return self._key.peer_id

    @property
    def public_key_bytes(self) -> bytes:
        return self._key.public_key_bytes

    @property
    def ak(self) -> bytes:
        return self._binding.ak

    @property
    def tcti(self) -> str:
        return self._tcti

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def cosign(self, message: bytes) -> bytes:
        point, signature = device.ak_sign(self._tcti, message, self._source)
        if point != self._binding.ak:
            raise TpmRefused(
                f"the TPM at {self._tcti!r} ({self._source}) is not the one this key was "
                "bound to (its attestation key differs); use the bound TPM or bind again"
            )
        return signature

    def __repr__(self) -> str:
        return f"TpmSigner(peer_id={self.peer_id!r}, tcti={self.tcti!r})"


def machine_signer(
    key: MachineKey, key_path: Path, *, environ: Mapping[str, str] = os.environ
) -> Signer:
    """The signer of the machine key at ``key_path``: TPM-backed when it is bound, reaching
    the TPM at ``$BLOBNET_TCTI`` (from ``environ``) when set, else where the binding says."""
    binding = read_binding(key_path)
    if binding is None:
        return SoftwareSigner(key)
    where = binding_path(key_path)
    override = environ.get(TCTI_ENV) or None
    if override is not None:
        source = f"from ${TCTI_ENV}, which overrides the {binding.tcti!r} that {where} records"
    else:
        source = f"recorded in {where} by `blob tpm bind`; ${TCTI_ENV} overrides it"
    return TpmSigner(key, binding, tcti=override, source=source)
