"""A user's own Hugging Face model through the outer loop, as a user drives it from the
command line: ``blob outer init`` from a GPT-2-style directory built here (sharded
safetensors, its own tokenizer), records tokenised with that tokenizer, two ``blob outer
worker --spec`` processes over TCP on 127.0.0.1 with real stores (the second fetches the
spec, the base and the records from the first), then ``blob outer export`` and
``from_pretrained``: the exported weights are the run's tip, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from blobstore import Store
from training.outer.launch import prepare_run, wait_for_addrs, worker_env
from training.outer.module_state import Layout, ModelMismatch
from training.outer.params import RunParams
from training.outer.spec import (
    LevelRefused,
    RunSpec,
    check_level,
    check_model,
    decode_spec,
    encode_spec,
)
from training.outer.state_blob import decode_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on. ",
    "Each worker trains the same model on its own rows and the rounds agree. ",
] * 6
SEQ_LEN = 32
# Bounds that only stop a hang: two processes import torch and transformers on 2 vCPUs.
WORKER_TIMEOUT = 240


def _blob(store: Path, key: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key), *args],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=WORKER_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _worker(plan: Any, i: int, spec: str, bootstrap: list[str]) -> subprocess.Popen[bytes]:
    w = plan.workers[i]
    argv = [
        sys.executable,
        "-m",
        "p2p.cli",
        "--store",
        str(w.store),
        "--key",
        str(w.key),
        "outer",
        "worker",
        "--spec",
        spec,
        "--rounds",
        "2",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--cert",
        str(w.cert),
        "--result",
        str(w.result),
        "--addr-file",
        str(w.addr_file),
    ]
    for addr in bootstrap:
        argv += ["--bootstrap", addr]
    return subprocess.Popen(argv, env=worker_env(), stdout=sys.stderr)


@pytest.mark.timeout(300)  # worker processes that each import torch: 40-70 s seen at load 7
def test_hf_directory_init_two_cli_workers_export_equals_the_tip(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from training.hf_model import build_model_dir

    model_dir = tmp_path / "gpt2"
    build_model_dir("gpt2", model_dir, CORPUS, seed=3)
    assert len(list(model_dir.glob("model-*-of-*.safetensors"))) >= 2  # sharded
    # Keys and certificates for two workers (the launcher's; its tiny S_0 goes unused).
    plan = prepare_run(tmp_path / "run", RunParams("own", workers=2, rounds=2, inner_steps=2))
    w0 = plan.workers[0]
    base = Store.open(w0.store).put_dir(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(CORPUS))
    records = json.loads(
        _blob(
            w0.store,
            w0.key,
            "train",
            "records",
            str(corpus),
            "--seq-len",
            str(SEQ_LEN),
            "--base",
            base,
            "--json",
        )
    )["id"]
    spec = _blob(
        w0.store,
        w0.key,
        "outer",
        "init",
        "--model",
        str(model_dir),
        "--run",
        "own",
        "--authority",
        plan.authority,
        "--workers",
        "2",
        "--inner-steps",
        "3",
        "--batch",
        "4",
        "--deadline",
        "6",
        "--proposer-timeout",
        "1",
        "--data",
        records,
        "--min-verification",
        "replayed",
        "--replay-rate",
        "1",
    )
    signed = decode_spec(Store.open(w0.store).path(spec).read_bytes())
    assert signed.spec.base == base and signed.spec.data == records

    procs = [_worker(plan, 0, spec, [])]
    try:
        addrs = wait_for_addrs(w0.addr_file, procs[0], timeout=WORKER_TIMEOUT)[:1]
        procs.append(_worker(plan, 1, spec, addrs))
        for proc in procs:
            assert proc.wait(timeout=WORKER_TIMEOUT) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = [json.loads(w.result.read_text()) for w in plan.workers[:2]]
    assert results[0]["final_root"] == results[1]["final_root"]
    assert results[0]["final_round"] == 2
    included = [len(r["included"]) for r in results[0]["rounds"]]
    assert included == [2, 2]
    # Replayed level with rate 1: every included update was recomputed, and matched.
    outcomes = {v["outcome"] for r in results for v in r["verdicts"]}
    assert outcomes == {"match"}, results[0]["verdicts"]

    out = tmp_path / "exported"
    _blob(w0.store, w0.key, "outer", "export", spec, "-o", str(out))
    tip_blob = results[0]["rounds"][-1]["state_blob"]
    tip = decode_state(Store.open(w0.store).path(tip_blob).read_bytes())
    model = AutoModelForCausalLM.from_pretrained(out)
    got = {n: p.detach().numpy() for n, p in model.named_parameters()}
    assert set(got) == set(tip.params)
    for name, value in tip.params.items():
        assert np.array_equal(got[name], value), name
    assert (out / "tokenizer.json").exists()
    levels = json.loads(_blob(w0.store, w0.key, "outer", "levels", spec, "--json"))
    assert {e["level"] for r in levels["rounds"].values() for e in r} == {"replayed"}
    start = decode_state(Store.open(w0.store).path(signed.spec.initial).read_bytes())
    assert any(not np.array_equal(start.params[n], tip.params[n]) for n in tip.params)
    # The worker that joined by the spec's ID keeps its files inside its store (the base it
    # unpacked), not beside it, and answers to the run's ID as the maker's store does.
    w1 = plan.workers[1]
    assert list((w1.store / "outer").glob("base-*"))
    assert not list(w1.store.parent.glob(".outer-base-*"))
    joined = json.loads(_blob(w1.store, w1.key, "outer", "levels", "own", "--json"))
    assert joined["rounds"] == levels["rounds"]


def _spec(**kw: Any) -> RunSpec:
    fields: dict[str, Any] = {
        "run": "r",
        "initial": "a" * 64,
        "root": "b" * 64,
        "tensors": (("w", (2, 3)), ("b", (3,))),
        "inner_steps": 4,
        "workers": 2,
        "authorities": ("c" * 64,),
    }
    return RunSpec(**{**fields, **kw})


def test_spec_round_trips_and_a_changed_byte_is_refused() -> None:
    from identity import MachineKey, SoftwareSigner
    from training.outer.spec import BadSpec

    signer = SoftwareSigner(MachineKey.generate())
    data = encode_spec(_spec(level="scored"), signer)
    assert decode_spec(data).spec == _spec(level="scored")
    i = data.index(b"scored")
    with pytest.raises(BadSpec, match="signature"):
        decode_spec(data[:i] + b"S" + data[i + 1 :])


def test_a_spec_that_requires_hardware_is_version_2_and_others_keep_their_bytes(
    tmp_path: Path,
) -> None:
    """``outer init --require-hardware`` makes a version 2 body naming it; a spec without
    it is spelled as before (version 1, no such key: existing spec IDs stand), and a
    version 2 body saying false, a second spelling of a version 1 spec, is refused."""
    import msgpack
    from safetensors.numpy import save_file

    from blobstore.canonical import encode as encode_canonical
    from identity import MachineKey, SoftwareSigner
    from training.outer.cli import outer_group
    from training.outer.spec import SPEC_DOMAIN, BadSpec

    signer = SoftwareSigner(MachineKey.generate())
    plain = encode_canonical(_spec().body())
    assert msgpack.unpackb(plain)["v"] == 1 and b"require_hardware" not in plain
    data = encode_spec(_spec(require_hardware=True), signer)
    assert decode_spec(data).spec.require_hardware
    body = {**_spec().body(), "v": 2, "require_hardware": False}
    raw = encode_canonical(body)
    envelope = {"v": 1, "body": raw, "key": signer.public_key_bytes,
                "sig": signer.sign(SPEC_DOMAIN + raw)}  # fmt: skip
    with pytest.raises(BadSpec, match="canonical"):
        decode_spec(encode_canonical(envelope))

    save_file({"w": np.zeros((2, 3), np.float32)}, str(tmp_path / "w.safetensors"))
    argv = ["init", "--model", str(tmp_path / "w.safetensors"), "--run", "hw", "--authority",
            "c" * 64, "--workers", "2", "--require-hardware", "--json"]  # fmt: skip
    obj = {"store_root": tmp_path / "store", "key_path": tmp_path / "k.key"}
    result = CliRunner().invoke(outer_group, argv, obj=obj)
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)
    assert made["require_hardware"] is True and made["v"] == 2


def test_a_mismatched_model_and_a_weaker_level_are_refused_in_one_line() -> None:
    spec = _spec(level="replayed")
    check_model(spec, Layout({"w": (2, 3), "b": (3,)}))
    with pytest.raises(ModelMismatch, match=r"parameter 'w' has shape \(3, 2\)") as exc:
        check_model(spec, Layout({"w": (3, 2), "b": (3,)}))
    assert "\n" not in str(exc.value)
    with pytest.raises(ModelMismatch, match="has no parameter 'b'"):
        check_model(spec, Layout({"w": (2, 3)}))
    with pytest.raises(ModelMismatch, match="'x' is not in the spec"):
        check_model(spec, Layout({"w": (2, 3), "b": (3,), "x": (1,)}))
    check_level(spec, "replayed")
    with pytest.raises(LevelRefused, match="requires verification level 'replayed'"):
        check_level(spec, "scored")


def test_a_commitment_names_its_level_and_a_replayable_one_is_unchanged() -> None:
    """A replayable update's commitment bytes carry no level field (they are what they
    were before levels existed); a bounded one names its level and round-trips."""
    import dataclasses

    from training.outer.replay import UpdateCommitment, decode_commitment

    c = UpdateCommitment(
        "r",
        0,
        "a" * 64,
        "peer",
        0,
        1,
        1,
        b"\0" * 4,
        b"\0" * 4,
        4096,
        80,
        "b" * 64,
        "c" * 64,
        "d" * 64,
    )
    assert b"level" not in c.encode()
    bounded = dataclasses.replace(c, level="bounded")
    assert decode_commitment(bounded.encode()).level == "bounded"


def test_cli_init_refuses_a_missing_model(tmp_path: Path) -> None:
    from blobstore.errors import PathNotFound
    from training.outer.cli import outer_group

    result = CliRunner().invoke(
        outer_group,
        [
            "init",
            "--model",
            str(tmp_path / "nope"),
            "--run",
            "r",
            "--authority",
            "c" * 64,
            "--workers",
            "1",
        ],
        obj={"store_root": tmp_path / "store", "key_path": tmp_path / "k.key"},
    )
    # A missing file: blob's line and exit 3 (README), not click's "Error:" and 1.
    assert isinstance(result.exception, PathNotFound), result.output
    assert result.exception.exit_code == 3 and "no such directory" in str(result.exception)


def test_a_spec_envelope_in_another_spelling_is_refused() -> None:
    """One spec, one blob ID: the signed envelope is canonical like its body, so the same
    signed spec re-encoded (keys in another order) is refused."""
    import msgpack

    from identity import MachineKey, SoftwareSigner
    from training.outer.spec import BadSpec, RunSpec, decode_spec, encode_spec

    spec = RunSpec(
        run="r", initial="00" * 32, root="00" * 32, tensors=(("w", (2, 2)),),
        inner_steps=2, workers=2, authorities=("aa" * 32,),
    )  # fmt: skip
    data = encode_spec(spec, SoftwareSigner(MachineKey.generate()))
    assert decode_spec(data).spec == spec
    outer = msgpack.unpackb(data, raw=False)
    reordered = msgpack.packb(dict(reversed(list(outer.items()))), use_bin_type=True)
    with pytest.raises(BadSpec, match="canonical"):
        decode_spec(reordered)
