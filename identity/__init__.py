"""Machine identities, admission certificates and signed attestations (DESIGN 7).

- :class:`MachineKey`: an Ed25519 key; its libp2p peer ID names the machine, and
  :meth:`MachineKey.libp2p_keypair` hands the same key to the libp2p host.
- Key files (:func:`create_key_file`, :func:`load_key_file`): created once with mode 0600,
  refused when others can read them, optionally sealed under a passphrase.
- :class:`Signer` / :class:`SoftwareSigner`: how everything signs; hardware signers plug
  in behind the same protocol, and every signature records its ``kind``.
- :class:`Authority` issues :class:`AdmissionCertificate` s; :func:`verify_certificate`
  checks them against a :class:`TrustStore` (authorities + :class:`RevocationList`).
- :func:`sign_attestation` / :func:`verify_attestation`: domain-separated signed claims;
  a :class:`HardwareSigner` (a TPM-bound machine, :mod:`identity.tpm`) adds its attestation
  key's co-signature, the evidence ``--require-hardware`` accepts (:mod:`identity.hardware`).
- :func:`machine_signer`: the signer of a machine key, TPM-backed when it is bound.
- :func:`is_reserved_kind`: statement kinds only the code that computed them signs
  (``blob attest sign`` refuses them); :mod:`identity.kinds` says what that proves.
- :func:`write_file`: the durable write (temp file, fsync, rename) of every file the
  identity and training commands write (keys never overwritten).
- :func:`decode_msgpack_map`: the bounded, strict msgpack map parse every signed or
  canonical format here starts from (training's records and messages use it too); the
  certificate, attestation and TPM formats each declare one schema
  (:mod:`blobstore.schema`) that encodes and decodes them.
- Commands: :mod:`identity.cli` (``blob id``, ``authority``, ``admit``, ``attest``,
  ``cert``) over :mod:`identity.tpm.cli`, both over :mod:`identity.cli_common`, which also
  gives the commands above (p2p, training) their trust and ``--require-hardware`` options.
"""

from __future__ import annotations

from blobstore.canonical import decode_map as decode_msgpack_map

from ._files import PUBLIC_FILE_MODE, write_file
from .attestation import (
    ATTESTATION_DOMAIN,
    MAX_ATTESTATION_SIZE,
    MAX_SUBJECTS,
    Attestation,
    sign_attestation,
    verify_attestation,
)
from .certificate import (
    CERTIFICATE_DOMAIN,
    MAX_CERTIFICATE_SIZE,
    AdmissionCertificate,
    Authority,
    HardwareRoot,
    RevocationList,
    TrustStore,
    verify_certificate,
)
from .errors import (
    AdmissionReason,
    AdmissionRefused,
    AttestationRejected,
    BadAttestation,
    BadCertificate,
    BadKeyFile,
    BadPeerId,
    BadPublicKey,
    BadRevocationList,
    BadTpmData,
    CertificateRejected,
    IdentityError,
    KeyExists,
    KeyFileIOError,
    KeyNotFound,
    KeyPermissionsTooOpen,
    NotFound,
    PassphraseRequired,
    Reason,
    Rejected,
    ReservedKind,
    TpmRefused,
    TpmUnavailable,
    WrongPassphrase,
)
from .keyfile import (
    create_key_file,
    ensure_key,
    load_key_file,
    load_or_create_key,
    save_key_file,
)
from .keys import MachineKey, format_public_key, parse_public_key, verify_signature
from .kinds import (
    HARDWARE_SIGNER_KINDS,
    RESERVED_KINDS,
    RESERVED_PREFIX,
    is_hardware_signer,
    is_reserved_kind,
)
from .peerid import parse_peer_id, peer_id_from_public_key, public_key_from_peer_id
from .signer import SOFTWARE, HardwareSigner, Signer, SoftwareSigner
from .tpm.signer import TpmSigner, machine_signer

__all__ = [
    "ATTESTATION_DOMAIN",
    "CERTIFICATE_DOMAIN",
    "HARDWARE_SIGNER_KINDS",
    "MAX_ATTESTATION_SIZE",
    "MAX_CERTIFICATE_SIZE",
    "MAX_SUBJECTS",
    "PUBLIC_FILE_MODE",
    "RESERVED_KINDS",
    "RESERVED_PREFIX",
    "SOFTWARE",
    "AdmissionCertificate",
    "AdmissionReason",
    "AdmissionRefused",
    "Attestation",
    "AttestationRejected",
    "Authority",
    "BadAttestation",
    "BadCertificate",
    "BadKeyFile",
    "BadPeerId",
    "BadPublicKey",
    "BadRevocationList",
    "BadTpmData",
    "CertificateRejected",
    "HardwareRoot",
    "HardwareSigner",
    "IdentityError",
    "KeyExists",
    "KeyFileIOError",
    "KeyNotFound",
    "KeyPermissionsTooOpen",
    "MachineKey",
    "NotFound",
    "PassphraseRequired",
    "Reason",
    "Rejected",
    "ReservedKind",
    "RevocationList",
    "Signer",
    "SoftwareSigner",
    "TpmRefused",
    "TpmSigner",
    "TpmUnavailable",
    "TrustStore",
    "WrongPassphrase",
    "create_key_file",
    "decode_msgpack_map",
    "ensure_key",
    "format_public_key",
    "is_hardware_signer",
    "is_reserved_kind",
    "load_key_file",
    "load_or_create_key",
    "machine_signer",
    "parse_peer_id",
    "parse_public_key",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "save_key_file",
    "sign_attestation",
    "verify_attestation",
    "verify_certificate",
    "verify_signature",
    "write_file",
]
