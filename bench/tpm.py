"""TPM identity benchmark: binding and admission against swtpm, and what the AK adds.

Starts one swtpm (Debian's swtpm and swtpm-tools; tpm2-pytss from the ``tpm`` extra) on a
private 127.0.0.1 port, then times, in this process:

- binding: ``device.bind`` (EK re-created from its template, EK certificate read, AK
  re-created, binding signed);
- admission: the authority's checks and TPM2_MakeCredential, the machine's
  TPM2_ActivateCredential and signed answer, the authority's answer check and certificate
  (files and process start-up excluded: each ``blob`` command adds its import time);
- an attestation signed by the TPM-bound signer against the software signer on the same
  key, in the same run (the limit: what the AK co-signature adds), and the verification of
  each.

Goals: binding + admission < 5 s; a hardware-signed attestation adds < 50 ms.

    .venv/bin/python bench/tpm.py [--runs 5] [--attestations 50] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cryptography import x509

from identity import (
    HARDWARE_SIGNER_KINDS,
    Authority,
    HardwareRoot,
    MachineKey,
    Signer,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
    verify_attestation,
)
from identity.tpm import (
    Answer,
    MachineBinding,
    Registry,
    TpmSigner,
    check_binding,
    device,
    make_challenge,
)
from identity.tpm.swtpm import local_ca_certificates, missing_tools, running_swtpm

GOAL_ADMISSION_S = 5.0
GOAL_ADDED_MS = 50.0


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--attestations", type=int, default=50)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    missing = missing_tools()
    if missing is not None:
        print(f"bench/tpm.py: cannot run here: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        with running_swtpm(root / "state", root / "ca") as tpm:
            manufacture_s = time.perf_counter() - started
            cas = [
                x509.load_pem_x509_certificate(p.read_bytes())
                for p in local_ca_certificates(root / "ca")
            ]
            authority_key = MachineKey.generate()
            authority = Authority(SoftwareSigner(authority_key))
            binds, admits, totals = [], [], []
            for _ in range(args.runs):
                key = MachineKey.generate()
                t0 = time.perf_counter()
                evidence, ak = device.bind(key, tpm.tcti)
                t1 = time.perf_counter()
                now = time.time()
                machine = check_binding(evidence, cas, now=now)
                credential = secrets.token_bytes(32)
                challenge = make_challenge(
                    machine,
                    credential=credential,
                    nonce=secrets.token_bytes(16),
                    expires=int(now) + 300,
                    authority=authority_key.public_key_bytes,
                )
                registry = Registry().with_challenge(machine, challenge, credential, now)
                answer = Answer.sign(key, challenge.nonce, device.activate(tpm.tcti, challenge))
                _rest, pending, _replaced = registry.answer(answer, now=now, replace=False)
                cert = authority.admit(
                    pending.peer_id,
                    operator="bench",
                    kernel_class="cpu-bench",
                    not_before=int(now) - 60,
                    not_after=int(now) + 3600,
                    serial=1,
                    hardware=HardwareRoot(ak=pending.ak, ek_hash=pending.ek_hash),
                )
                t2 = time.perf_counter()
                binds.append(t1 - t0)
                admits.append(t2 - t1)
                totals.append(t2 - t0)

            signers: dict[str, Signer] = {
                "software": SoftwareSigner(key),
                "tpm": TpmSigner(key, MachineBinding(peer_id=key.peer_id, tcti=tpm.tcti, ak=ak)),
            }
            trust = TrustStore(frozenset({authority_key.public_key_bytes}))
            software_cert = authority.admit(
                key.peer_id,
                operator="bench",
                kernel_class="cpu-bench",
                not_before=int(now) - 60,
                not_after=int(now) + 3600,
                serial=2,
            )
            certs = {"software": software_cert, "tpm": cert}
            requires = {"software": None, "tpm": HARDWARE_SIGNER_KINDS}
            sign_s: dict[str, list[float]] = {"software": [], "tpm": []}
            verify_s: dict[str, list[float]] = {"software": [], "tpm": []}
            for i in range(args.attestations):
                for name, signer in signers.items():
                    t0 = time.perf_counter()
                    att = sign_attestation(
                        signer,
                        kind="round-result",
                        digest=i.to_bytes(32, "big"),
                        kernel_class="cpu-bench",
                        time=int(now),
                        certificate=certs[name],
                    )
                    t1 = time.perf_counter()
                    verify_attestation(
                        att.encode(), trust=trust, now=now, signer_kinds=requires[name]
                    )
                    t2 = time.perf_counter()
                    sign_s[name].append(t1 - t0)
                    verify_s[name].append(t2 - t1)
    added_ms = round(_median_ms(sign_s["tpm"]) - _median_ms(sign_s["software"]), 2)
    admission_s = round(statistics.median(totals), 4)
    result = {
        "swtpm_manufacture_and_start_s": round(manufacture_s, 3),
        "runs": args.runs,
        "bind_ms_median": _median_ms(binds),
        "admission_ms_median": _median_ms(admits),
        "bind_plus_admission_s_median": admission_s,
        "bind_plus_admission_s_max": round(max(totals), 4),
        "attestations": args.attestations,
        "sign_ms_median": {k: _median_ms(v) for k, v in sign_s.items()},
        "verify_ms_median": {k: _median_ms(v) for k, v in verify_s.items()},
        "ak_cosignature_added_ms": added_ms,
        "goals": {
            "bind_plus_admission_under_s": GOAL_ADMISSION_S,
            "added_under_ms": GOAL_ADDED_MS,
            "met": admission_s < GOAL_ADMISSION_S and added_ms < GOAL_ADDED_MS,
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0 if result["goals"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
