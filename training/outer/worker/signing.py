"""What a worker signs with: its machine's signer, one signature at a time.

1. Everything a worker attests (updates, closures, verdicts, milestones, catch-up records,
   its final root) is signed by :class:`Signing`, off the event loop and one signature at
   a time: a TPM co-signature is a round trip to the chip (a hardware TPM re-creates its
   AK for each, tens to hundreds of milliseconds), and a TPM serves one session at a time.
2. :func:`check_signer`: a signer whose attestations the run would refuse is refused
   before the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

from identity import AdmissionCertificate, HardwareSigner, Signer
from training.outer.params import OuterNetError

_T = TypeVar("_T")


def check_signer(signer: Signer, certificate: AdmissionCertificate, require_hardware: bool) -> None:
    """Refuse, before the run, a signer whose attestations the run would refuse: on a
    TPM-bound machine the certificate must record its AK (else every attestation would be
    refused as unproven), and a run that requires hardware needs a hardware signer."""
    if isinstance(signer, HardwareSigner) and certificate.ak != signer.ak:
        raise OuterNetError(
            "this machine key is TPM-bound, but its certificate does not record that TPM's "
            "attestation key; admit the machine on its TPM (`blob tpm challenge` / `blob tpm "
            "admit`)"
        )
    if require_hardware and not isinstance(signer, HardwareSigner):
        raise OuterNetError(
            "this run requires hardware-signed attestations, and this machine key is not "
            "TPM-bound; bind it (`blob tpm bind`) and admit it on its TPM"
        )


class Signing:
    """The signer, the certificate and kernel class an attestation names, and the lock
    (rule 1). ``kernel_class`` is the trainer's, known once it is built."""

    def __init__(self, signer: Signer, certificate: AdmissionCertificate) -> None:
        self.signer = signer
        self.certificate = certificate
        self.kernel_class = ""
        self._lock = trio.Lock()

    async def sign(self, sign: Callable[[], _T]) -> _T:
        """Run ``sign`` in a thread, after any signature still running."""
        async with self._lock:
            return await trio.to_thread.run_sync(sign)
