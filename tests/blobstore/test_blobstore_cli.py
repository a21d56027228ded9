"""The store's commands through the real ``blob`` program, including error paths and
the documented exit codes.

Starting the program costs seconds (it loads the network stack), so most commands run
as a batch inside one subprocess that calls ``p2p.cli.app.main`` once per command, with
fds 1 and 2 redirected per command and ``SystemExit`` turned into the exit status, just
as the interpreter would. ``test_real_process_exit_codes`` checks that the process
boundary itself behaves the same.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blobstore import Manifest, Store

REPO = Path(__file__).resolve().parents[2]
C = 64 * 1024

DRIVER = r"""
import json, os, sys, tempfile, traceback
from p2p.cli.app import main

results = []
for argv in json.load(open(sys.argv[1])):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
    try:
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
    out.seek(0); err.seek(0)
    results.append([code, out.read().hex(), err.read().decode(errors="replace")])
print(json.dumps(results))
"""


class Result:
    def __init__(self, code: int, stdout: bytes, stderr: str) -> None:
        self.code, self.stdout, self.stderr = code, stdout, stderr

    @property
    def text(self) -> str:
        return self.stdout.decode()

    def ok(self) -> str:
        assert self.code == 0, self.stderr
        return self.text

    def error(self, code: int, text: str) -> None:
        assert self.code == code, self.stderr
        assert text in self.stderr
        assert "Traceback" not in self.stderr
        last = self.stderr.strip().splitlines()[-1]
        assert re.match(r"(blob( [a-z-]+)?: error: |Error: )", last), last


def batch(tmp_path: Path, store: Path, *commands: list[str]) -> list[Result]:
    spec = tmp_path / "commands.json"
    spec.write_text(json.dumps([["--store", str(store), *c] for c in commands]))
    (tmp_path / "driver.py").write_text(DRIVER)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(spec)],
        capture_output=True,
        cwd=REPO,
        timeout=110,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    return [Result(c, bytes.fromhex(o), e) for c, o, e in json.loads(proc.stdout)]


@pytest.mark.slow
def test_real_process_exit_codes(tmp_path: Path) -> None:
    """The process boundary: output, exit status 0, one-line error and exit status 3."""
    store = tmp_path / "store"
    src = tmp_path / "f.bin"
    src.write_bytes(b"hello")
    cmd = [sys.executable, "-m", "p2p.cli", "--store", str(store)]
    put = subprocess.run(
        [*cmd, "put", str(src)], capture_output=True, text=True, cwd=REPO, timeout=110
    )
    assert put.returncode == 0, put.stderr
    assert put.stdout == f"{Manifest.of_bytes(b'hello').blob_id}  {src}\n"
    missing = subprocess.run(
        [*cmd, "stat", "0" * 64], capture_output=True, text=True, cwd=REPO, timeout=110
    )
    assert missing.returncode == 3
    assert missing.stderr.strip() == f"blob: error: no blob {'0' * 64} in this store"


@pytest.mark.slow
def test_put_get_cat_stat_ls_tag_rm_and_collections(tmp_path: Path) -> None:
    store = tmp_path / "store"
    data = os.urandom(3 * C + 1)
    src = tmp_path / "weights.bin"
    src.write_bytes(data)
    bid = Manifest.of_bytes(data, C).blob_id
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"a": 1}')
    (model / "sub" / "w.bin").write_bytes(os.urandom(C + 3))
    r = batch(
        tmp_path,
        store,
        ["put", str(src), "--chunk-size", "64KiB", "--tag", "w1"],
        ["put", str(src), "--chunk-size", "64K", "--json"],
        ["cat", bid[:8]],
        ["get", "w1", "-o", str(tmp_path / "copy.bin")],
        ["stat", "w1", "--json"],
        ["ls", "--json"],
        ["ls"],
        ["tag", "w2", bid[:10]],
        ["gc", "--grace", "0", "--json"],
        ["rm", "w1"],
        ["ls", "--json"],
        ["put", str(model), "--chunk-size", "64K", "--json"],
    )
    assert r[0].ok() == f"{bid}  {src}\n"
    assert json.loads(r[1].ok())[0]["id"] == bid
    assert r[2].stdout == data
    assert (tmp_path / "copy.bin").read_bytes() == data
    st = json.loads(r[4].ok())
    assert (st["id"], st["size"], st["chunks"], st["complete"]) == (bid, len(data), 4, True)
    assert st["tags"] == ["w1"]
    assert Path(st["path"]).name == bid  # (removed by the later rm in this batch)
    assert [(x["id"], x["tags"]) for x in json.loads(r[5].ok())] == [(bid, ["w1"])]
    assert bid in r[6].ok()
    r[7].ok()
    assert json.loads(r[8].ok()) == {"removed": []}  # tagged: survives gc with no grace
    assert r[9].ok() == f"removed {bid}\n"
    assert json.loads(r[10].ok()) == []
    cid = json.loads(r[11].ok())[0]["id"]

    r = batch(tmp_path, store, ["stat", cid, "--json"], ["get", cid, "-o", str(tmp_path / "out")])
    assert [e["path"] for e in json.loads(r[0].ok())["collection"]] == ["config.json", "sub/w.bin"]
    r[1].ok()
    assert (tmp_path / "out" / "config.json").read_text() == '{"a": 1}'
    assert (tmp_path / "out" / "sub" / "w.bin").read_bytes() == (
        model / "sub" / "w.bin"
    ).read_bytes()


@pytest.mark.slow
def test_verify_names_the_corrupt_blob_and_error_paths(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store = Store.open(store_dir)
    good = store.put_bytes(os.urandom(2 * C), chunk_size=C)
    bad = store.put_bytes(os.urandom(2 * C), chunk_size=C)
    path = store.path(bad)
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(C + 1)
        f.write(b"\x00\x01\x02")
    # Two IDs sharing a prefix (resolution reads names). The shard may exist already: a
    # random blob's ID starts with "ab" one time in 128 (CI once met it).
    shard = store_dir / "blobs" / "ab"
    shard.mkdir(exist_ok=True)
    for tail in "01":
        (shard / ("abcdef01" + tail * 56)).write_bytes(b"")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    r = batch(
        tmp_path,
        store_dir,
        ["verify", good, bad],
        ["verify", "--json", good, bad],
        ["verify", good[:8]],
        ["cat", bad],
        ["stat", "0" * 64],
        ["cat", "deadbeef"],
        ["get", "no-such-tag", "-o", str(tmp_path / "o")],
        ["put", str(tmp_path / "missing.bin")],
        ["put", str(tmp_path), "--chunk-size", "3K"],
        ["put", str(tmp_path), "--chunk-size", "lots"],
        ["tag", "deadbeef", good],
        ["rm", "0" * 64],
        ["stat", "abcdef01"],
        ["--store", str(foreign), "ls"],
    )
    assert r[0].code == 1
    assert f"CORRUPT  {bad}  chunks 1  (quarantined)" in r[0].text
    assert f"ok       {good}" in r[0].text
    assert bad in r[0].stderr
    assert good not in r[0].stderr
    assert r[1].code == 1
    assert {(x["id"], x["ok"], x["quarantined"]) for x in json.loads(r[1].text)} == {
        (good, True, False),
        (bad, False, True),
    }
    assert r[2].ok().startswith("ok")
    r[3].error(4, "corrupt")
    r[4].error(3, "no blob")
    r[5].error(3, "no blob with ID prefix deadbeef")
    r[6].error(3, "no-such-tag")
    r[7].error(3, "no such file")
    r[8].error(2, "power of two")
    r[9].error(2, "not a size")
    r[10].error(2, "bad tag name")
    r[11].error(3, "no blob")
    r[12].error(3, "matches 2 blobs")
    r[13].error(5, "not a blobnet store")
    assert os.listdir(foreign) == ["thesis.tex"]


HOSTILE_NAME = "weights\x1b[2J\x1b[31m\nrm -rf ~\u202e.bin"


@pytest.mark.slow
def test_peer_supplied_names_hostile_collections_and_json_results(tmp_path: Path) -> None:
    """What a fetched collection can carry: names made to drive the terminal, and paths
    made to escape. Names are escaped in text output and raw in --json; collections are
    shown as a unit; a hostile one is refused with exit 4 and nothing written."""
    from blobstore import CollectionEntry
    from blobstore.collection import encode_collection

    store_dir = tmp_path / "store"
    store = Store.open(store_dir)
    child = store.put_bytes(b"w" * (C + 5), chunk_size=C)
    other = store.put_bytes(b"{}", chunk_size=C)
    entries = [
        CollectionEntry(HOSTILE_NAME, child, C + 5),
        CollectionEntry("config.json", other, 2),
    ]
    cid = store.put_bytes(encode_collection(entries), chunk_size=C)
    import msgpack

    hostile = store.put_bytes(
        msgpack.packb({"collection": 1, "entries": [["../../escape", child, C + 5]]}),
        chunk_size=C,
    )
    rotten = store.put_bytes(os.urandom(2 * C), chunk_size=C)
    path = store.path(rotten)
    path.chmod(0o600)
    with open(path, "r+b") as f:
        f.write(b"rot")
    out = tmp_path / "out"
    r = batch(
        tmp_path,
        store_dir,
        ["stat", cid],
        ["stat", cid, "--json"],
        ["ls"],
        ["ls", "--json"],
        ["stat", hostile],
        ["get", hostile, "-o", str(out)],
        ["tag", "m1", cid, "--json"],
        ["untag", "m1", "--json"],
        ["rm", hostile, "--json"],
        ["verify", rotten],
        ["ls"],
    )
    escaped = "weights\\x1b[2J\\x1b[31m\\x0arm -rf ~\\u202e.bin"
    text = r[0].ok()
    assert "\x1b" not in text and "\u202e" not in text
    assert f"  {child}" in text and text.splitlines()[-1].endswith(escaped)
    assert f"size:     {C + 7} (" in text and "in 2 files" in text  # the files' total
    assert "listing:  " in text  # and the listing blob's own size, apart
    info = json.loads(r[1].ok())
    assert info["collection_size"] == C + 7
    assert {e["path"] for e in info["collection"]} == {HOSTILE_NAME, "config.json"}
    listing = r[2].ok()
    assert "\x1b" not in listing
    lines = listing.splitlines()
    parent = next(i for i, line in enumerate(lines) if line.startswith(cid))
    assert "collection of 2 files" in lines[parent]
    children = lines[parent + 1 : parent + 3]
    assert all(line.startswith("  ") for line in children)  # labelled by place
    assert {line.split()[0] for line in children} == {child, other}
    assert children[1].endswith(escaped) or children[0].endswith(escaped)
    assert not any(line.startswith(child) for line in lines)  # no loose entry
    rows = {row["id"]: row for row in json.loads(r[3].ok())}
    assert rows[child]["parents"] == [{"id": cid, "path": HOSTILE_NAME}]
    assert rows[cid]["collection"] == {"files": 2, "size": C + 7}
    assert "collection: refused" in r[4].ok() and "malformed collection" in r[4].text
    r[5].error(4, "malformed collection")
    assert not out.exists()
    assert json.loads(r[6].ok()) == {"tag": "m1", "id": cid, "previous": None}
    assert json.loads(r[7].ok()) == {"tag": "m1", "id": cid}
    assert json.loads(r[8].ok()) == {"removed": [{"id": hostile, "tags": []}]}
    assert r[9].code == 1 and "quarantined" in r[9].stderr
    assert any(
        line.startswith(rotten) and "quarantined" in line for line in r[10].ok().splitlines()
    )


@pytest.mark.slow
def test_put_refuses_symlinks_and_a_busy_store_exits_5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_dir = tmp_path / "store"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "secret").write_text("key")
    (model / "key").symlink_to(tmp_path / "secret")
    r = batch(
        tmp_path,
        store_dir,
        ["put", str(model)],
        ["put", str(model), "--follow-symlinks", "--json"],
    )
    r[0].error(5, "is a symbolic link")
    assert json.loads(r[1].ok())[0]["collection"] is True
    store = Store.open(store_dir)
    monkeypatch.setenv("BLOBNET_LOCK_TIMEOUT", "0.5")
    with store.lock.hold():
        r = batch(tmp_path, store_dir, ["ls"])
    r[0].error(5, f"busy: process {os.getpid()} has held")  # the holder, named
