"""The README's own Python example, taken from the README's text and run as written: its
``train.py`` makes the run's initial state, ``blob outer init --state`` makes the spec, one
``blob serve`` holds it, and three ``train.py`` workers (separate processes, own stores and
keys) are given only that node. They find each other through it, train a model with
BatchNorm buffers, a frozen projection and tied layers at the ``bounded`` level, and end on
one root whose whole state (exported from each worker's store) is the same everywhere; each
held-out loss falls; ``blob outer verify`` passes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
ROUNDS = 2
H = 20
# A bound that only stops a hang: three workers import torch on 2 vCPUs beside a serve node.
RUN_TIMEOUT = 300


def readme_script() -> str:
    """The README's ``train.py``: the Python block that starts with its docstring."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    scripts = [b for b in blocks if b.startswith('"""train.py')]
    assert len(scripts) == 1, "the README shows one train.py"
    return scripts[0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_the_readmes_train_py_runs_as_written(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from tests.p2p.conftest import LISTEN, NodeProcess, blob_cmd
    from training.outer.cli import outer_group
    from training.outer.launch import prepare_run, worker_env
    from training.outer.params import RunParams

    script = tmp_path / "train.py"
    script.write_text(readme_script())
    env = worker_env()
    made = subprocess.run(
        [sys.executable, str(script), "--save-state", str(tmp_path / "state.safetensors")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    plan = prepare_run(tmp_path / "run", RunParams("mine", workers=3, rounds=ROUNDS, inner_steps=H))
    maker = {"store_root": tmp_path / "maker", "key_path": tmp_path / "maker.key"}
    argv = ["init", "--state", str(tmp_path / "state.safetensors"), "--run", "mine",
            "--authority", plan.authority, "--workers", "3", "--rounds", str(ROUNDS),
            "--inner-steps", str(H), "--deadline", "6", "--proposer-timeout", "1"]  # fmt: skip
    init = CliRunner().invoke(outer_group, argv, obj=maker)
    assert init.exit_code == 0, init.output
    spec = init.stdout.strip().splitlines()[-1]
    serving = ["--json", "serve", "--listen", LISTEN, "--no-dht"]
    command = blob_cmd(maker["store_root"], maker["key_path"], *serving)
    serve = NodeProcess(command, "maker", tmp_path / "serve.log")
    procs: list[subprocess.Popen[bytes]] = []
    logs = [w.dir / "train.log" for w in plan.workers]
    try:
        for i, w in enumerate(plan.workers):
            argv = [sys.executable, str(script), "--store", str(w.store), "--key", str(w.key),
                    "--cert", str(w.cert), "--spec", spec, "--peer", serve.addr,
                    "--seed", str(i + 1)]  # fmt: skip
            with logs[i].open("wb") as log:  # the child holds its own copy of the descriptor
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env))
        give_up = time.monotonic() + RUN_TIMEOUT
        said = []
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, give_up - time.monotonic()))
            said.append(out.decode().strip().splitlines()[-1] if out.strip() else "")
        tails = [log.read_text(errors="replace")[-1500:] for log in logs]
        assert all(p.returncode == 0 for p in procs), tails
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        serve.stop()
    lines = [
        re.fullmatch(r"round (\d+): root ([0-9a-f]{64}), loss ([\d.]+) -> ([\d.]+)", s)
        for s in said
    ]
    assert all(lines), said
    assert {m.group(1) for m in lines} == {str(ROUNDS)}
    assert len({m.group(2) for m in lines}) == 1, said  # one root
    for m in lines:
        assert float(m.group(4)) < float(m.group(3)), m.group(0)  # the held-out loss falls
    # The whole state each worker holds at the end is the same (its export, from its store).
    exported = []
    for w in plan.workers:
        obj = {"store_root": w.store, "key_path": w.key}
        out = CliRunner().invoke(outer_group, ["export", "mine", "-o", str(w.dir / "out")], obj=obj)
        assert out.exit_code == 0, out.output
        exported.append(load_file(str(w.dir / "out" / "model.safetensors")))
    names = set(exported[0])
    assert {"bn.running_var", "bn.num_batches_tracked", "proj.weight", "down.weight"} <= names
    for other in exported[1:]:
        assert set(other) == names and all(other[n].equal(exported[0][n]) for n in names)
    obj = {"store_root": plan.workers[0].store, "key_path": plan.workers[0].key}
    verified = CliRunner().invoke(
        outer_group, ["verify", "mine", "--authority", plan.authority], obj=obj
    )
    assert verified.exit_code == 0, verified.output
