"""Ctrl-C during `blob get` is always exit 130 and one line.

Never trio.TrioInternalError: trio's default SIGINT handling raises KeyboardInterrupt
inside whichever task is running, and when that task is a chunk write between queueing
its job and waiting for it, the writer thread later wakes a task that has already
exited. So the networked commands take SIGINT through a trio signal receiver
(p2p.cli.common.run_interruptible), which cancels the work in order."""

from __future__ import annotations

import functools
import os
import queue
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import pytest
import trio

from blobstore import Store
from blobstore.store_lock import LOCK_TIMEOUT_ENV
from p2p.cli.common import Interrupted, run_interruptible
from p2p.fetch.chunk_writer import ChunkWriter

from .conftest import Cluster, blob_cmd, random_file, run_blob, wait_until

MiB = 1024 * 1024


class SlowSink:
    """A partial blob stand-in whose writes take a moment, so the job is still queued
    or running when the signal lands."""

    def __init__(self) -> None:
        self.written: list[int] = []

    def write_chunk(self, index: int, data: memoryview, *, digest: bytes | None = None) -> bool:
        time.sleep(0.05)
        self.written.append(index)
        return True


class SignalOnPut:
    """The writer's job queue, raising SIGINT in this thread right after a job is queued:
    the moment between ChunkWriter.write's queueing and its waiting."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.fired = False

    def put(self, job: Any) -> None:
        self.jobs.put(job)
        if job is not None and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)

    def get(self) -> Any:
        return self.jobs.get()


async def _writes_interrupted_between_put_and_wait(sink: SlowSink) -> None:
    writer = ChunkWriter(sink, threads=1)
    writer._jobs = SignalOnPut()  # type: ignore[assignment]
    async with writer, trio.open_nursery() as nursery:
        for index in range(4):
            nursery.start_soon(writer.write, index, memoryview(b"x"))
        await trio.sleep(5)  # interrupted by the signal long before this ends


def test_sigint_between_queueing_and_waiting_is_an_orderly_cancel() -> None:
    """Deterministic form of the race: the signal arrives exactly between the put and the
    wait. Under trio's default handling this raised KeyboardInterrupt inside the writing
    task and the run died with TrioInternalError; through run_interruptible the write
    finishes, the writer stops cleanly and the caller gets Interrupted."""
    sink = SlowSink()
    with pytest.raises(Interrupted, match="SIGINT"):
        run_interruptible(lambda: _writes_interrupted_between_put_and_wait(sink))
    assert 0 in sink.written  # the write that was queued when the signal came completed


def test_sigint_between_queueing_and_waiting_under_plain_trio_run() -> None:
    """The same race in any trio program (BlockingNode, a training script), with trio's own
    SIGINT handling: ChunkWriter.write is protected from KeyboardInterrupt between the put
    and the wait, so the run ends in KeyboardInterrupt, never TrioInternalError."""
    try:
        trio.run(_writes_interrupted_between_put_and_wait, SlowSink())
    except BaseException as exc:  # KeyboardInterrupt, maybe in a group; never TrioInternalError
        caught = exc
    else:
        pytest.fail("the SIGINT did not interrupt the run")
    assert not isinstance(caught, trio.TrioInternalError), repr(caught)
    leaves = list(caught.exceptions) if isinstance(caught, BaseExceptionGroup) else [caught]
    assert any(isinstance(exc, KeyboardInterrupt) for exc in leaves), repr(caught)


def _interrupt_one(cmd: list[str], partial: Path, delay: float) -> tuple[int, str]:
    """Start a fetch, SIGINT it ``delay`` seconds after its partial blob appears (the
    fetch has begun), and return its exit status and stderr."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        wait_until(lambda: partial.exists() or p.poll() is not None, timeout=60, interval=0.002)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    return p.returncode, err


def test_ctrl_c_at_many_points_of_a_real_fetch(cluster: Cluster, tmp_path: Path) -> None:
    """SIGINT at six points of a fetch from a real `blob serve` (six fetchers at once, to
    keep the test short): every one exits 130 with one line (or 0 if it finished first),
    and an interrupted fetch resumes to the very blob that was put in."""
    source = random_file(tmp_path / "ckpt.bin", 64 * MiB)
    blob_id = cluster.put_here("a", source)  # a local write, in this process
    a = cluster.serve("a")
    key = cluster.key("b")
    delays = (0.0, 0.01, 0.03, 0.06, 0.1, 0.15)
    stores = [cluster.store(f"b{run}") for run in range(len(delays))]
    with ThreadPoolExecutor(len(delays)) as pool:
        runs = [
            pool.submit(
                _interrupt_one,
                blob_cmd(store, key, "get", blob_id, "--peer", a.addr, "--no-progress"),
                store / "partial" / blob_id,
                delay,
            )
            for store, delay in zip(stores, delays, strict=True)
        ]
        outcomes = [run.result(timeout=120) for run in runs]
    for code, err in outcomes:
        assert "Traceback" not in err and "TrioInternalError" not in err, err
        assert code in (0, 130), err
        if code == 130:
            assert err.strip().splitlines() == ["Interrupted."], err
    codes = [code for code, _ in outcomes]
    assert codes.count(130) >= 3, codes  # most signals landed during the fetch
    interrupted = stores[codes.index(130)]
    run_blob(interrupted, key, "get", blob_id, "--peer", a.addr, "--no-progress")
    digest = blake3.blake3(Store.open(interrupted).path(blob_id).read_bytes()).hexdigest()
    assert digest == blake3.blake3(source.read_bytes()).hexdigest()


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True  # gone: let the caller see how it ended


# Ctrl-C at the same moment of start-up a few times: the first imports of a run are slower.
IMPORT_TRIES = 3


def test_ctrl_c_while_blob_is_still_importing_is_one_line(tmp_path: Path) -> None:
    """A Ctrl-C in the first second of `blob get` on a loaded machine, while the commands
    were still being imported, printed a KeyboardInterrupt traceback (5 of 8 tries),
    though it exited 130. The signal is sent once the store's hashing library is loaded
    (/proc/PID/maps), in the middle of those imports."""
    cmd = blob_cmd(tmp_path / "store", tmp_path / "key", "get", "0" * 64, "--peer", "x")
    for _ in range(IMPORT_TRIES):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_until(functools.partial(_loaded, proc.pid, "blake3"), 30, interval=0.002)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "Traceback" not in err, err
        assert err.strip().splitlines() == ["Interrupted."], err


# Holds the store's lock until killed, saying so once it does.
_HOLD_LOCK = (
    "import sys, time\n"
    "from blobstore import Store\n"
    "with Store.open(sys.argv[1]).lock.hold():\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


def _waiting_for_the_store_lock(pid: int, lock: Path) -> bool:
    """Whether ``pid`` holds the store's lock file open (it waits on it), or is gone (the
    caller then sees how it ended). A descriptor closed while they are listed is neither:
    a process starting up opens and closes many, and a SIGINT sent before its interpreter
    set up its handler kills it outright."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return True  # gone
    for fd in fds:
        try:
            if os.readlink(fd) == str(lock):
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def test_ctrl_c_inside_a_command_that_runs_no_node_says_interrupted(tmp_path: Path) -> None:
    """Ctrl-C printed `Interrupted.` or `Aborted.` depending on timing: click's word when it
    landed in plain code (here `blob put` waiting for the store lock another process holds),
    ours in a networked command and during start-up. One word, whatever the timing."""
    store = tmp_path / "store"
    Store.open(store)
    (tmp_path / "file").write_bytes(b"x" * 1000)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(store)], stdout=subprocess.PIPE, text=True
    )
    cmd = blob_cmd(store, tmp_path / "key", "put", str(tmp_path / "file"))
    env = {**os.environ, LOCK_TIMEOUT_ENV: "60"}
    proc = None
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        lock = store / "locks" / "store"
        waiting = functools.partial(_waiting_for_the_store_lock, proc.pid, lock)
        assert wait_until(waiting, 60, 0.01)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        for p in (proc, holder):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    assert proc.returncode == 130, err
    assert err.split() == ["Interrupted."], err
