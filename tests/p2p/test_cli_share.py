"""What an ML user does with `blob`, as real processes over 127.0.0.1: share a model
directory in one step, fetch only some of its files, or one tensor of a shard without the
rest, and load a fetched model straight from links into the store."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from blobstore import Store

from .conftest import READY_TIMEOUT, Cluster, blob_cmd, last_json, run_blob

TENSOR_SHAPE = (512, 512)  # 1 MiB of float32: one default chunk, give or take the header


def make_sharded_model(root: Path) -> Path:
    """Three safetensors shards of four 1 MiB tensors each, their index (which shard holds
    which tensor, as Hugging Face writes it) and a config."""
    rng = np.random.default_rng(0)
    root.mkdir()
    weight_map = {}
    for shard in (1, 2, 3):
        tensors = {
            f"layer{shard}.{name}": rng.standard_normal(TENSOR_SHAPE, dtype=np.float32)
            for name in ("a", "b", "c", "d")
        }
        file = f"model-0000{shard}-of-00003.safetensors"
        save_file(tensors, str(root / file))
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": 12 << 20}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps({"layers": 3}))
    return root


class Sharer:
    """`blob share PATH --json` in its own process; ``info`` is its first line (blob ID,
    ticket, peer ID, addresses)."""

    def __init__(self, cluster: Cluster, name: str, path: Path) -> None:
        cmd = blob_cmd(cluster.store(name), cluster.key(name), "share", str(path), "--json")
        self.log = cluster.root / f"{name}-share.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise AssertionError(f"share did not become ready: {self.log.read_text()[-2000:]}")
        self.info: dict[str, Any] = json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def child_id(store: Path, collection: str, prefix: str) -> str:
    entries = Store.open(store).read_collection(collection)
    return next(e.blob_id for e in entries if e.path.startswith(prefix))


def test_share_then_fetch_two_shards_and_one_tensor(cluster: Cluster, tmp_path: Path) -> None:
    model = make_sharded_model(tmp_path / "model")
    sharer = Sharer(cluster, "a", model)
    try:
        _fetch_parts(cluster, tmp_path, model, sharer.info)
    finally:
        sharer.stop()
    assert sharer.proc.returncode == 0  # Ctrl-C is how sharing ends


def _fetch_parts(cluster: Cluster, tmp_path: Path, model: Path, info: dict[str, Any]) -> None:
    collection = info["id"]
    assert info["ticket"].startswith("blob1")
    assert Store.open(cluster.store("a")).is_collection(collection)

    # Two of three shards, as links into the fetcher's store, pinned by a tag.
    store, key = cluster.store("b"), cluster.key("b")
    out = tmp_path / "part"
    got = last_json(
        run_blob(
            store, key, "get", info["ticket"], "--include", "model-0000[1-2]*.safetensors",
            "-o", str(out), "--link", "--tag", "m12", "--json",
        ).stdout
    )  # fmt: skip
    assert got["id"] == collection and got["tag"] == "m12"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    fetched = Store.open(store)
    for name in names:
        link = out / name
        assert link.is_symlink() and Path(os.readlink(link)).is_relative_to(store.resolve())
        assert link.read_bytes() == (model / name).read_bytes()
    assert not fetched.has(child_id(store, collection, "model-00003"))
    assert not fetched.has(child_id(store, collection, "config.json"))
    assert fetched.resolve("m12") == collection

    # One tensor of the sharded model, named through the collection's ticket: the shard
    # holding it is found from the headers alone, and only its chunks travel.
    shard3 = child_id(store, collection, "model-00003")
    result = last_json(
        run_blob(
            store, key, "get", info["ticket"], "--tensor", "layer3.c",
            "-o", str(tmp_path / "c.npy"), "--json",
        ).stdout
    )  # fmt: skip
    assert result["tensors"]["layer3.c"] == {
        "dtype": "F32", "shape": [512, 512], "bytes": 1 << 20,
        "file": "model-00003-of-00003.safetensors",
    }  # fmt: skip
    assert 0 < result["fetched_chunks"] <= 3  # header and the tensor's two chunks at most
    expected = load_file(str(model / "model-00003-of-00003.safetensors"))["layer3.c"]
    assert np.array_equal(np.load(tmp_path / "c.npy"), expected)
    assert not fetched.has(shard3)  # the rest of the shard never came

    # Into a store holding nothing: the index names the shard, so no other shard's header
    # is fetched (each shard's header was read in turn, first to last).
    empty = cluster.store("c")
    run_blob(empty, cluster.key("c"), "get", info["ticket"], "--tensor", "layer3.c", "--json")
    others = {child_id(store, collection, f"model-0000{k}") for k in (1, 2)}
    assert not others & set(Store.open(empty).partial_ids())


def test_linked_export_loads_with_from_pretrained(cluster: Cluster, tmp_path: Path) -> None:
    """`blob export` makes a directory of symlinks to the store's read-only files, which
    transformers loads as it would the model's own directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    original = transformers.GPT2LMHeadModel(config)
    original.save_pretrained(tmp_path / "tiny")
    store, key = cluster.store("a"), cluster.key("a")
    run_blob(store, key, "put", str(tmp_path / "tiny"), "--tag", "tiny")
    # (`blob get -o DIR --link` makes the same directory after a fetch: tested above.)
    run_blob(store, key, "export", "tiny", str(tmp_path / "linked"))
    run_blob(store, key, "export", "tiny", str(tmp_path / "linked"))  # again: a no-op
    for path in (tmp_path / "linked").iterdir():
        assert path.is_symlink(), path  # nothing copied
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "linked")
    for (name, want), (_, have) in zip(
        original.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(want, have), name
