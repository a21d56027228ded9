"""Real ``blob`` processes on testbed hosts: a store and a machine key per node (in a
temp directory), ``blob serve`` and ``blob get`` run as separate processes inside the
hosts' namespaces, as a user would run them.

The time to the first verified chunk is read from outside the fetcher: the store writes
a chunk into ``partial/<id>/data`` (a sparse file) only after its hash matched the
manifest (blobstore.partial rule 1), so the moment that file first holds a data block
is the moment the first verified chunk landed. We poll its ``st_blocks`` every
``FIRST_CHUNK_POLL_S``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.wan.testbed import Testbed, TestbedError, stop_process

SERVE_READY_TIMEOUT = 60.0  # a node's start-up (imports, key, listen) on a loaded machine
FIRST_CHUNK_POLL_S = 0.002
MiB = 1 << 20


def blob_env() -> dict[str, str]:
    """``blob`` runs from whatever ``p2p`` this interpreter imports (the installed
    project, or a tree named in PYTHONPATH); its processes start in their node's
    directory so that ``-m`` does not pick up a ``p2p`` from the caller's directory."""
    return dict(os.environ)


def blob_argv(node: BlobNode, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "p2p.cli",
        "--store", str(node.store), "--key", str(node.key), *args,
    ]  # fmt: skip


# A `blob` process that imports what it needs, says so (creates the file argv[1]), and
# runs only once the file argv[2] exists (or argv[3] seconds passed): processes started
# on a loaded machine end their imports seconds apart, and a fan-out that means "every
# fetcher starts at once" must not measure that skew (bench.wan.scenarios).
_AT_BARRIER = """import os, sys, time
import p2p.cli.app, p2p.node.node
ready, go, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
open(ready, "w").close()
end = time.monotonic() + limit
while not os.path.exists(go) and time.monotonic() < end:
    time.sleep(0.002)
p2p.cli.app.main(sys.argv[4:])
"""


@dataclass(frozen=True)
class Barrier:
    """Where processes started at a barrier say they are ready, and what lets them go."""

    ready_dir: Path
    go: Path
    limit_s: float

    def argv(self, node: BlobNode, *args: str) -> list[str]:
        ready = self.ready_dir / f"{node.host}.ready"
        return [
            sys.executable, "-c", _AT_BARRIER, str(ready), str(self.go), str(self.limit_s),
            "--store", str(node.store), "--key", str(node.key), *args,
        ]  # fmt: skip

    def ready(self, node: BlobNode) -> bool:
        return (self.ready_dir / f"{node.host}.ready").exists()


def write_random_file(path: Path, size: int, seed: int = 0) -> None:
    """``size`` pseudo-random bytes (incompressible, reproducible from ``seed``)."""
    rng = random.Random(seed)
    with path.open("wb") as out:
        left = size
        while left:
            n = min(left, 8 * MiB)
            out.write(rng.randbytes(n))
            left -= n


@dataclass
class Served:
    proc: subprocess.Popen[str]
    peer_id: str
    addr: str  # the multiaddr on the testbed address, ending in /p2p/<peer id>


@dataclass
class GetResult:
    """One ``blob get``: its own --json report and what we saw from outside."""

    report: dict[str, Any]
    wall_s: float  # process start to exit
    first_chunk_s: float | None  # process start to the first verified chunk on disk
    returncode: int
    stderr: str = ""

    @property
    def rate_bytes_per_s(self) -> float:
        """Bytes over the time from the download's start (manifest in) to its end."""
        return float(self.report.get("rate_bytes_per_s") or 0.0)

    @property
    def transfer_rate_bytes_per_s(self) -> float:
        """Bytes over the time from the first chunk byte received to the end: what raw
        TCP's rate is (bench.wan.probe: first byte to last at the receiver)."""
        return float(self.report.get("transfer_rate_bytes_per_s") or 0.0)


@dataclass
class BlobNode:
    """One machine: a store and a key under ``root``, on testbed host ``host``."""

    root: Path
    host: str
    served: Served | None = field(default=None)

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def key(self) -> Path:
        return self.root / "machine.key"

    @property
    def log(self) -> Path:
        return self.root / "serve.log"

    def put(self, path: Path) -> str:
        return put_all([self], path)

    def start_serve(self, tb: Testbed, *extra: str) -> subprocess.Popen[str]:
        """Start ``blob serve`` on this node's host; :meth:`ready` waits for it."""
        self.root.mkdir(parents=True, exist_ok=True)
        listen = f"/ip4/{tb.addr(self.host)}/tcp/0"
        # Its stderr goes to a file: a pipe nobody reads would stall a chatty server.
        with self.log.open("ab") as log:
            return tb.popen(
                self.host,
                blob_argv(self, "serve", "--json", "--no-dht", "--listen", listen, *extra),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=blob_env(),
                cwd=self.root,
            )

    def ready(self, tb: Testbed, proc: subprocess.Popen[str]) -> Served:
        line = _readline(proc, SERVE_READY_TIMEOUT)
        if not line:
            proc.kill()
            proc.communicate(timeout=10)
            err = self.log.read_text(errors="replace").strip()[-500:]
            raise TestbedError(f"blob serve on {self.host} did not start: {err}")
        ready = json.loads(line)
        addrs = [a for a in ready["addrs"] if f"/ip4/{tb.addr(self.host)}/" in a]
        if not addrs:
            raise TestbedError(f"blob serve listens on {ready['addrs']}, not the testbed")
        self.served = Served(proc, ready["peer_id"], addrs[0])
        return self.served

    def serve(self, tb: Testbed, *extra: str) -> Served:
        return self.ready(tb, self.start_serve(tb, *extra))

    def stop(self) -> None:
        if self.served is not None:
            stop_process(self.served.proc)

    def start_get(
        self,
        tb: Testbed,
        blob_id: str,
        peers: list[str],
        *extra: str,
        barrier: Barrier | None = None,
        default_listen: bool = False,
    ) -> Getting:
        """Start ``blob get`` (returns at once; :meth:`Getting.wait` for the result); with
        ``barrier``, it waits there after its imports. It listens on its host's testbed
        address, or with ``default_listen`` where a user's ``blob get`` listens (every
        interface, since the peers it names are remote)."""
        argv = ["get", blob_id, "--json", "--no-dht", "--no-progress"]
        if not default_listen:
            argv += ["--listen", f"/ip4/{tb.addr(self.host)}/tcp/0"]
        for peer in peers:
            argv += ["--peer", peer]
        self.root.mkdir(parents=True, exist_ok=True)
        data = self.store / "partial" / blob_id / "data"
        started = time.monotonic()
        proc = tb.popen(
            self.host,
            (blob_argv if barrier is None else barrier.argv)(self, *argv, *extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=blob_env(),
            cwd=self.root,
        )
        return Getting(proc, started, data)

    def get(
        self, tb: Testbed, blob_id: str, peers: list[str], *, timeout: float = 300.0
    ) -> GetResult:
        return self.start_get(tb, blob_id, peers).wait(timeout)


def put_all(nodes: Sequence[BlobNode], path: Path) -> str:
    """``blob put`` the file into every node's store (processes run at once); its ID."""
    procs = []
    for node in nodes:
        node.root.mkdir(parents=True, exist_ok=True)
        procs.append(
            subprocess.Popen(
                blob_argv(node, "put", str(path), "--json"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=blob_env(),
                cwd=node.root,
            )
        )
    ids: set[str] = set()
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise TestbedError(f"blob put failed: {err.strip()[-500:]}")
        ids.add(str(json.loads(out)[0]["id"]))
    if len(ids) != 1:
        raise TestbedError(f"one file, several IDs: {ids}")
    return ids.pop()


def serve_all(tb: Testbed, nodes: Sequence[BlobNode], *extra: str) -> list[Served]:
    """Start ``blob serve`` on every node at once; wait until all are ready."""
    procs = [node.start_serve(tb, *extra) for node in nodes]
    return [node.ready(tb, proc) for node, proc in zip(nodes, procs, strict=True)]


class Getting:
    """A running ``blob get``; a thread watches for its first verified chunk."""

    def __init__(self, proc: subprocess.Popen[str], started: float, data: Path) -> None:
        self.proc = proc
        self.started = started
        self.first_chunk: float | None = None
        self._data = data
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    @property
    def partial_dir(self) -> Path:
        """Where the partial blob lives once the manifest is in (it exists from then)."""
        return self._data.parent

    def _watch(self) -> None:
        while self.proc.poll() is None:
            try:
                if os.stat(self._data).st_blocks > 0:
                    self.first_chunk = time.monotonic()
                    return
            except FileNotFoundError:
                pass
            time.sleep(FIRST_CHUNK_POLL_S)

    def wait(self, timeout: float) -> GetResult:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise TestbedError(f"blob get took over {timeout:.0f} s: {err[-500:]}") from None
        ended = time.monotonic()
        self._watcher.join(timeout=1.0)
        report: dict[str, Any] = {}
        lines = out.strip().splitlines()
        if self.proc.returncode == 0 and lines:
            report = json.loads(lines[-1])
        first = None if self.first_chunk is None else self.first_chunk - self.started
        return GetResult(report, ended - self.started, first, self.proc.returncode, err)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """One stdout line, or "" if the process exits or ``timeout`` passes first."""
    assert proc.stdout is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


def startup_s(tb: Testbed, host: str) -> float:
    """Seconds for a Python process in ``host`` to import what ``blob get`` imports
    before its node runs (the CLI and the node: libp2p, trio, cryptography) and exit."""
    started = time.monotonic()
    tb.run(
        host,
        [sys.executable, "-c", "import p2p.cli.app, p2p.node.node"],
        timeout=120,
        check=True,
        env=blob_env(),
        cwd="/",
    )
    return time.monotonic() - started
