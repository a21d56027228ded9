"""Real architectures: a LoRA round on a GPT-2-style and on a Llama-style Hugging Face
model directory (sharded safetensors, a tokenizer.json trained here, records tokenised by
it), each built locally from a config and a fixed seed. The round runs here, another
process (started with the module, importing while the rounds are made) replays it to the
same digest through the ``blob`` CLI, and the evidence check accepts it only with that
replay's attestation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from blobstore import Store  # noqa: E402
from identity import (  # noqa: E402
    AdmissionCertificate,
    Authority,
    MachineKey,
    SoftwareSigner,
    TrustStore,
    create_key_file,
    sign_attestation,
)
from training import determinism, kernel_class  # noqa: E402
from training.errors import AuditViolation, BadRecords, EvidenceRejected  # noqa: E402
from training.hf_model import ARCH_TARGETS, build_model_dir  # noqa: E402
from training.rounds.commitment import ROUND_KIND  # noqa: E402
from training.rounds.recipe import Recipe  # noqa: E402
from training.rounds.round import RoundInputs, RoundResult, check_evidence, execute, run_round  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on. ",
    "A second machine replays the round and reaches the same digest, bit for bit. ",
] * 6
SEQ_LEN = 32
# Replays of both rounds in one process that imports torch + transformers + peft.
TIMEOUT = 150


@dataclasses.dataclass
class Arch:
    base: str
    records: str
    recipe: Recipe
    result: RoundResult


@dataclasses.dataclass
class World:
    tmp: Path
    store: Store
    authority: Authority
    trust: TrustStore
    bob_key: Path
    bob_cert: AdmissionCertificate
    archs: dict[str, Arch]
    replayer: subprocess.Popen[str]  # another process, to replay both rounds


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("BLOBNET_PASSPHRASE", None)
    paths = [tmp / "store", tmp / "bob.key", tmp / "bob.cert", tmp / "bob.att"]
    replayer = subprocess.Popen(
        [sys.executable, "-c", _REPLAY, *map(str, paths)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield _world(tmp, replayer)
    finally:
        if replayer.poll() is None:
            replayer.kill()
            replayer.communicate(timeout=10)


def _world(tmp: Path, replayer: subprocess.Popen[str]) -> World:
    from training.rounds.cli import train_group

    store = Store.open(tmp / "store")
    determinism.enter("cpu", threads=1)
    kc = kernel_class.detect("cpu").id
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    certs = {}
    keys = {}
    for serial, name in enumerate(("alice", "bob"), 1):
        keys[name] = tmp / f"{name}.key"
        peer = create_key_file(keys[name]).peer_id
        certs[name] = authority.admit(
            peer, operator=name, kernel_class=kc, not_before=0, not_after=2**40, serial=serial
        )
    from identity import load_key_file

    alice = SoftwareSigner(load_key_file(keys["alice"]))
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(CORPUS))
    archs = {}
    for arch in ("gpt2", "llama"):
        build_model_dir(arch, tmp / arch, CORPUS, seed=5)
        assert len(list((tmp / arch).glob("model-*-of-*.safetensors"))) >= 2  # sharded
        base = store.put_dir(tmp / arch)
        made = CliRunner().invoke(
            train_group,
            ["records", str(corpus), "--seq-len", str(SEQ_LEN), "--base", base],
            obj={"store_root": tmp / "store", "key_path": keys["alice"]},
        )
        assert made.exit_code == 0, made.output
        records = made.output.strip()
        recipe = Recipe(steps=3, batch_size=4, seq_len=SEQ_LEN, target_modules=ARCH_TARGETS[arch])
        result = run_round(
            store,
            RoundInputs(base, records, recipe, 7),
            alice,
            now=time.time(),
            device="cpu",
            certificate=certs["alice"],
        )
        archs[arch] = Arch(base, records, recipe, result)
    trust = TrustStore(frozenset({authority.public_key_bytes}))
    return World(tmp, store, authority, trust, keys["bob"], certs["bob"], archs, replayer)


# Started with the module's fixture, so that its imports overlap the rounds being made
# here; the round IDs come on stdin, one line.
_REPLAY = """
import sys
# torch, transformers, peft:
import training.rounds.cli, training.rounds.round, training.rounds.trainer
from transformers import AutoModelForCausalLM  # loaded lazily otherwise
from p2p.cli import main
store, key, cert, out = sys.argv[1:5]
for i, round_id in enumerate(sys.stdin.readline().split()):
    try:
        main(["--store", store, "--key", key, "train", "replay", round_id, "--cert", cert,
              "-o", f"{out}.{i}", "--json", "-q"])
    except SystemExit as exc:
        print(f"exit {exc.code}", file=sys.stderr)
        if exc.code:
            raise
"""


def test_gpt2_and_llama_rounds_replay_elsewhere_and_pass_only_with_the_replay(
    world: World,
) -> None:
    cert = world.tmp / "bob.cert"
    cert.write_bytes(world.bob_cert.encode())  # where the replayer was told to read it
    rounds = [world.archs[a].result.round_id for a in ("gpt2", "llama")]
    proc = world.replayer
    assert proc.stdin is not None
    proc.stdin.write(" ".join(rounds) + "\n")
    proc.stdin.flush()
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr[-3000:]
    replies = [json.loads(part) for part in stdout.replace("}\n{", "}\x00{").split("\x00")]
    for i, arch in enumerate(("gpt2", "llama")):
        result = world.archs[arch].result
        assert replies[i]["identical"] is True
        assert replies[i]["digest"] == result.commitment.digest.hex()
        replay = (world.tmp / f"bob.att.{i}").read_bytes()
        evidence = check_evidence(result.record, [replay], trust=world.trust, now=time.time())
        assert evidence.operators == ("alice", "bob")
        with pytest.raises(EvidenceRejected, match="1 distinct"):
            check_evidence(result.record, [], trust=world.trust, now=time.time())
        # Bob vouching by hand (the round-result kind, as `attest sign` once allowed)
        from identity import load_key_file

        by_hand = sign_attestation(
            SoftwareSigner(load_key_file(world.bob_key)),
            kind=ROUND_KIND,
            digest=result.commitment.digest,
            kernel_class=result.commitment.kernel_class_id,
            time=int(time.time()),
            certificate=world.bob_cert,
        ).encode()
        with pytest.raises(EvidenceRejected, match="wrong statement kind"):
            check_evidence(result.record, [by_hand], trust=world.trust, now=time.time())
    gpt2, llama = world.archs["gpt2"].result, world.archs["llama"].result
    assert gpt2.commitment.digest != llama.commitment.digest
    assert len(set(gpt2.commitment.step_log)) > 1  # it trained: the loss moved


def test_records_of_another_tokenizer_are_refused(world: World) -> None:
    gpt2, llama = world.archs["gpt2"], world.archs["llama"]
    with pytest.raises(BadRecords, match="tokenised with tokenizer"):
        execute(world.store, RoundInputs(gpt2.base, llama.records, gpt2.recipe, 1), device="cpu")


def test_gpt2_needs_its_audited_ops_and_unaudited_ones_stay_refused(world: World) -> None:
    from training.model import load_base_model
    from training.records import decode_records
    from training.rounds import audit, trainer

    gpt2 = world.archs["gpt2"]
    world.store.export(gpt2.base, world.tmp / "gpt2-export")
    session = trainer.prepare(load_base_model(world.tmp / "gpt2-export"), gpt2.recipe, 1, "cpu")
    records = decode_records(world.store.path(gpt2.records).read_bytes())
    allowed = audit.load_kernel_set("cpu")
    assert {"aten::addmm.default", "aten::gelu.default", "aten::relu.default"} <= allowed
    without = audit.make_auditor("cpu", allowed - {"aten::addmm.default"})
    with pytest.raises(AuditViolation, match=r"aten::addmm\.default is not in the audited"):
        trainer.run_steps(session, records, auditor=without)


def test_init_model_builds_a_sharded_directory_with_its_tokenizer(world: World) -> None:
    """`blob train init-model --arch llama --corpus FILE`: the same inputs, the same ID."""
    from training.rounds.cli import train_group

    corpus = world.tmp / "corpus.txt"
    obj = {"store_root": world.tmp / "store", "key_path": world.bob_key}
    args = ["init-model", "--arch", "llama", "--corpus", str(corpus), "--seed", "5"]
    runs = [CliRunner().invoke(train_group, args, obj=obj) for _ in range(2)]
    assert [r.exit_code for r in runs] == [0, 0], runs[0].output
    first = runs[0].output.strip()
    assert runs[1].output.strip() == first
    names = {e.path for e in world.store.read_collection(first)}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= names
    assert sum(n.endswith(".safetensors") for n in names) >= 2
    missing = CliRunner().invoke(train_group, ["init-model", "--arch", "gpt2"], obj=obj)
    assert missing.exit_code == 2 and "--corpus" in missing.output
