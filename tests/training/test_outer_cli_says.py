"""What `blob outer export` and `blob outer levels` tell the user about a run's rounds,
through the blob program's own boundary, in this process (nothing trains)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from blobstore import Store
from tests.blob_cli import blob_here


def test_export_says_which_rounds_updates_the_state_holds(tmp_path: Path) -> None:
    """`outer export` of a 2-round run said "round 2 state", while `--round 0` is the
    initial state: which rounds' updates a state holds is said outright."""
    save_file({"w": np.zeros((2, 3), np.float32)}, str(tmp_path / "w.safetensors"))
    base = ["--store", str(tmp_path / "store"), "--key", str(tmp_path / "k.key")]
    init = ["outer", "init", "--model", str(tmp_path / "w.safetensors"), "--run", "r2",
            "--authority", "c" * 64, "--workers", "2"]  # fmt: skip
    blob_here([*base, *init], code=0)

    from training.outer.loop import OuterState
    from training.outer.state_blob import encode_state

    store = Store.open(tmp_path / "store")
    params = {"w": np.ones((2, 3), np.float32)}
    after_two = OuterState(2, params, {"w": np.zeros((2, 3), np.float32)})
    store.tag("outer-r2-state-2", store.put_bytes(encode_state(after_two)))  # as a worker tags

    newest = blob_here([*base, "outer", "export", "r2", "-o", str(tmp_path / "tip")], code=0)
    assert "after 2 round(s)" in newest.stderr and "rounds 0 to 1" in newest.stderr
    initial = blob_here(
        [*base, "outer", "export", "r2", "--round", "0", "-o", str(tmp_path / "start")], code=0
    )
    assert "initial state (--round 0)" in initial.stderr, initial.stderr


def test_levels_of_a_run_without_a_spec_says_what_it_would_need(tmp_path: Path) -> None:
    """`outer levels` on an `outer run` (no spec) said only "no run spec": it says why a
    spec is needed, how a run gets one, and what checks a run without."""
    store = Store.open(tmp_path / "store")
    # What an `outer run` worker leaves: the run's evidence tags, and no spec.
    store.tag("outer-local-closure-0", store.put_bytes(b"a closure"))
    base = ["--store", str(tmp_path / "store"), "--key", str(tmp_path / "k.key")]
    done = blob_here([*base, "outer", "levels", "local"], code=2)
    (line,) = done.stderr.strip().splitlines()
    assert "no run spec" in line and "blob outer init" in line and "--spec" in line, line
    assert "blob outer verify local" in line, line
    unknown = blob_here([*base, "outer", "levels", "nothing-here"], code=2)
    assert "no run spec 'nothing-here'" in unknown.stderr, unknown.stderr
