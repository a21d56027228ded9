"""Who may touch a store: file modes, the store lock, and how long anyone waits for it.

A read-only descriptor is enough to flock a file, so a lock file that other users can
open (a 0644 file at the store's root) lets any local user make the owner's ``blob put``
hang forever. So the lock is a 0600 file inside ``locks/`` (0700), the wait is bounded
(:data:`blobstore.STORE_LOCK_TIMEOUT`) and ends in StoreBusy, exit 5, naming
the holder's PID. Modes are set explicitly, so a permissive umask changes nothing.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobstore import LOCK_TIMEOUT_ENV, CorruptChunk, Manifest, Store, StoreBusy, StoreError

C = 64 * 1024
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0: the store must not rely on the user's umask to stay private."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def populate(store: Store) -> dict[str, Path]:
    """One of everything the store keeps: a blob, a tag, a partial, the lock."""
    blob_id = store.put_bytes(b"x" * (2 * C + 1), chunk_size=C)
    store.tag("t", blob_id)
    m = Manifest.of_bytes(b"y" * (2 * C), C)
    with store.begin_partial(m) as partial:
        partial.write_chunk(0, b"y" * C)
    shard = store.root / "blobs" / blob_id[:2]
    pdir = store.root / "partial" / m.blob_id
    return {
        "root": store.root,
        "blobs": store.root / "blobs",
        "shard": shard,
        "blob": shard / blob_id,
        "manifest": shard / f"{blob_id}.manifest",
        "tag": store.root / "tags" / "t",
        "marker": store.root / "blobnet-store",
        "partial-dir": pdir,
        "partial-data": pdir / "data",
        "partial-bitmap": pdir / "bitmap",
        "partial-manifest": pdir / "manifest",
        "partial-lock": pdir / "lock",
        "tmp": store.root / "tmp",
        "locks": store.root / "locks",
        "store-lock": store.root / "locks" / "store",
    }


PRIVATE = {
    "root": 0o700,
    "blobs": 0o700,
    "shard": 0o700,
    "blob": 0o400,
    "manifest": 0o400,
    "tag": 0o600,
    "marker": 0o600,
    "partial-dir": 0o700,
    "partial-data": 0o600,
    "partial-bitmap": 0o600,
    "partial-manifest": 0o600,
    "partial-lock": 0o600,
    "tmp": 0o700,
    "locks": 0o700,
    "store-lock": 0o600,
}
SHARED = {
    **{k: 0o755 for k in ("root", "blobs", "shard", "partial-dir")},
    **{k: 0o444 for k in ("blob", "manifest")},
    **{k: 0o644 for k in ("tag", "marker", "partial-data", "partial-bitmap", "partial-manifest")},
    **{k: 0o700 for k in ("tmp", "locks")},
    **{k: 0o600 for k in ("partial-lock", "store-lock")},  # never lockable by others
}


def modes_of(paths: dict[str, Path]) -> dict[str, str]:
    return {name: oct(mode(path)) for name, path in paths.items()}


def octal(modes: dict[str, int]) -> dict[str, str]:
    return {name: oct(m) for name, m in modes.items()}


def test_store_is_private_by_default_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    store = Store.open(tmp_path / "s")
    assert not store.shared
    assert modes_of(populate(store)) == octal(PRIVATE)


def test_shared_store_is_readable_by_others_but_lockable_by_none(
    tmp_path: Path, open_umask: None
) -> None:
    store = Store.open(tmp_path / "s")
    paths = populate(store)
    shared = Store.open(tmp_path / "s", shared=True)  # existing files are re-moded
    assert shared.shared
    assert modes_of(paths) == octal(SHARED)
    again = Store.open(tmp_path / "s")  # the mode is the store's, not the opener's
    assert again.shared
    fresh = again.put_bytes(b"new", chunk_size=C)
    assert mode(again.path(fresh)) == 0o444
    Store.open(tmp_path / "s", shared=False)
    assert modes_of(paths) == octal(PRIVATE)
    assert mode(again.path(fresh)) == 0o400


def test_an_old_world_readable_store_becomes_private_on_open(tmp_path: Path) -> None:
    """A store from before this change: 0755 root, a 0644 lock anyone could flock."""
    root = tmp_path / "s"
    Store.open(root)
    os.chmod(root, 0o755)
    (root / "lock").write_bytes(b"")
    os.chmod(root / "lock", 0o644)
    Store.open(root)
    assert mode(root) == 0o700
    assert not (root / "lock").exists()


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None, reason="needs root to act as another user"
)
def test_another_user_can_read_a_shared_store_but_not_lock_it() -> None:
    """The attack: another account opens each lock to flock it. The
    same account can read a blob, so the locks are refused by their modes, not because
    the store is out of its reach."""
    assert SYSTEM_PYTHON is not None
    outside = Path(tempfile.mkdtemp(prefix="blobnet-modes-"))  # pytest's tmp is 0700
    try:
        os.chmod(outside, 0o755)
        store = Store.open(outside / "s", shared=True)
        paths = populate(store)
        probe = (
            "import fcntl, os, sys\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n"
            "        fd = os.open(p, os.O_RDONLY)\n"
            "    except PermissionError:\n"
            "        print('refused', p)\n"
            "        continue\n"
            "    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
            "    print('opened', p)\n"
        )
        targets = [paths["blob"], paths["store-lock"], paths["partial-lock"]]
        done = subprocess.run(
            [SYSTEM_PYTHON, "-c", probe, *map(str, targets)],
            user=65534,
            group=65534,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            f"opened {paths['blob']}",
            f"refused {paths['store-lock']}",
            f"refused {paths['partial-lock']}",
        ]
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_lock_wait_is_bounded_and_names_the_holding_process(tmp_path: Path) -> None:
    """A process that sits on the lock: the next put fails in about the timeout, exit 5,
    with the holder's PID in the message."""
    root = tmp_path / "s"
    Store.open(root)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from blobstore import Store\n"
            "s = Store.open(sys.argv[1])\n"
            "with s.lock.hold():\n"
            "    print('held', flush=True)\n"
            "    time.sleep(60)\n",
            str(root),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        start = time.monotonic()
        with pytest.raises(StoreBusy, match=f"process {holder.pid} has held") as info:
            Store.open(root, lock_timeout=0.3)  # opening sweeps under the lock: `blob put`
        waited = time.monotonic() - start
        assert info.value.exit_code == 5
        assert 0.3 <= waited < 10
    finally:
        holder.kill()
        holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()
    assert Store.open(root, lock_timeout=1).put_bytes(b"free again", chunk_size=C)


def test_lock_timeout_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = Store.open(tmp_path / "s")
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "0.2")
    other = Store.open(tmp_path / "s")
    assert other.lock_timeout == 0.2
    outcome: list[BaseException | str] = []

    def contend() -> None:
        try:
            other.tag("t", other.put_bytes(b"z", chunk_size=C))
            outcome.append("done")
        except BaseException as exc:
            outcome.append(exc)

    with owner.lock.hold():
        thread = threading.Thread(target=contend)
        thread.start()
        thread.join(timeout=5)
        still_waiting = thread.is_alive()
    thread.join(timeout=10)
    assert not still_waiting, "the wait for the store lock is not bounded"
    assert len(outcome) == 1 and isinstance(outcome[0], StoreBusy), outcome
    assert f"this process ({os.getpid()})" in str(outcome[0])
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "soon")
    with pytest.raises(Exception, match="not a number of seconds"):
        Store.open(tmp_path / "s")


def test_another_users_shared_store_opens_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen from another account (its uid faked here): blobs can be read, nothing is
    re-moded, created or swept, and the mode cannot be changed."""
    root = tmp_path / "s"
    owner = Store.open(root, shared=True)
    blob_id = owner.put_bytes(b"weights", chunk_size=C)
    (root / "tmp" / "tmp-left-by-a-live-writer").write_bytes(b"")
    before = modes_of({"root": root, "tmp": root / "tmp", "locks": root / "locks"})
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    reader = Store.open(root)
    assert reader.read_only and reader.shared
    assert reader.path(blob_id).read_bytes() == b"weights"
    assert reader.verify(blob_id) == []
    reader.export(blob_id, tmp_path / "copy.bin")  # leasing nothing: test_blobstore_exporter
    assert (tmp_path / "copy.bin").read_bytes() == b"weights"
    assert (root / "tmp" / "tmp-left-by-a-live-writer").exists()  # not swept
    assert modes_of({"root": root, "tmp": root / "tmp", "locks": root / "locks"}) == before
    with pytest.raises(StoreError, match="only the owner"):
        Store.open(root, shared=False)


def test_another_user_finds_rot_but_leaves_the_quarantine_to_the_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader of a shared store may not move the owner's files: ``verify`` reports the
    bad chunk (rather than fail on the owner's lock) and a read says whom to ask."""
    root = tmp_path / "s"
    owner = Store.open(root, shared=True)
    blob_id = owner.put_bytes(bytes(2 * C), chunk_size=C)
    path = owner.path(blob_id)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"rot")
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    reader = Store.open(root)
    assert reader.verify(blob_id) == [0]
    with pytest.raises(CorruptChunk, match="ask its owner"):
        reader.read_chunk(blob_id, 0)
    assert owner.has(blob_id)  # still the owner's to quarantine
