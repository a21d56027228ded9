"""``blob export`` makes links into the store; ``blob gc`` must not leave them dangling.

Unpinned, an export of an untagged collection is undone by the next ``gc --grace 0``: its
links point at files gc deleted. So an export pins what it links with a tag (named
in its output; ``blob untag`` removes it with the export), ``gc --dry-run`` lists what
would go without removing it, and an export of a collection fetched in part exports the
files that are here (naming the others) instead of failing on a file nobody asked for."""

from __future__ import annotations

import json
from pathlib import Path

from tests.p2p.conftest import blob_here


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model-00001-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 5000)
    return model


def _put(store: Path, key: Path, path: Path) -> tuple[str, dict[str, str]]:
    """The collection's ID and its files' IDs by name."""
    done = blob_here(store, key, "put", str(path), "--json")
    assert done.returncode == 0, done.stderr
    coll = json.loads(done.stdout)[0]["id"]
    files = {}
    for name in ("config.json", "model-00001-of-00002.safetensors"):
        done = blob_here(store, key, "put", str(path / name), "--json")
        files[name] = json.loads(done.stdout)[0]["id"]
    return coll, files


def test_gc_leaves_an_untagged_collections_export_whole(tmp_path: Path) -> None:
    store, key = tmp_path / "store", tmp_path / "key"
    coll, _files = _put(store, key, _model(tmp_path))
    out = tmp_path / "llama-dir"
    done = blob_here(store, key, "export", coll, str(out))
    assert done.returncode == 0, done.stderr
    assert "pinned by tag" in done.stderr

    dry = blob_here(store, key, "gc", "--grace", "0", "--dry-run", "--json")
    assert json.loads(dry.stdout) == {"would_remove": []}
    assert blob_here(store, key, "gc", "--grace", "0").returncode == 0
    for link in out.iterdir():
        assert link.resolve().exists(), f"{link.name} dangles after gc"
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'


def test_gc_dry_run_lists_without_removing(tmp_path: Path) -> None:
    store, key = tmp_path / "store", tmp_path / "key"
    (tmp_path / "loose.bin").write_bytes(b"nobody pins me")
    blob_id = json.loads(
        blob_here(store, key, "put", str(tmp_path / "loose.bin"), "--json").stdout
    )[0]["id"]
    dry = blob_here(store, key, "gc", "--grace", "0", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.split() == ["would", "remove", blob_id]
    assert blob_here(store, key, "stat", blob_id).returncode == 0  # still here
    assert blob_here(store, key, "gc", "--grace", "0").stdout.split() == ["removed", blob_id]


def test_export_of_a_collection_held_in_part_exports_what_is_here(tmp_path: Path) -> None:
    store, key = tmp_path / "store", tmp_path / "key"
    coll, files = _put(store, key, _model(tmp_path))
    # As after `get COLL --include 'model-*'`: config.json never arrived.
    assert blob_here(store, key, "rm", files["config.json"]).returncode == 0
    out = tmp_path / "llama-dir"
    done = blob_here(store, key, "export", coll, str(out), "--tag", "llama")
    assert done.returncode == 0, done.stderr
    assert "config.json" in done.stderr  # named as left out
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    wanted = blob_here(store, key, "export", coll, str(tmp_path / "cfg"), "--include", "*.json")
    assert wanted.returncode == 3
    assert "config.json" in wanted.stderr and "no complete blob" not in wanted.stderr


def test_gc_leaves_get_links_whole(tmp_path: Path) -> None:
    """`get -o DIR --link` without --tag made the same dangling links after gc."""
    store, key = tmp_path / "store", tmp_path / "key"
    coll, _files = _put(store, key, _model(tmp_path))
    out = tmp_path / "linked"
    done = blob_here(store, key, "get", coll, "-o", str(out), "--link")
    assert done.returncode == 0, done.stderr
    assert blob_here(store, key, "gc", "--grace", "0").returncode == 0
    assert all(link.resolve().exists() for link in out.iterdir())
