"""A test file run as several processes (the workers of a run, or the ranks of one worker's
torch.distributed group), the test waiting for them all.

1. Each process runs ``python TEST_FILE [ARGS] CONFIG``: its config is a JSON file written
   beside its ``out`` path, and what its main function returns is written to ``out`` as
   JSON (``program``), which ``run_programs`` reads back.
2. All start at once, so their torch imports overlap. Where the later ones bootstrap to the
   first (``bootstrap=True``), each waits for the first's addresses itself
   (``bootstrap_addrs``), which the first writes once it listens (``listening``).
3. The wait is bounded by ``RUN_TIMEOUT``; the first process to fail ends the wait, and any
   process still running then is killed.
4. A program freezes the heap before its main function (the collector's passes over
   torch's and py-libp2p's objects check nothing a test asserts), and once its result is
   written it leaves with ``os._exit``, skipping the interpreter's finalization: that
   took about 3 s a process on 2 vCPUs, and with a gloo group (destroyed) torch 2.13
   aborts in it now and then ("terminate called without an active exception", no Python
   frame; 8 of 20 two-rank runs of a plain fully_shard script), after every result is in.

Import as ``tests.training.ranks``; a program's ``__main__`` block puts the repository root
on ``sys.path`` first (``python TEST_FILE`` puts only the file's folder there)."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# A bound that only stops a hang: three processes import torch on 2 vCPUs.
RUN_TIMEOUT = 240


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def group_configs(worker: Any, spec: str, out_dir: Path, ranks: int = 2) -> list[dict[str, Any]]:
    """One config per rank of a worker that is a torch.distributed group: the worker slot's
    store, key and certificate (rank 0 is the run's peer), the spec, a free port for the
    group and each rank's output file in ``out_dir``."""
    port = free_port()
    return [
        {
            "rank": rank,
            "port": port,
            "store": str(worker.store),
            "key": str(worker.key),
            "cert": str(worker.cert),
            "spec": spec,
            "out": str(out_dir / f"rank{rank}.json"),
        }
        for rank in range(ranks)
    ]


def _config_path(config: dict[str, Any]) -> Path:
    return Path(config["out"]).with_suffix(".cfg.json")


def run_programs(
    script: str,
    configs: Sequence[dict[str, Any]],
    *,
    args: Sequence[str] = (),
    bootstrap: bool = False,
    timeout: float = RUN_TIMEOUT,
) -> list[dict[str, Any]]:
    """Run ``script`` once per config, all at once (rules 1-3); each one's result, in order.
    With ``bootstrap``, every config after the first is given the first's addresses."""
    from training.outer.launch import worker_env

    configs = [dict(c) for c in configs]
    if bootstrap:
        first = str(Path(configs[0]["out"]).with_suffix(".addrs.json"))
        configs[0]["addrs"] = first
        for config in configs[1:]:
            config["bootstrap_from"] = first
    env = worker_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for config in configs:
            _config_path(config).write_text(json.dumps(config))
            argv = [sys.executable, script, *args, str(_config_path(config))]
            procs.append(subprocess.Popen(argv, env=env, stdout=sys.stderr))
        give_up = time.monotonic() + timeout
        while (codes := [p.poll() for p in procs]).count(0) < len(procs):
            assert all(c in (None, 0) for c in codes), f"exit statuses {codes}"
            assert time.monotonic() < give_up, f"still running after {timeout:.0f}s: {codes}"
            try:
                procs[codes.index(None)].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass  # look at the others: one that failed ends the wait
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads(Path(c["out"]).read_text()) for c in configs]


def program(main: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A process's whole life (rules 1 and 4): read the config named last on the command
    line, run ``main`` on it, write its result to the config's ``out``."""
    config = json.loads(Path(sys.argv[-1]).read_text())
    gc.freeze()
    result = main(config)
    Path(config["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # rule 4: no finalization


def listening(config: dict[str, Any], addrs: Sequence[str]) -> None:
    """The first process says where it listens (whole, so a reader never sees half)."""
    path = config.get("addrs")
    if path is not None:
        Path(path + ".tmp").write_text(json.dumps(list(addrs)))
        os.replace(path + ".tmp", path)


def bootstrap_addrs(config: dict[str, Any]) -> list[str]:
    """A later process's bootstrap: the first's first address, once it listens (none for
    the first itself)."""
    path = config.get("bootstrap_from")
    if path is None:
        return []
    give_up = time.monotonic() + RUN_TIMEOUT
    while not os.path.exists(path):
        assert time.monotonic() < give_up, "the first process did not listen in time"
        time.sleep(0.05)
    addrs: list[str] = json.loads(Path(path).read_text())
    return addrs[:1]
