"""The outer loop's commands as a new user types them.

``outer verify --authority`` takes what ``outer run --workdir O`` leaves: O/authority.pub,
or the authority's key file itself (its public half). No error of it shows a file's
contents (a private key file's first characters least of all)."""

from __future__ import annotations

from pathlib import Path

from identity import create_key_file, format_public_key
from tests.blob_cli import blob_here


def _verify(store: Path, authority: str) -> tuple[int, str]:
    done = blob_here(
        ["--store", str(store), "outer", "verify", "nothing", "--authority", authority]
    )
    return done.returncode, done.stdout + done.stderr


def test_verify_takes_the_authority_key_file_and_never_echoes_a_file(tmp_path: Path) -> None:
    key = create_key_file(tmp_path / "authority.key")
    (tmp_path / "authority.pub").write_text(format_public_key(key.public_key_bytes) + "\n")
    store = tmp_path / "store"
    for given in (tmp_path / "authority.key", tmp_path / "authority.pub"):
        code, said = _verify(store, str(given))
        # Past the key: the run has no milestones in this store, which is the next check.
        assert "--authority" not in said, said
        assert code != 2, said

    notes = tmp_path / "notes.txt"
    notes.write_text("my secret notes, not a key\n")
    code, said = _verify(store, str(notes))
    assert code == 2, said
    assert str(notes) in said and "secret notes" not in said, said


def test_outer_run_needs_no_inner_steps(tmp_path: Path) -> None:
    """The README's `blob outer run --workers 3 --rounds 3` stopped at "Missing option
    '--inner-steps'". A bad --publish name is refused after the options are read and
    before any worker starts, so this runs nothing."""
    argv = ["--store", str(tmp_path / "s"), "outer", "run", "--workers", "3", "--rounds", "3"]
    done = blob_here([*argv, "--publish", "not a name!"])
    assert done.returncode == 2
    assert "inner-steps" not in done.stderr and "name" in done.stderr, done.stderr


def test_a_worker_keeps_at_least_the_tip(tmp_path: Path) -> None:
    """`outer worker --keep-states` bounds the store's state blobs; 0 would delete the tip
    every round, so it is refused as the user's mistake before anything starts."""
    argv = ["--store", str(tmp_path / "s"), "outer", "worker", "--keep-states", "0"]
    done = blob_here(argv)
    assert done.returncode == 2
    assert "--keep-states" in done.stderr, done.stderr
