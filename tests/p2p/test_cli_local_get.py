"""`blob get` of a blob already in the store, as a user types it: no node, one line for
each mistake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.p2p.conftest import blob_here


def _put(tmp_path: Path, data: bytes) -> tuple[Path, Path, str]:
    store, key = tmp_path / "store", tmp_path / "key"
    (tmp_path / "weights.bin").write_bytes(data)
    done = blob_here(store, key, "put", str(tmp_path / "weights.bin"), "--json")
    return store, key, json.loads(done.stdout)[0]["id"]


def test_get_o_does_not_overwrite_an_unrelated_file(tmp_path: Path) -> None:
    """`get -o FILE` silently replaced whatever FILE held (a directory was refused): it
    replaces it only with the same bytes (a re-run) or with --force."""
    store, key, blob_id = _put(tmp_path, b"checkpoint bytes" * 1000)
    notes = tmp_path / "notes.txt"
    notes.write_text("a week of notes")
    refused = blob_here(store, key, "get", blob_id, "-o", str(notes))
    assert refused.returncode == 5, refused.stderr
    assert "--force" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert notes.read_text() == "a week of notes"

    again = tmp_path / "copy.bin"
    assert blob_here(store, key, "get", blob_id, "-o", str(again)).returncode == 0
    assert blob_here(store, key, "get", blob_id, "-o", str(again)).returncode == 0  # same bytes
    forced = blob_here(store, key, "get", blob_id, "-o", str(notes), "--force")
    assert forced.returncode == 0, forced.stderr
    assert notes.read_bytes() == b"checkpoint bytes" * 1000


def test_a_short_prefix_is_told_prefixes_need_eight(tmp_path: Path) -> None:
    """A 6-character prefix of a local blob was reported "not in the local store"."""
    store, key, blob_id = _put(tmp_path, b"x")
    done = blob_here(store, key, "get", blob_id[:6])
    assert done.returncode == 3
    assert "at least 8" in done.stderr, done.stderr
    assert blob_here(store, key, "get", blob_id[:8]).returncode == 0


def test_a_server_key_in_a_directory_that_does_not_exist_is_a_typo(tmp_path: Path) -> None:
    """A typo in a server's --key silently made a new identity (and the directories for
    it): a server makes a key only in an existing directory, and announces a new one."""
    store = tmp_path / "store"
    # Not an address of this machine: a server that gets past its key stops there.
    serve = ("serve", "--no-dht", "--listen", "/ip4/203.0.113.1/tcp/0")
    typo = tmp_path / "kyes" / "machine.key"
    done = blob_here(store, typo, *serve)
    assert done.returncode == 3, done.stderr
    assert "typo" in done.stderr and not typo.parent.exists()

    fresh = tmp_path / "new.key"
    done = blob_here(store, fresh, *serve)
    assert done.returncode != 0
    assert "created a new machine key" in done.stderr and fresh.exists()


# `blob`, reporting at exit whether py-libp2p was imported.
_REPORTS_LIBP2P = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('libp2p' in sys.modules, file=sys.stderr))\n"
    "from p2p.cli import main\n"
    "main()\n"
)


def test_a_local_hit_does_not_import_the_network(tmp_path: Path) -> None:
    """`blob get ID` of a blob in the store took half a second more than it needed,
    importing py-libp2p (for its logger) before looking in the store."""
    store, key, blob_id = _put(tmp_path, b"here already")
    argv = ["--store", str(store), "--key", str(key), "get", blob_id]
    done = subprocess.run(
        [sys.executable, "-c", _REPORTS_LIBP2P, *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr
