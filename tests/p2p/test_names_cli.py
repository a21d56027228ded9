"""``blob publish``, ``blob resolve`` and ``blob catalog`` through the ``blob`` program's
own error boundary (p2p.cli.app.main), over a real store, with no peers.

The story: a user names a blob of their store; the name resolves from the store's record
cache and is listed; a new publication supersedes the old one; every user mistake is one
line on stderr with the README's exit code and no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blobstore import Manifest, Store
from identity import load_or_create_key
from p2p.cli import app as blob_cli
from p2p.cli import names as names_cli

for _command in names_cli.COMMANDS:  # the lead's glue registers them in p2p/cli/app.py
    if _command.name not in blob_cli.cli.commands:
        blob_cli.cli.add_command(_command)


def _blob(
    capsys: pytest.CaptureFixture[str], store: Path, key: Path, *args: str
) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        blob_cli.main(["--store", str(store), "--key", str(key), *args])
    captured = capsys.readouterr()
    code = done.value.code
    return (code if isinstance(code, int) else 1), captured.out, captured.err


def test_publish_resolve_and_list_a_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store, key = tmp_path / "store", tmp_path / "machine.key"
    blob_a = Store.open(store).put_bytes(b"adapter a" * 1000)
    blob_b = Store.open(store).put_bytes(b"adapter b" * 1000)
    publisher = load_or_create_key(key).peer_id
    ref = f"{publisher}/run-x/adapter"

    code, out, err = _blob(
        capsys, store, key, "publish", "run-x/adapter", blob_a[:12], "--no-dht", "--json"
    )
    assert code == 0, err
    first = json.loads(out)
    assert (first["ref"], first["id"]) == (ref, blob_a)

    code, out, err = _blob(capsys, store, key, "resolve", ref, "--no-dht")
    assert code == 0, err
    assert out.split() == [blob_a, ref, "seq", str(first["seq"])]

    code, out, err = _blob(
        capsys, store, key, "publish", "run-x/adapter", blob_b, "--no-dht", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["seq"] > first["seq"]
    code, out, err = _blob(capsys, store, key, "resolve", ref, "--no-dht", "--json")
    assert json.loads(out)["id"] == blob_b

    code, out, err = _blob(capsys, store, key, "catalog", publisher, "--json")
    assert code == 0, err
    assert [(r["name"], r["id"]) for r in json.loads(out)] == [("run-x/adapter", blob_b)]


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (("resolve", "not-a-reference"), 2, "PUBLISHER/NAME"),
        (("resolve", "12D3KooWnotapeerid/name"), 2, "not a peer ID"),
        (("publish", "a//b", "0" * 64, "--no-dht"), 2, "bad name"),
        (("publish", "fine", "0" * 64, "--no-dht"), 3, "no blob"),
    ],
)
def test_user_mistakes_are_one_line_with_their_exit_code(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: tuple[str, ...],
    code: int,
    words: str,
) -> None:
    got, _out, err = _blob(capsys, tmp_path / "store", tmp_path / "machine.key", *args)
    assert got == code, err
    assert words in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_name_nobody_published_is_not_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store, key = tmp_path / "store", tmp_path / "machine.key"
    ref = f"{load_or_create_key(key).peer_id}/never"
    code, _out, err = _blob(capsys, store, key, "resolve", ref, "--no-dht", "--wait", "0.5")
    assert code == 3, err
    assert err.startswith("blob: error: no valid record for"), err


def test_a_blob_held_only_in_part_cannot_be_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A name promises a blob this store can serve whole: a partial download is refused."""
    store, key = tmp_path / "store", tmp_path / "machine.key"
    data = b"half a checkpoint" * 10_000
    opened = Store.open(store)
    with opened.begin_partial(Manifest.of_bytes(data, 64 * 1024)) as partial:
        partial.write_chunk(0, data[: 64 * 1024])
    code, _out, err = _blob(
        capsys, store, key, "publish", "run-x/ckpt", partial.blob_id, "--no-dht"
    )
    assert code == 3, err
    assert "is not complete in this store" in err
