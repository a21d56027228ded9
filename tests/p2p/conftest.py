"""Real node processes for the integration tests: ``blob serve`` (or a hostile variant)
in its own OS process, on 127.0.0.1, over its own store on disk."""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.blob_cli import blob_here as run_here

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # helper modules beside this file import by name
    sys.path.insert(0, str(HERE))

HOSTILE_NODE = Path(__file__).with_name("hostile_node.py")
READY_TIMEOUT = 60.0
LISTEN = "/ip4/127.0.0.1/tcp/0"


def blob_cmd(store: Path, key: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key), *args]


def run_blob(
    store: Path, key: Path, *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        blob_cmd(store, key, *args), capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"blob {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def blob_here(store: Path, key: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``blob ARGS`` through its ``main`` in this process, exit status and streams captured:
    for commands that answer before any node starts (usage errors, local reads), where a
    subprocess would only add an interpreter start."""
    return run_here(blob_cmd(store, key, *args)[3:])


def last_json(text: str) -> Any:
    """The JSON document a command printed (the whole output, or its last line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.strip().splitlines()[-1])


class NodeProcess:
    """One running node process; ``addr`` is its first full multiaddr, known once
    ``ready`` has read the node's ready line (at once unless ``wait`` is false, so that
    several nodes can start together)."""

    def __init__(self, cmd: list[str], name: str, log_path: Path, *, wait: bool = True) -> None:
        self.name = name
        self.log_path = log_path
        self._terminated = False
        # stderr goes to a file: a pipe nobody reads would block a chatty node.
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        if wait:
            self.ready()

    def ready(self) -> NodeProcess:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            err = self.log_path.read_text(errors="replace")
            raise AssertionError(f"node {self.name} did not become ready: {err[-2000:]}")
        info = json.loads(line)
        self.peer_id: str = info["peer_id"]
        self.addrs: list[str] = info["addrs"]
        self.addr = self.addrs[0]
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def terminate(self) -> None:
        """Ask the node to stop (one SIGTERM) without waiting; ``stop`` waits."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_pipes()
        return self.proc.returncode


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: list[NodeProcess] = []

    def store(self, name: str) -> Path:
        return self.root / name / "store"

    def key(self, name: str) -> Path:
        return self.root / name / "machine.key"

    def _log(self, name: str) -> Path:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return self.root / name / f"node-{len(self.nodes)}.log"

    def put(self, name: str, path: Path) -> str:
        done = run_blob(self.store(name), self.key(name), "put", str(path), "--json")
        return str(last_json(done.stdout)[0]["id"])

    def put_here(self, name: str, path: Path) -> str:
        """What ``put`` does, in this process (no interpreter start for a local write)."""
        from blobstore import Store

        return Store.open(self.store(name)).put_path(path)

    def serve(self, name: str, *extra: str, dht: bool = False, wait: bool = True) -> NodeProcess:
        """``blob serve`` for ``name``; with ``wait`` false the caller calls ``ready``."""
        args = ["serve", "--json", "--listen", LISTEN, *extra]
        if not dht:
            args.append("--no-dht")
        cmd = blob_cmd(self.store(name), self.key(name), *args)
        node = NodeProcess(cmd, name, self._log(name), wait=wait)
        self.nodes.append(node)
        return node

    def hostile(self, name: str, mode: str, *extra: str) -> NodeProcess:
        cmd = [
            sys.executable, str(HOSTILE_NODE), "--store", str(self.store(name)),
            "--mode", mode, *extra,
        ]  # fmt: skip
        node = NodeProcess(cmd, name, self._log(name))
        self.nodes.append(node)
        return node

    def get(self, name: str, ref: str, *extra: str, timeout: float = 180) -> Any:
        done = run_blob(
            self.store(name), self.key(name), "get", ref, "--json", *extra, timeout=timeout
        )
        return last_json(done.stdout)

    def close(self) -> None:
        for node in self.nodes:  # all asked at once: each takes a moment to wind down
            node.terminate()
        for node in self.nodes:
            node.stop()


@pytest.fixture(autouse=True)
def collect_libp2p_sockets() -> Iterator[None]:
    """py-libp2p 0.8.1 leaves the sockets of an in-process host to the garbage collector;
    collect them right after the test that made them, with their ResourceWarning silenced,
    so they do not fail whichever test happens to run when the collector gets to them."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def random_file(path: Path, size: int, seed: int = 0) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


os.environ.setdefault("PYTHONUNBUFFERED", "1")
