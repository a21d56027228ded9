"""Real processes: SIGKILL at every kind of point during put and partial writes, two
writers at once, and gc against a partial another process is writing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from blobstore import Manifest, PartialBusy, Store

Problems = Callable[[Path], list[str]]


C = 64 * 1024
REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, random, signal, sys
sys.path.insert(0, sys.argv[1])
from blobstore import Manifest, Store

repo, mode, root, src, kill_at, seed = sys.argv[1:7]
kill_at = int(kill_at)
C = 64 * 1024
# Small reads in the put modes: many small writes, more places to die.
store = Store.open(root) if mode == "timed" else Store.open(root, io_buffer=C)
data = open(src, "rb").read()
count = 0

def wrap(name):
    real = getattr(os, name)
    def wrapper(*args, **kwargs):
        global count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(os, name, wrapper)

for name in ("write", "pwrite", "fsync", "link", "replace", "rename", "unlink", "ftruncate"):
    wrap(name)
print("ready", flush=True)
if mode in ("put", "timed"):
    blob_id = store.put_path(src, chunk_size=C)
elif mode == "partial" or mode == "hold":
    m = Manifest.of_bytes(data, C)
    order = list(range(m.num_chunks))
    random.Random(int(seed)).shuffle(order)
    with store.begin_partial(m) as p:
        for j, i in enumerate(order):
            off, n = m.chunk_span(i)
            p.write_chunk(i, data[off : off + n])
            if j % 3 == 2:
                p.flush()
            if mode == "hold" and j == 1:
                p.flush()
                print("holding", flush=True)
                sys.stdin.readline()
        blob_id = p.publish()
print(blob_id, count, flush=True)
"""


def run_child(
    tmp: Path, mode: str, root: Path, src: Path, kill_at: int = 0, seed: int = 0
) -> subprocess.Popen[str]:
    script = tmp / "child.py"
    if not script.exists():
        script.write_text(CHILD)
    return subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(REPO),
            mode,
            str(root),
            str(src),
            str(kill_at),
            str(seed),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode, out


def sample(n: int, k: int, rng: random.Random) -> list[int]:
    """k kill points over 1..n: the first and last few plus random ones between."""
    edge = [1, 2, n - 2, n - 1, n]
    middle = rng.sample(range(3, max(n - 2, 4)), min(k, max(n - 5, 1)))
    return sorted({i for i in edge + middle if 1 <= i <= n})


@pytest.mark.slow
def test_sigkill_during_put(tmp_path: Path, store_problems: Problems) -> None:
    data = os.urandom(6 * C + 100)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    expected = Manifest.of_bytes(data, C).blob_id
    root = tmp_path / "store"
    Store.open(root)
    code, out = finish(run_child(tmp_path, "put", root, src))
    blob_id, n = out.split()[-2:]
    assert code == 0
    assert blob_id == expected
    Store.open(root).rm(expected)
    rng = random.Random(1)
    for k in sample(int(n), 8, rng):
        code, _ = finish(run_child(tmp_path, "put", root, src, kill_at=k))
        assert code == -signal.SIGKILL, f"child was not killed at op {k} of {n}"
        store = Store.open(root)  # sweeps what the dead writer left
        assert store_problems(root) == [], f"after kill at op {k}"
        assert store.blob_ids() in ([], [expected])
        assert store.put_path(src, chunk_size=C) == expected  # repeatable
        assert store.verify(expected) == []
        store.rm(expected)


@pytest.mark.slow
def test_sigkill_at_random_times_during_put(tmp_path: Path, store_problems: Problems) -> None:
    data = os.urandom(24 * 1024 * 1024)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    expected = Manifest.of_bytes(data, C).blob_id
    root = tmp_path / "store"
    Store.open(root)
    rng = random.Random(2)
    for _ in range(3):
        proc = run_child(tmp_path, "timed", root, src)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, 0.08))
        proc.send_signal(signal.SIGKILL)
        finish(proc)
        store = Store.open(root)
        assert store_problems(root) == []
        assert store.blob_ids() in ([], [expected])
        if store.has(expected):
            store.rm(expected)
    assert Store.open(root).put_path(src, chunk_size=C) == expected


@pytest.mark.slow
def test_sigkill_during_partial_write_then_resume(tmp_path: Path, store_problems: Problems) -> None:
    data = os.urandom(9 * C + 5)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    m = Manifest.of_bytes(data, C)
    root = tmp_path / "store"
    probe = tmp_path / "probe"
    Store.open(probe)
    _, out = finish(run_child(tmp_path, "partial", probe, src, seed=3))
    n = int(out.split()[-1])
    Store.open(root)
    rng = random.Random(3)
    for k in sample(n, 10, rng):
        finish(run_child(tmp_path, "partial", root, src, kill_at=k, seed=k))
        store = Store.open(root)
        assert store_problems(root) == [], f"after kill at op {k}"
        if store.has(m.blob_id):
            assert store.verify(m.blob_id) == []
            store.rm(m.blob_id)
            continue
        with store.begin_partial(m) as p:  # marked chunks re-verified on open
            for i in range(m.num_chunks):
                if p.has_chunk(i):
                    off, length = m.chunk_span(i)
                    assert p.read_chunk(i) == data[off : off + length]
    code, _ = finish(run_child(tmp_path, "partial", root, src, seed=99))
    assert code == 0
    store = Store.open(root)
    assert store.verify(m.blob_id) == []
    assert store.partial_ids() == []
    assert store_problems(root) == []


@pytest.mark.slow
def test_two_processes_put_the_same_content(tmp_path: Path, store_problems: Problems) -> None:
    data = os.urandom(8 * 1024 * 1024)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    expected = Manifest.of_bytes(data, C).blob_id
    root = tmp_path / "store"
    Store.open(root)
    for _ in range(2):
        procs = [run_child(tmp_path, "timed", root, src) for _ in range(2)]
        outs = [finish(p) for p in procs]
        assert [code for code, _ in outs] == [0, 0]
        assert {out.split()[-2] for _, out in outs} == {expected}
        store = Store.open(root)
        assert store.blob_ids() == [expected]
        assert store_problems(root) == []


@pytest.mark.slow
def test_gc_and_rm_spare_a_partial_held_by_another_process(
    tmp_path: Path, store_problems: Problems
) -> None:
    data = os.urandom(6 * C)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    m = Manifest.of_bytes(data, C)
    root = tmp_path / "store"
    store = Store.open(root)
    proc = run_child(tmp_path, "hold", root, src, seed=5)
    assert proc.stdout is not None
    assert proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    assert proc.stdout.readline().strip() == "holding"
    try:
        assert store.gc(0) == []
        assert store.partial_ids() == [m.blob_id]
        assert sum(bin(b).count("1") for b in store.chunk_bitmap(m.blob_id)) == 2
        with pytest.raises(PartialBusy, match=f"written by process {proc.pid};"):
            store.begin_partial(m)  # the holder is named, so the user knows what to stop
        with pytest.raises(PartialBusy, match=f"written by process {proc.pid}"):
            store.rm(m.blob_id)
        Store.open(root)  # another process opening the store sweeps nothing of it
        assert store.partial_ids() == [m.blob_id]
    finally:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        code, out = finish(proc)
    assert code == 0
    assert out.split()[-2] == m.blob_id
    assert store.verify(m.blob_id) == []
    assert store_problems(root) == []
