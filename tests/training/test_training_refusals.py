"""Mistakes a user makes are refused before any training, in one line with the README's
exit code: a certificate for another kernel class, a LoRA target the model lacks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from blobstore import Store  # noqa: E402
from identity import Authority, MachineKey, SoftwareSigner, create_key_file  # noqa: E402
from training.model import make_tiny_llama, save_base_model  # noqa: E402
from training.records import make_records  # noqa: E402
from training.rounds.recipe import Recipe  # noqa: E402

RECIPE = Recipe(steps=200, batch_size=4, seq_len=16)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    tmp = tmp_path_factory.mktemp("refusals")
    store = Store.open(tmp / "store")
    save_base_model(make_tiny_llama("tiny", seed=0), tmp / "base")
    base = store.put_dir(tmp / "base")
    records = store.put_bytes(make_records([b"a corpus of a few words. " * 8], RECIPE.seq_len))
    return tmp, base, records


def _run_args(base: str, records: str, recipe: Path, *extra: str) -> list[str]:
    return [
        "train",
        "run",
        "--base",
        base,
        "--records",
        records,
        "--recipe",
        str(recipe),
        "--seed",
        "1",
        "--device",
        "cpu",
        *extra,
    ]


def test_certificate_for_one_thread_refused_before_training_at_two(
    inputs: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe asks for 200 steps; the refusal comes before step 0, in one line. (In
    this process: the run sets torch's thread count to 2 before it refuses, and the test
    puts it back.)"""
    from p2p.cli.app import main
    from training import determinism, kernel_class

    tmp, base, records = inputs
    determinism.enter("cpu", threads=1)
    one_thread = kernel_class.detect("cpu").id
    key_path = tmp / "machine.key"
    key = create_key_file(key_path)
    cert = Authority(SoftwareSigner(MachineKey.generate())).admit(
        key.peer_id,
        operator="alice",
        kernel_class=one_thread,
        not_before=0,
        not_after=2**40,
        serial=1,
    )
    (tmp / "one.cert").write_bytes(cert.encode())
    recipe = tmp / "recipe.msgpack"
    recipe.write_bytes(RECIPE.encode())
    args = _run_args(base, records, recipe, "--threads", "2", "--cert", str(tmp / "one.cert"))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", str(tmp / "store"), "--key", str(key_path), *args])
    finally:
        torch.set_num_threads(threads)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"admits kernel class {one_thread}" in lines[0] and "--threads" in lines[0]
    assert not any("step" in line for line in lines)  # no progress line: nothing trained


def test_unknown_target_module_is_one_line_before_training(
    inputs: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from p2p.cli.app import main

    tmp, base, records = inputs
    recipe = tmp / "bad-target.msgpack"
    recipe.write_bytes(Recipe(steps=200, batch_size=4, seq_len=16, target_modules=("qq",)).encode())
    args = ["--store", str(tmp / "store"), "--key", str(tmp / "k2.key")]
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main([*args, *_run_args(base, records, recipe)])
    assert exit_info.value.code == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("blob: error: recipe target module 'qq' is not in the base model")
    assert "q_proj" in err[-1]  # it names the layers the model has
    assert not any(line.startswith("step ") for line in err)
    assert time.monotonic() - started < 60  # 200 steps would take minutes


def _flip_byte(store: Store, blob_id: str, offset: int) -> None:
    path = store.path(blob_id)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def _copy_store(inputs: tuple[Path, str, str], dest: Path) -> Store:
    import shutil

    shutil.copytree(inputs[0] / "store", dest)
    return Store.open(dest)


def test_corrupt_local_records_are_named_not_blamed_on_the_round(
    inputs: tuple[Path, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One flipped byte in the replayer's records must not surface as "replay differs first
    at step 22": the run stops before training, naming the local blob, exit 4."""
    from p2p.cli.app import main

    _, base, records = inputs
    store = _copy_store(inputs, tmp_path / "store")
    _flip_byte(store, records, 40)
    recipe = tmp_path / "recipe.msgpack"
    recipe.write_bytes(RECIPE.encode())
    create_key_file(tmp_path / "k.key")
    args = ["--store", str(tmp_path / "store"), "--key", str(tmp_path / "k.key")]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, *_run_args(base, records, recipe)])
    assert exit_info.value.code == 4
    # One line besides the warning that a round run without --cert will not pass a check.
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "warning: no --cert" not in x]
    assert len(err) == 1, err
    assert f"local blob {records} (records) is corrupt" in err[0]


def test_corrupt_base_file_and_round_record_are_named(
    inputs: tuple[Path, str, str], tmp_path: Path
) -> None:
    from training.errors import CorruptInput
    from training.rounds.round import RoundInputs, execute, load_record

    _, base, records = inputs
    store = _copy_store(inputs, tmp_path / "store")
    weights = next(e for e in store.read_collection(base) if e.path == "model.safetensors")
    _flip_byte(store, weights.blob_id, 1000)
    with pytest.raises(CorruptInput, match=r"base model file model\.safetensors"):
        execute(store, RoundInputs(base, records, RECIPE, 1), device="cpu")
    record_id = store.put_bytes(b"\x84" + b"x" * 100)  # any blob: corrupt before decoding
    _flip_byte(store, record_id, 5)
    with pytest.raises(CorruptInput, match=f"local blob {record_id} \\(round record\\)"):
        load_record(store, record_id)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_check_refuses_at_once_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.rounds import gpu_check

    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0]
    assert not (tmp_path / "out").exists()  # nothing built, nothing written
