"""`blob get -o PATH` where PATH exists, or names a directory: what the user asked for, and
no claim that was not checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.blob_cli import blob_here
from tests.p2p.conftest import Cluster, random_file


@pytest.mark.integration
def test_o_onto_a_copy_of_the_blob_succeeds_even_from_a_fresh_store(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`cp model.safetensors same.bin; blob get ID --peer M -o same.bin` from a fresh store
    said "same.bin already exists and does not hold ID" (exit 5) without comparing. The
    bytes are compared (size, then each chunk's hash against the manifest): a copy is
    kept as it is, and only a file holding other bytes is refused, saying so."""
    model = random_file(tmp_path / "model.safetensors", 3 << 20, seed=7)
    blob_id = cluster.put_here("seed", model)
    seed = cluster.serve("seed")

    same = tmp_path / "same.bin"
    shutil.copyfile(model, same)
    inode = same.stat().st_ino
    other = random_file(tmp_path / "other.bin", 3 << 20, seed=8)  # the same size
    other_bytes = other.read_bytes()
    # In this process (a node of the fetch's own): no interpreter start per get.
    said = {
        name: blob_here(
            [*_where(cluster, name), "get", blob_id, "--peer", seed.addr, "-o", str(out)]
        )
        for name, out in (("a", same), ("b", other))
    }

    assert said["a"].returncode == 0, said["a"].stderr
    assert same.stat().st_ino == inode and same.read_bytes() == model.read_bytes()
    assert said["b"].returncode == 5, said["b"].stderr
    (line,) = said["b"].stderr.strip().splitlines()
    assert "holds other bytes" in line and "--force" in line, line
    assert other.read_bytes() == other_bytes


def test_a_trailing_slash_is_a_directory_for_a_one_file_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`blob get NAME -o adapter/` (the README's example) wrote a file named `adapter`: a
    trailing slash names a directory, which the blob goes into under its tag, the last
    part of its published name, or its ID. A collection is that directory itself."""
    store, key = tmp_path / "store", tmp_path / "k.key"
    (tmp_path / "w.bin").write_bytes(b"adapter weights")
    base = ["--store", str(store), "--key", str(key)]
    blob_id = _put(base, tmp_path / "w.bin")
    blob_here([*base, "tag", "lora-7", blob_id])
    monkeypatch.chdir(tmp_path)

    done = blob_here([*base, "get", "lora-7", "-o", "adapter/"])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "adapter" / "lora-7").read_bytes() == b"adapter weights"
    assert done.stdout.split() == [blob_id, "adapter/lora-7"]
    done = blob_here([*base, "get", blob_id, "-o", "adapter/"])
    assert (tmp_path / "adapter" / blob_id).read_bytes() == b"adapter weights"

    from blobstore import Store
    from p2p.cli.get import _target

    named = _target(Store.open(store), blob_id, f"{_peer(base)}/run-x/adapter", Path("a"), True)
    assert named == Path("a/adapter")

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    coll = _put(base, tmp_path / "model")
    done = blob_here([*base, "get", coll, "-o", "llama/"])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "llama" / "config.json").read_text() == "{}"

    (tmp_path / "notes").write_text("notes")  # a file where the directory would go
    done = blob_here([*base, "get", blob_id, "-o", "notes/"])
    assert done.returncode == 5 and "notes" in done.stderr, done.stderr
    assert (tmp_path / "notes").read_text() == "notes"


def _peer(base: list[str]) -> str:
    return str(json.loads(blob_here([*base, "id", "--json"]).stdout)["peer_id"])


def _put(base: list[str], path: Path) -> str:
    return str(json.loads(blob_here([*base, "put", str(path), "--json"]).stdout)[0]["id"])


def _where(cluster: Cluster, name: str) -> list[str]:
    return ["--store", str(cluster.store(name)), "--key", str(cluster.key(name))]
