"""The machine's side: the TPM commands of binding, activation and co-signing (tpm2-pytss).

1. The EK is the TCG default RSA-2048 endorsement key, re-created from its standard
   template (``tpm2_pytss.utils.create_ek_template``, which also reads the EK certificate
   from its NV index). A primary key is a function of the hierarchy's seed and the
   template, so this is the same key the manufacturer certified.
2. The AK is a primary key in the endorsement hierarchy as well: ECC P-256, restricted
   ECDSA-SHA256 signing, fixedTPM, fixedParent, sensitiveDataOrigin, with a blobnet
   ``unique`` value (:data:`AK_UNIQUE`). Being a primary, it is re-created identically on
   every use and never leaves the TPM, not even as a wrapped blob; only the TPM whose
   endorsement seed made it can make it again.
3. Restricted keys sign only what the TPM hashed itself (TPM2_Hash with its ticket), so
   every message here is short (``identity.hardware``).
4. Every transient object is flushed before the TPM is closed; every tpm2-pytss error
   becomes :class:`~identity.errors.TpmUnavailable` (cannot reach the TPM) or
   :class:`~identity.errors.TpmRefused` (the TPM said no) here, at one boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import TpmRefused, TpmUnavailable
from ..hardware import AK_SIGNATURE_SIZE, binding_message
from ..keys import MachineKey
from ._pytss import pytss
from .formats import MAX_EK_CHAIN, Challenge, Evidence

AK_UNIQUE = b"blobnet-attestation-key-v1"
EK_TEMPLATE = "EK-RSA2048"
# TCG EK Credential Profile 2.3: NV indices 0x01c00100-0x01c001ff hold the EK's chain.
EK_CHAIN_FIRST = 0x01C00100
EK_CHAIN_LAST = 0x01C001FF


def _ak_template(t: Any) -> Any:
    attrs = (
        t.TPMA_OBJECT.RESTRICTED
        | t.TPMA_OBJECT.SIGN_ENCRYPT
        | t.TPMA_OBJECT.FIXEDTPM
        | t.TPMA_OBJECT.FIXEDPARENT
        | t.TPMA_OBJECT.SENSITIVEDATAORIGIN
        | t.TPMA_OBJECT.USERWITHAUTH
    )
    template = t.TPM2B_PUBLIC(
        t.TPMT_PUBLIC.parse("ecc256:ecdsa-sha256:null", objectAttributes=attrs)
    )
    template.publicArea.unique.ecc.x = AK_UNIQUE
    return template


def ak_point_of(public: Any) -> bytes:
    """The 65-byte point of an ECC TPM2B_PUBLIC."""
    key = serialization.load_pem_public_key(public.publicArea.to_pem())
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return key.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )


class Tpm:
    """An open TPM (one ESAPI context); use through :func:`open_tpm`."""

    def __init__(self, ctx: Any, tcti: str) -> None:
        self._ctx = ctx
        self._tcti = tcti
        self._handles: list[Any] = []

    def _keep(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    def flush(self) -> None:
        while self._handles:
            with contextlib.suppress(Exception):
                self._ctx.flush_context(self._handles.pop())

    def endorsement_key(self) -> tuple[Any, Any, bytes]:
        """The EK's handle, public area and certificate (DER)."""
        t = pytss()
        try:
            cert, template = t.utils.create_ek_template(EK_TEMPLATE, t.utils.NVReadEK(self._ctx))
        except t.utils.NoSuchIndex:
            raise TpmRefused(
                f"the TPM at {self._tcti!r} holds no RSA-2048 EK certificate; its "
                "manufacturer (or swtpm_setup --create-ek-cert) must provide one"
            ) from None
        handle, public, *_ = self._ctx.create_primary(
            t.TPM2B_SENSITIVE_CREATE(), template, t.ESYS_TR.ENDORSEMENT
        )
        return self._keep(handle), public, bytes(cert)

    def ek_chain(self) -> list[bytes]:
        """The certificates of the EK's chain the TPM holds (often none)."""
        t = pytss()
        _more, data = self._ctx.get_capability(
            t.TPM2_CAP.HANDLES, EK_CHAIN_FIRST, EK_CHAIN_LAST - EK_CHAIN_FIRST + 1
        )
        indices = [h for h in data.data.handles if EK_CHAIN_FIRST <= h <= EK_CHAIN_LAST]
        reader = t.utils.NVReadEK(self._ctx)
        return [bytes(reader(index)) for index in indices[:MAX_EK_CHAIN]]

    def attestation_key(self) -> tuple[Any, Any]:
        """The AK's handle and public area (re-created: rule 2)."""
        t = pytss()
        handle, public, *_ = self._ctx.create_primary(
            t.TPM2B_SENSITIVE_CREATE(), _ak_template(t), t.ESYS_TR.ENDORSEMENT
        )
        return self._keep(handle), public

    def sign(self, ak: Any, message: bytes) -> bytes:
        """The AK's ``r || s`` signature of ``message`` (hashed by the TPM: rule 3)."""
        t = pytss()
        digest, ticket = self._ctx.hash(message, t.TPM2_ALG.SHA256, t.ESYS_TR.ENDORSEMENT)
        signature = self._ctx.sign(ak, digest, t.TPMT_SIG_SCHEME(scheme=t.TPM2_ALG.NULL), ticket)
        half = AK_SIGNATURE_SIZE // 2
        r = bytes(signature.signature.ecdsa.signatureR).rjust(half, b"\0")
        s = bytes(signature.signature.ecdsa.signatureS).rjust(half, b"\0")
        return r + s

    def activate(self, ak: Any, ek: Any, challenge: Challenge) -> bytes:
        """TPM2_ActivateCredential: the credential, if this TPM holds the EK and the AK."""
        t = pytss()
        blob, _ = t.TPM2B_ID_OBJECT.unmarshal(challenge.credential_blob)
        secret, _ = t.TPM2B_ENCRYPTED_SECRET.unmarshal(challenge.encrypted_secret)
        # The EK's policy is PolicySecret(TPM_RH_ENDORSEMENT): a policy session proves it.
        session = self._keep(
            self._ctx.start_auth_session(
                t.ESYS_TR.NONE,
                t.ESYS_TR.NONE,
                t.TPM2_SE.POLICY,
                t.TPMT_SYM_DEF(algorithm=t.TPM2_ALG.NULL),
                t.TPM2_ALG.SHA256,
            )
        )
        self._ctx.policy_secret(t.ESYS_TR.ENDORSEMENT, session, b"", b"", b"", 0)
        try:
            credential = self._ctx.activate_credential(
                ak, ek, blob, secret, session1=t.ESYS_TR.PASSWORD, session2=session
            )
        except t.TSS2_Exception as exc:
            raise TpmRefused(
                f"the TPM refused to activate the credential ({exc}): the challenge was made "
                "for another TPM's endorsement key or another attestation key"
            ) from None
        return bytes(credential)


@contextlib.contextmanager
def open_tpm(tcti: str, source: str = "from --tcti") -> Iterator[Tpm]:
    """The TPM named by a TCTI string: ``device:/dev/tpmrm0``, ``tabrmd``,
    ``swtpm:host=127.0.0.1,port=N``...; ``source`` says where that string came from, for
    the message when the TPM cannot be opened."""
    t = pytss()
    try:
        ctx = t.ESAPI(tcti)
    except Exception as exc:  # TSS2_Exception or a TCTI loader error: one boundary
        raise TpmUnavailable(f"cannot open the TPM at {tcti!r} ({source}): {exc}") from None
    tpm = Tpm(ctx, tcti)
    try:
        yield tpm
    except t.TSS2_Exception as exc:
        raise TpmRefused(f"the TPM at {tcti!r} failed a command: {exc}") from None
    finally:
        tpm.flush()
        ctx.close()


def bind(key: MachineKey, tcti: str, source: str = "from --tcti") -> tuple[Evidence, bytes]:
    """The evidence that the TPM's AK vouches for ``key``, and the AK's point."""
    with open_tpm(tcti, source) as tpm:
        _ek, ek_public, ek_cert = tpm.endorsement_key()
        chain = tpm.ek_chain()
        ak, ak_public = tpm.attestation_key()
        binding = tpm.sign(ak, binding_message(key.public_key_bytes))
    evidence = Evidence(
        peer_id=key.peer_id,
        ek_cert=ek_cert,
        ek_chain=tuple(chain),
        ek_public=bytes(ek_public.marshal()),
        ak_public=bytes(ak_public.marshal()),
        binding=binding,
    )
    return evidence, ak_point_of(ak_public)


def activate(tcti: str, challenge: Challenge, source: str = "from --tcti") -> bytes:
    """The credential of ``challenge``, recovered by this TPM (``TpmRefused`` if it cannot)."""
    with open_tpm(tcti, source) as tpm:
        ek, _ek_public, _cert = tpm.endorsement_key()
        ak, _ak_public = tpm.attestation_key()
        return tpm.activate(ak, ek, challenge)


def ak_sign(tcti: str, message: bytes, source: str = "from --tcti") -> tuple[bytes, bytes]:
    """The AK's point and its signature of ``message``."""
    with open_tpm(tcti, source) as tpm:
        ak, ak_public = tpm.attestation_key()
        return ak_point_of(ak_public), tpm.sign(ak, message)
