"""What the tests of a worker's parts (``training.outer.worker``) build them from, without
a worker: a node that is a real store and metrics, keys admitted by a test authority, and
a worker's configuration.

Import as ``tests.training.worker_parts``. The node here is the part of
``p2p.node.node.Node`` the parts ask for (its peer ID, store, metrics, adding bytes,
publishing, who is connected), with no network behind it: publishes are recorded."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import blake3

from blobstore import Store
from identity import (
    AdmissionCertificate,
    Authority,
    MachineKey,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
)
from p2p.metrics import Metrics
from training.outer.agreement import CheckedClosure, Closure, Included, check_closure, sign_closure
from training.outer.messages import UPDATE_KIND
from training.outer.params import RunParams, WorkerConfig

KC = "cpu-test"
AUTHORITY = Authority(SoftwareSigner(MachineKey.generate()))
TRUST = TrustStore(frozenset({AUTHORITY.public_key_bytes}))
PARAMS = RunParams("run-1", workers=3, rounds=4, inner_steps=1)


@dataclasses.dataclass
class Machine:
    """A machine key admitted by ``AUTHORITY`` (operator: ``op-`` and its short ID)."""

    key: MachineKey
    cert: AdmissionCertificate

    @property
    def peer(self) -> str:
        return self.key.peer_id

    @property
    def signer(self) -> SoftwareSigner:
        return SoftwareSigner(self.key)


def machine(operator: str | None = None) -> Machine:
    key = MachineKey.generate()
    now = int(time.time())
    cert = AUTHORITY.admit(
        key.peer_id,
        operator=operator or f"op-{key.peer_id[-6:]}",
        kernel_class=KC,
        not_before=0,
        not_after=now + 3600,
        serial=1,
    )
    return Machine(key, cert)


class Node:
    """A node without a network: a real store, metrics, and publishes recorded."""

    def __init__(self, root: Path, peer: str) -> None:
        self.peer_id = peer
        self.store = Store.open(root)
        self.metrics = Metrics()
        self.published: list[bytes] = []
        self.connected: list[str] = []
        self.reachable_addrs = ["/ip4/127.0.0.1/tcp/1/p2p/" + peer]

    async def add_bytes(self, data: bytes) -> str:
        return self.store.put_bytes(data)

    async def add_blocks(self, blocks: list[bytes | memoryview]) -> str:
        return self.store.put_blocks(blocks)

    async def publish(self, topic: str, data: bytes) -> None:
        self.published.append(data)

    def connected_peers(self) -> list[str]:
        return list(self.connected)


def config(tmp_path: Path, params: RunParams = PARAMS, **changes: Any) -> WorkerConfig:
    """A worker's configuration (its files need not exist: the parts read none)."""
    return WorkerConfig(
        params=params,
        shard=0,
        store_root=tmp_path / "store",
        key_path=tmp_path / "machine.key",
        cert_path=tmp_path / "machine.cert",
        authorities=(AUTHORITY.public_key_bytes,),
        result_path=None,
        **changes,
    )


def update(m: Machine, round_: int, root: str) -> Included:
    """``m``'s update for ``round_`` from ``root`` (a made-up blob), attested."""
    blob = blake3.blake3(f"{m.peer}/{round_}/{root}".encode()).hexdigest()
    attestation = sign_attestation(
        m.signer,
        kind=UPDATE_KIND,
        digest=bytes.fromhex(blob),
        kernel_class=KC,
        subjects=[blob, root, "c0" * 32],  # a commitment blob (never fetched here)
        time=int(time.time()),
        certificate=m.cert,
    )
    return Included(m.peer, blob, attestation.encode())


def close(
    proposer: Machine,
    round_: int,
    root: str,
    included: list[Included],
    run: str = PARAMS.run_id,
    *,
    result: str | None = None,
    state_blob: str | None = None,
) -> CheckedClosure:
    """``proposer``'s closure of ``round_`` naming ``included`` (a made-up result root and
    state blob where none is given)."""
    entries = tuple(sorted(included, key=lambda x: x.peer))
    made_up = blake3.blake3((root + "".join(x.blob for x in entries)).encode()).hexdigest()
    result = result or made_up
    state = state_blob or blake3.blake3(result.encode()).hexdigest()
    closure = Closure(run, round_, root, proposer.peer, entries, result, state)
    body, attestation = sign_closure(
        proposer.signer,
        closure,
        kernel_class=KC,
        certificate=proposer.cert,
        time=int(time.time()),
    )
    return check_closure(body, attestation, run=run, trust=TRUST, now=time.time(), quorum=1)
