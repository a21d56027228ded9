"""`blob train` end to end in separate processes: two processes reach the same digest, a
third replays it and attests, and the evidence check accepts two operators.

The commands that train run in processes of their own; the local ones that only read and
write files and stores (``resolve``, ``check``, ``records``, ``recipe``, and a refusal
found before anything is loaded) run in this process through ``blob``'s ``main``: a
subprocess would pay another interpreter start for the same answer. The training
processes start before their command lines are known, importing torch, transformers and
peft while the inputs are made, then run the command line they read (``_WARM``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blobstore import Store
from identity import Authority, MachineKey, SoftwareSigner, create_key_file, format_public_key
from tests.blob_cli import blob_here, go, start_warm
from training.records import decode_records, make_records
from training.rounds.recipe import Recipe

TIMEOUT = 110


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("BLOBNET_PASSPHRASE", None)
    return env


def _blob(store: Path, key: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key), *args]


def _warm() -> subprocess.Popen[str]:
    return start_warm(_env())


def _go(proc: subprocess.Popen[str], store: Path, key: Path, *args: str) -> None:
    go(proc, _blob(store, key, *args)[3:])


def _here(store: Path, key: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    """``blob ARGS`` through its ``main`` in this process, exit status asserted."""
    return blob_here(_blob(store, key, *args)[3:], code)


def test_no_cuda_and_no_device_cpu_refuses(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal without CUDA")
    recipe = tmp_path / "r.msgpack"
    recipe.write_bytes(Recipe().encode())
    args = ["--base", "0" * 64, "--records", "1" * 64, "--recipe", str(recipe), "--seed", "1"]
    proc = _here(tmp_path / "s", tmp_path / "k", "train", "run", *args, code=2)
    assert "CUDA is not available" in proc.stderr and "--device cpu" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "s").exists()  # refused before the store was opened


def test_a_run_without_a_certificate_says_check_will_reject_it(tmp_path: Path) -> None:
    """`train run` without --cert made a round that `train check` always rejects, and said
    nothing: it warns first (here the inputs are then not found, exit 3)."""
    pytest.importorskip("torch")
    recipe = tmp_path / "r.msgpack"
    recipe.write_bytes(Recipe().encode())
    args = ["--base", "0" * 64, "--records", "1" * 64, "--recipe", str(recipe), "--seed", "1"]
    run = ("train", "run", *args, "--device", "cpu")
    proc = _here(tmp_path / "s", tmp_path / "k", *run, code=3)
    assert "no --cert" in proc.stderr and "train check` will reject it" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)  # three processes that each import torch + peft (5-20 s)
def test_two_processes_same_digest_replay_and_check(tmp_path: Path) -> None:
    # The two runs and the replay start first: their imports overlap the inputs' making.
    procs = [_warm() for _ in range(3)]
    try:
        _two_processes_same_digest_replay_and_check(tmp_path, procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)


def _two_processes_same_digest_replay_and_check(
    tmp_path: Path, warm: list[subprocess.Popen[str]]
) -> None:
    from training import determinism, kernel_class
    from training.model import make_tiny_llama, save_base_model

    determinism.enter("cpu", threads=1)
    kc = kernel_class.detect("cpu").id  # what the subprocesses will detect too

    keys = tmp_path / "keys"
    alice_key, bob_key = keys / "alice.key", keys / "bob.key"
    alice, bob = create_key_file(alice_key), create_key_file(bob_key)
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    for name, key in (("alice", alice), ("bob", bob)):
        cert = authority.admit(
            key.peer_id,
            operator=name,
            kernel_class=kc,
            not_before=0,
            not_after=2**40,
            serial=len(name),
        )
        (tmp_path / f"{name}.cert").write_bytes(cert.encode())

    # Inputs are made in this process (the commands that make them are tested below in
    # test_input_commands); the rounds themselves run in separate processes.
    store_a = tmp_path / "a"
    store = Store.open(store_a)
    save_base_model(make_tiny_llama("tiny", seed=3), tmp_path / "base")
    base = store.put_dir(tmp_path / "base")
    records = store.put_bytes(make_records([b"a small corpus for a round. " * 20], 32))
    recipe = tmp_path / "recipe.msgpack"
    recipe.write_bytes(Recipe(steps=3, batch_size=4, seq_len=32).encode())
    store_b = tmp_path / "b"
    shutil.copytree(store_a, store_b)

    run_args = [
        "train",
        "run",
        "--base",
        base,
        "--records",
        records,
        "--recipe",
        str(recipe),
        "--seed",
        "9",
        "--device",
        "cpu",
        "--json",
        "--cert",
        str(tmp_path / "alice.cert"),
        "--publish",
        "run-x/adapter",
    ]
    procs = warm[:2]
    for proc, store in zip(procs, (store_a, store_b), strict=True):
        _go(proc, store, alice_key, *run_args)
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    results = [json.loads(out) for out, _ in outs]
    # Progress shows each step's loss as a number; its exact bits are in the JSON.
    assert re.search(r"^step 0: loss \d+\.\d{4}$", outs[0][1], re.M), outs[0][1][-500:]
    digests = {r["commitment"]["digest"] for r in results}
    assert len(digests) == 1, "two processes reached different digests"
    assert results[0]["commitment"]["kernel_class_id"] == kc
    round_id = results[0]["round"]
    # --publish named the adapter in the runner's store: a name resolves to it there.
    adapter = results[0]["commitment"]["adapter"]
    assert results[0]["name"]["id"] == adapter
    ref = f"{alice.peer_id}/run-x/adapter"
    assert json.loads(_here(store_a, alice_key, "resolve", ref, "--json").stdout)["id"] == adapter

    attestation = tmp_path / "bob.att"
    replay = ("train", "replay", round_id, "--cert", str(tmp_path / "bob.cert"))
    _go(warm[2], store_a, bob_key, *replay, "-o", str(attestation), "--json", "-q")
    out, err = warm[2].communicate(timeout=TIMEOUT)
    assert warm[2].returncode == 0, err[-2000:]
    assert json.loads(out)["digest"] in digests

    pub = format_public_key(authority.public_key_bytes)
    check = ("train", "check", round_id, str(attestation), "--authority")
    verdict = json.loads(_here(store_a, bob_key, *check, pub, "--json").stdout)
    assert verdict["accepted"] is True
    assert verdict["operators"] == ["alice", "bob"]

    stranger = format_public_key(Authority(SoftwareSigner(MachineKey.generate())).public_key_bytes)
    out = _here(store_a, bob_key, *check, stranger, code=1).stdout
    assert "unknown authority" in out


@pytest.mark.slow
def test_input_commands(tmp_path: Path) -> None:
    """init-model, records and recipe put canonical inputs in the store."""
    store, key = tmp_path / "s", tmp_path / "k"
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello records")
    records = ("train", "records", str(text), "--seq-len", "8", "--tag", "corpus")
    out = json.loads(_here(store, key, *records, "--json").stdout)
    assert Store.open(store).resolve("corpus") == out["id"]  # --tag names (and pins) it
    data = Store.open(store).path(out["id"]).read_bytes()
    assert data == make_records([b"hello records"], 8)
    assert decode_records(data).count == out["records"] == 2
    recipe = tmp_path / "r.msgpack"
    _here(store, key, "train", "recipe", "-o", str(recipe), "--steps", "7", "--lr", "0.002")
    assert Recipe.decode(recipe.read_bytes()) == Recipe(steps=7, lr=0.002)
    # init-model in this process too (click's runner): a subprocess would pay
    # transformers' import (5-15 s) once more for a command that only builds a model.
    from click.testing import CliRunner

    from training.rounds.cli import train_group

    obj = {"store_root": store, "key_path": key}
    runs = [
        CliRunner().invoke(train_group, ["init-model", "--seed", "4", "--tag", tag], obj=obj)
        for tag in ("base", "base-again")
    ]
    assert [r.exit_code for r in runs] == [0, 0], runs[0].output
    first = runs[0].output.strip()
    assert Store.open(store).resolve("base") == first
    assert runs[1].output.strip() == first  # the same model, the same collection ID
    entries = {e.path for e in Store.open(store).read_collection(first)}
    assert entries == {"config.json", "model.safetensors"}


def test_an_output_in_a_missing_directory_is_one_line_before_any_work(tmp_path: Path) -> None:
    """`recipe -o` and `replay -o` into a directory that does not exist: the error that
    blob prints in one line (exit 5 / 3), not an OSError traceback, and `replay` says so
    before it fetches or trains anything."""
    from click.testing import CliRunner

    from blobstore.errors import PathNotFound
    from identity import KeyFileIOError, MachineKey
    from training.rounds.cli import train_group

    obj = {"store_root": tmp_path / "s", "key_path": tmp_path / "k"}
    missing = tmp_path / "no" / "such"
    recipe = CliRunner().invoke(train_group, ["recipe", "-o", str(missing)], obj=obj)
    assert isinstance(recipe.exception, KeyFileIOError), recipe.exception
    assert "directory" in str(recipe.exception) and recipe.exception.exit_code == 5
    peer = f"/ip4/127.0.0.1/tcp/9/p2p/{MachineKey.generate().peer_id}"
    replay = CliRunner().invoke(
        train_group, ["replay", "0" * 64, "--peer", peer, "-o", str(missing)], obj=obj
    )
    assert isinstance(replay.exception, PathNotFound), replay.exception
    assert not (tmp_path / "s").exists()  # refused before the store was even opened
