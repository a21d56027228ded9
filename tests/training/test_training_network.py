"""A training round over real nodes: separate ``blob`` processes, real TCP on 127.0.0.1,
real stores on disk.

Node A holds the base model and the records and serves them; node B runs the round,
fetching its inputs from A, publishes the adapter and the round record and serves them;
node C replays the round, fetching the record from B and the inputs from B and A, reaches
the same digest and attests; the evidence check accepts B's and C's attestations (two
distinct admitted operators of the CPU kernel class).

The swapped adapter: B, now dishonest, re-publishes the round with its commitment's
adapter ID pointing at another adapter collection (the genuine adapter with one weight
byte changed) and signs that forged commitment with its own admitted key. The runner's
signature is then valid, so only replication can catch it: node D, replaying the forged
record while C replays the genuine one (two replays at once: the test's longest steps),
trains to the genuine adapter and exits 1 naming both adapter IDs, attesting nothing; and
C's attestation of the genuine round does not count for the forged one, so
the check rejects it. (Tampering with an adapter blob in C's own store would prove
nothing: a replay never reads the round's adapter, it recomputes it; and the store
verifies every chunk it receives over the network, so a tampered copy cannot arrive.)

The nodes (``serve``) and the commands that fetch and train (``train run``, ``train
replay``) are processes of their own; the local commands that make keys, certificates and
inputs and that check evidence read and write only files and stores, so they run in this
process (each subprocess would pay another interpreter start, and ``init-model`` and
``kernel-class`` another torch import, for the same files). The three training processes
start first and import torch, transformers and peft while the inputs are made; each then
reads its command line from stdin and runs it through ``blob``'s ``main`` (``Warm``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blobstore import Store
from identity import AdmissionCertificate, SoftwareSigner, load_key_file, sign_attestation
from tests.blob_cli import blob_here, go, start_warm
from training.rounds.commitment import ROUND_KIND, RoundRecord

# Each command that trains imports torch + transformers + peft: 5-20 s on a loaded machine.
TIMEOUT = 180.0
READY_TIMEOUT = 60.0
LISTEN = "/ip4/127.0.0.1/tcp/0"
SEQ_LEN = 16
CORPUS = b"blobnet trains a round; a second machine replays it bit for bit. " * 8


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("BLOBNET_PASSPHRASE", None)
    return env


class Machine:
    """One machine's store and key; its ``blob`` command lines."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.store = self.dir / "store"
        self.key = self.dir / "machine.key"

    def cmd(self, *args: str) -> list[str]:
        return [
            sys.executable, "-m", "p2p.cli", "--store", str(self.store), "--key", str(self.key),
            *args,
        ]  # fmt: skip

    def here(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        """``blob ARGS`` in this process (for commands that only touch files and stores)."""
        return blob_here(self.cmd(*args)[3:], code)


class Warm:
    """One machine's training process, importing; ``go`` gives it its command line."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.proc = start_warm(_env())

    def go(self, *args: str) -> subprocess.Popen[str]:
        go(self.proc, self.machine.cmd(*args)[3:])
        return self.proc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def finish(
    proc: subprocess.Popen[str], args: tuple[str, ...], code: int = 0
) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"blob {' '.join(args)} timed out: {err[-2000:]}") from None
    assert proc.returncode == code, (
        f"blob {' '.join(args)} exited {proc.returncode}, expected {code}:\n"
        f"stdout: {out[-1000:]}\nstderr: {err[-3000:]}"
    )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(done.stdout)


class Server:
    """``blob serve`` in its own process; ``addr`` is its first full multiaddr, known once
    ``ready`` has read the node's ready line (at once unless ``wait`` is false, so that
    several nodes can start together)."""

    def __init__(self, machine: Machine, *, wait: bool = True) -> None:
        self.name = machine.name
        self.log = machine.dir / "serve.log"
        with self.log.open("wb") as log:  # a pipe nobody reads would block a chatty node
            self.proc = subprocess.Popen(
                machine.cmd("serve", "--json", "--no-dht", "--listen", LISTEN),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=_env(),
            )
        if wait:
            self.ready()

    def ready(self) -> Server:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            err = self.log.read_text(errors="replace")
            raise AssertionError(f"node {self.name} did not become ready: {err[-2000:]}")
        info = json.loads(line)
        self.peer_id: str = info["peer_id"]
        self.addr: str = info["addrs"][0]
        assert self.addr.endswith(f"/p2p/{self.peer_id}")
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def warm() -> Iterator[list[Warm]]:
    started: list[Warm] = []
    try:
        yield started
    finally:
        for process in started:
            process.kill()


def complete(store: Store, blob_id: str) -> bool:
    """``blob_id`` and, for a collection, every child is complete in ``store``."""
    if not store.has(blob_id):
        return False
    if store.is_collection(blob_id):
        return all(store.has(e.blob_id) for e in store.read_collection(blob_id))
    return True


def swapped_adapter(store: Store, adapter_id: str, workdir: Path) -> str:
    """Another adapter collection: the genuine one with one weight byte changed."""
    store.export(adapter_id, workdir)
    weights = next(workdir.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte is tensor data (the header comes first)
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    swapped = store.put_dir(workdir)
    assert swapped != adapter_id
    return swapped


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_round_over_real_nodes(tmp_path: Path, servers: list[Server], warm: list[Warm]) -> None:
    a, b, c, d = (Machine(tmp_path, n) for n in ("a", "b", "c", "d"))
    warm.extend(Warm(m) for m in (b, c, d))  # B's round, C's and D's replays
    authority_key = tmp_path / "authority.key"
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(CORPUS)
    recipe = tmp_path / "recipe.msgpack"

    recipe_args = (
        "train", "recipe", "-o", str(recipe), "--steps", "2", "--batch-size", "2",
        "--seq-len", str(SEQ_LEN), "--rank", "2", "--json",
    )  # fmt: skip

    # 1-2. Authority, machine keys, kernel class, A's inputs and the certificates: local
    # commands, in this process.
    made = {
        "authority": a.here("authority", "new", "-o", str(authority_key), "--json"),
        **{f"id_{m.name}": m.here("id", "--json") for m in (b, c, d)},
        "kernel_class": a.here("train", "kernel-class", "--device", "cpu", "--json"),
        "base": a.here("train", "init-model", "--size", "tiny", "--seed", "0", "--json"),
        "recipe": a.here(*recipe_args),
        "records": a.here("train", "records", str(corpus), "--seq-len", str(SEQ_LEN), "--json"),
    }
    out = {name: as_json(done) for name, done in made.items()}
    base, records = out["base"]["id"], out["records"]["id"]
    assert out["records"]["records"] > 2 * 2  # more records than the round's batches use
    kc = out["kernel_class"]["id"]
    assert kc.startswith("cpu"), kc
    pub = out["authority"]["public_key"]
    certs: dict[str, Path] = {}
    for name, operator in (("b", "operator-b"), ("c", "operator-c"), ("d", "operator-d")):
        certs[name] = tmp_path / f"{name}.cert"
        cert = as_json(
            a.here(
                "admit", out[f"id_{name}"]["peer_id"], "--operator", operator,
                "--kernel-class", kc, "--authority", str(authority_key),
                "-o", str(certs[name]), "--json",
            )
        )  # fmt: skip
        assert cert["operator"] == operator

    store_a = Store.open(a.store)
    assert complete(store_a, base) and complete(store_a, records)
    node_a = Server(a)
    servers.append(node_a)

    # 3. B runs the round with nothing local: base and records come from A over TCP.
    store_b = Store.open(b.store)
    assert not store_b.has(base) and not store_b.has(records)
    run_args = (
        "train", "run", "--base", base, "--records", records, "--recipe", str(recipe),
        "--seed", "7", "--device", "cpu", "--peer", node_a.addr,
        "--cert", str(certs["b"]), "--json", "-q",
    )  # fmt: skip
    run = as_json(finish(warm[0].go(*run_args), run_args))
    round_id, commitment = run["round"], run["commitment"]
    digest, adapter = commitment["digest"], commitment["adapter"]
    assert commitment["kernel_class_id"] == kc
    assert (commitment["base"], commitment["records"]) == (base, records)
    assert len(commitment["step_log"]) == 2
    assert complete(store_b, base) and complete(store_b, records)
    assert store_b.has(round_id) and complete(store_b, adapter)
    node_b = Server(b)
    servers.append(node_b)

    # 4. B, now dishonest, re-publishes the round pointing at another adapter and signs
    # the forged commitment with its own admitted key (step 6 checks what comes of it).
    record = RoundRecord.decode(store_b.path(round_id).read_bytes())
    swapped = swapped_adapter(store_b, adapter, tmp_path / "swapped")
    forged = dataclasses.replace(record.commitment, adapter_id=swapped)
    assert forged.digest.hex() != digest
    signed = sign_attestation(
        SoftwareSigner(load_key_file(b.key)),
        kind=ROUND_KIND,
        digest=forged.digest,
        kernel_class=forged.kernel_class_id,
        subjects=(base, records, swapped),
        time=int(time.time()),
        certificate=AdmissionCertificate.decode(certs["b"].read_bytes()),
    )
    forged_id = store_b.put_bytes(RoundRecord(forged, record.recipe, signed.encode()).encode())

    # C replays the genuine round while D replays the forged one, each fetching the
    # record from B and the inputs from B and A.
    store_c, store_d = Store.open(c.store), Store.open(d.store)
    assert not store_c.has(round_id) and not store_c.has(base) and not store_d.has(base)
    attestation_c = tmp_path / "c.att"
    replay_args = (
        "train", "replay", round_id, "--peer", node_b.addr, "--peer", node_a.addr,
        "--cert", str(certs["c"]), "-o", str(attestation_c), "--json", "-q",
    )  # fmt: skip
    forged_args = (
        "train", "replay", forged_id, "--peer", node_b.addr, "--peer", node_a.addr,
        "--cert", str(certs["d"]), "-q",
    )  # fmt: skip
    replaying = warm[1].go(*replay_args), warm[2].go(*forged_args)
    try:
        replay = as_json(finish(replaying[0], replay_args))
        mismatch = finish(replaying[1], forged_args, code=1)
    finally:
        for proc in replaying:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert replay["identical"] is True
    assert replay["digest"] == digest
    assert complete(store_c, base) and complete(store_c, records)
    # The replay recomputed the adapter: the very same collection is now in C's store.
    assert complete(store_c, adapter)
    assert store_c.path(replay["attestation"]).read_bytes() == attestation_c.read_bytes()

    # 5. The evidence check: B's attestation (the runner's, in the record, and given here
    # as a file too) and C's (by blob ID) are two operators over the same digest.
    attestation_b = tmp_path / "b.att"
    attestation_b.write_bytes(record.attestation)
    verdict = as_json(
        c.here(
            "train", "check", round_id, str(attestation_b), replay["attestation"],
            "--authority", pub, "--json",
        )
    )  # fmt: skip
    assert verdict["accepted"] is True
    assert verdict["digest"] == digest and verdict["kernel_class"] == kc
    assert verdict["operators"] == ["operator-b", "operator-c"]
    # The runner alone is one operator: not enough.
    alone = c.here("train", "check", round_id, str(attestation_b), "--authority", pub, code=1)
    assert "1 distinct admitted operator" in alone.stdout, alone.stdout

    # 6. D's replay of the forged record trained to the genuine adapter, named both and
    # attested nothing: D holds what C does (the inputs and the genuine adapter, which it
    # recomputed), with the forged record instead of the genuine one and no attestation.
    assert "adapter" in mismatch.stderr, mismatch.stderr
    assert adapter in mismatch.stderr and swapped in mismatch.stderr, mismatch.stderr
    assert "Traceback" not in mismatch.stderr
    assert "attestation" not in mismatch.stdout
    held_c = {info.blob_id for info in store_c.list_blobs()}
    held_d = {info.blob_id for info in store_d.list_blobs()}
    assert held_d == (held_c - {round_id, replay["attestation"]}) | {forged_id}
    # C's attestation is over the genuine digest, not the forged round's.
    rejected = d.here(
        "train", "check", forged_id, str(attestation_c), "--authority", pub, "--json", code=1
    )
    verdict = as_json(rejected)
    assert verdict["accepted"] is False
    assert digest in verdict["message"] and forged.digest.hex() in verdict["message"]
    # The forged record's own signature is valid, but it is still one operator.
    forged_att = tmp_path / "forged.att"
    forged_att.write_bytes(signed.encode())
    lone = d.here("train", "check", forged_id, str(forged_att), "--authority", pub, code=1)
    assert "1 distinct admitted operator" in lone.stdout, lone.stdout
    # A replay never fetches the adapter a record names: the swapped one is not at D.
    assert not store_d.has(swapped)
