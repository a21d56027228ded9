"""``blob outer init`` as a user meets it twice: a run ID already made is refused unless
replaced, and what a spec names stays through ``blob gc`` (its start state, fixed tensors
and the spec itself), so ``outer export`` and ``outer verify`` by spec ID still work."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from blobstore import Store
from tests.blob_cli import blob_here
from tests.training.stranger import StrangerNet
from training.outer.cli import outer_group
from training.outer.module_state import save_state


def _init(obj: dict[str, Path], state: Path, *extra: str) -> tuple[int, str]:
    """``blob outer init`` through the program's main (its one-line errors and codes)."""
    argv = ["--store", str(obj["store_root"]), "--key", str(obj["key_path"]), "outer", "init",
            "--state", str(state), "--run", "mine", "--authority", "c" * 64, "--workers", "2",
            *extra]  # fmt: skip
    made = blob_here(argv)
    return made.returncode, made.stdout.strip() or made.stderr.strip()


def test_a_second_init_of_a_run_id_is_refused_unless_replaced(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_state(StrangerNet(), tmp_path / "state.safetensors")
    obj = {"store_root": tmp_path / "store", "key_path": tmp_path / "k.key"}
    code, first = _init(obj, tmp_path / "state.safetensors")
    assert code == 0, first
    spec = first
    code, again = _init(obj, tmp_path / "state.safetensors", "--rounds", "5")
    assert code == 2 and "already has run 'mine'" in again and "--replace" in again, again
    store = Store.open(tmp_path / "store")
    assert store.tags()["outer-mine-spec"] == spec  # untouched
    code, replaced = _init(obj, tmp_path / "state.safetensors", "--rounds", "5", "--replace")
    assert code == 0, replaced
    assert store.tags()["outer-mine-spec"] == replaced != spec


def test_what_a_spec_names_stays_through_gc(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = StrangerNet()
    save_state(model, tmp_path / "state.safetensors")
    obj = {"store_root": tmp_path / "store", "key_path": tmp_path / "k.key"}
    code, out = _init(obj, tmp_path / "state.safetensors")
    assert code == 0, out
    spec = out
    gc = blob_here(["--store", str(tmp_path / "store"), "gc", "--grace", "0"])
    assert gc.returncode == 0, gc
    exported = CliRunner().invoke(outer_group, ["export", spec, "-o", str(tmp_path / "x")], obj=obj)
    assert exported.exit_code == 0, exported.output
    back = StrangerNet()
    back.load_state_dict(load_file(str(tmp_path / "x" / "model.safetensors")), strict=True)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in model.state_dict().items())
