"""Running an outer-loop worker, and ``blob outer run``'s local launcher.

A run is K workers, each a process with its own blobnet node, store and machine key,
admitted by the run's authority, that agree on a global state S_r round after round.

- :func:`run_worker` runs one worker (``training.outer.worker``, the trio shell over
  ``training.outer.agreement``, ``training.outer.aggregate`` and ``training.outer.messages``)
  on its own node until the run ends.
- :func:`prepare_run` / :func:`run_local` are ``blob outer run``: a temp authority, K
  keys and certificates (distinct operators), S_0 in worker 0's store, and K worker
  processes on 127.0.0.1, each bootstrapping to every worker started before it (a mesh of
  TCP connections, not a star: any one of them may die).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from blobstore import Store
from identity import (
    AdmissionCertificate,
    Authority,
    MachineKey,
    Rejected,
    SoftwareSigner,
    TrustStore,
    create_key_file,
    format_public_key,
    load_key_file,
    machine_signer,
    verify_certificate,
)
from training.outer.loop import (
    initial_state,
    model_params,
    state_root,
)
from training.outer.params import (
    CERT_LIFETIME,
    CERT_SKEW,
    OuterNetError,
    OuterRunFailed,
    RunParams,
    WorkerConfig,
    outer_kernel_class,
    write_json,
)
from training.outer.state_blob import encode_state

if TYPE_CHECKING:
    from training.outer.worker.faults import Faults


def _load_identity(
    config: WorkerConfig,
) -> tuple[MachineKey, AdmissionCertificate, TrustStore]:
    from identity import BadCertificate

    key = load_key_file(config.key_path)
    try:
        certificate = AdmissionCertificate.decode(config.cert_path.read_bytes())
    except FileNotFoundError:
        raise OuterNetError(f"no certificate file at {config.cert_path}") from None
    except BadCertificate as exc:
        raise OuterNetError(f"{config.cert_path}: {exc}") from None
    trust = TrustStore(frozenset(config.authorities))
    try:
        verify_certificate(certificate, trust=trust, now=time.time(), peer_id=key.peer_id)
    except Rejected as exc:
        raise OuterNetError(
            f"this machine's certificate does not count in this run: {exc}"
        ) from None
    return key, certificate, trust


async def run_worker(config: WorkerConfig, faults: Faults | None = None) -> dict[str, Any]:
    """Run one worker to the end of the run; returns (and writes) its result. ``faults``:
    what a test injects (none in a run)."""
    from p2p.node.node import open_node

    if config.initial is None and not config.join:
        raise OuterNetError("a worker needs the initial state blob ID (--initial) or --join")
    from training.outer.memory import limit_heap_growth

    limit_heap_growth()  # flat RSS over a long run (training.outer.memory)
    if config.publish is not None:
        from p2p.names.record import check_name

        check_name(config.publish)  # a bad name is refused before any training
    key, certificate, trust = _load_identity(config)
    from p2p.cli.nat import behind_nat
    from p2p.node.node import NodeConfig

    node_config = NodeConfig(
        listen=(config.listen,),
        bootstrap=tuple(config.bootstrap),
        dht=False,
        pubsub=True,
        certificate=certificate.encode(),
        relayed_fetch=config.relayed_fetch,
    )
    async with (
        open_node(config.store_root, key=key, config=node_config) as node,
        behind_nat(node, config.relays, certificate.encode(), config.assume_private),
    ):
        from training.outer.worker.driver import Worker
        from training.outer.worker.faults import NO_FAULTS

        # TPM-backed where the key is bound (`blob tpm bind`): its attestations then carry
        # the AK's co-signature.
        signer = machine_signer(key, config.key_path)
        worker = Worker(config, node, signer, certificate, trust, faults or NO_FAULTS)
        result = await _observed(worker, node, config.metrics)
        if config.publish is not None and result["rounds"]:
            record = await node.publish_name(config.publish, result["rounds"][-1]["state_blob"])
            result["name"] = record.to_json()
            if config.result_path is not None:
                write_json(config.result_path, result)
        return result


async def _observed(worker: Any, node: Any, metrics: str | None) -> dict[str, Any]:
    """Run ``worker`` with the node's local API on its store (``blob status`` shows the
    worker's section, training.outer.observe) and, with ``metrics``, its metrics served."""
    from p2p.cli.fleet import serve_metrics
    from p2p.daemon.server import serve_api
    from p2p.daemon.status import DaemonInfo

    info = DaemonInfo("outer-worker")
    info.extra["outer"] = worker.status
    async with serve_api(node, info) as daemon, serve_metrics(daemon.exposition, metrics):
        result: dict[str, Any] = await worker.run()
        return result


# --- the local launcher --------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPlan:
    index: int
    dir: Path
    store: Path
    key: Path
    cert: Path
    result: Path
    addr_file: Path
    peer_id: str


@dataclass(frozen=True)
class RunPlan:
    params: RunParams
    workdir: Path
    authority: str  # public key, hex
    initial: str  # the initial state blob, in worker 0's store
    initial_root: str
    kernel_class: str
    workers: tuple[WorkerPlan, ...]


def prepare_run(
    workdir: Path,
    params: RunParams,
    *,
    slots: int | None = None,
    kernel_class: str | None = None,
) -> RunPlan:
    """A temp authority, one key and certificate per worker slot (distinct operators), and
    the initial state blob in worker 0's store. ``slots`` (default K) may exceed K to admit
    joiners. The certificates admit ``kernel_class`` (default: this process's, CPU and one
    thread, as the built-in workers run)."""
    from training.model import make_tiny_llama

    workdir.mkdir(parents=True, exist_ok=True)
    authority_key = create_key_file(workdir / "authority.key")
    authority = Authority(SoftwareSigner(authority_key))
    # Beside the key: what `outer verify --authority` takes.
    (workdir / "authority.pub").write_text(format_public_key(authority.public_key_bytes) + "\n")
    if kernel_class is None:
        kernel_class = outer_kernel_class()
    now = int(time.time())
    plans = []
    for i in range(params.workers if slots is None else slots):
        wdir = workdir / f"worker-{i}"
        wdir.mkdir(exist_ok=True)
        key = create_key_file(wdir / "machine.key")
        cert = authority.admit(
            key.peer_id,
            operator=f"operator-{i}",
            kernel_class=kernel_class,
            not_before=now - CERT_SKEW,
            not_after=now + CERT_LIFETIME,
            serial=i + 1,
        )
        (wdir / "machine.cert").write_bytes(cert.encode())
        plans.append(
            WorkerPlan(
                i,
                wdir,
                wdir / "store",
                wdir / "machine.key",
                wdir / "machine.cert",
                wdir / "result.json",
                wdir / "addrs.json",
                key.peer_id,
            )
        )
    state = initial_state(model_params(make_tiny_llama(params.model_size, seed=params.seed)))
    initial = Store.open(plans[0].store).put_bytes(encode_state(state))
    return RunPlan(
        params,
        workdir,
        format_public_key(authority.public_key_bytes),
        initial,
        state_root(state),
        kernel_class,
        tuple(plans),
    )


def worker_argv(
    plan: RunPlan,
    index: int,
    *,
    bootstrap: Sequence[str] = (),
    join: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``blob outer worker`` command line of worker slot ``index``."""
    p = plan.params
    w = plan.workers[index]
    argv = [
        sys.executable,
        "-m",
        "p2p.cli",
        "--store",
        str(w.store),
        "--key",
        str(w.key),
        "outer",
        "worker",
        "--run",
        p.run_id,
        "--shard",
        str(index),
        "--workers",
        str(p.workers),
        "--rounds",
        str(p.rounds),
        "--inner-steps",
        str(p.inner_steps),
        "--deadline",
        repr(p.deadline),
        "--proposer-timeout",
        repr(p.proposer_timeout),
        "--seed",
        str(p.seed),
        "--batch",
        str(p.batch),
        "--seq-len",
        str(p.seq_len),
        "--inner-lr",
        repr(p.inner_lr),
        "--chunk",
        str(p.chunk),
        "--k",
        str(p.k),
        "--model-size",
        p.model_size,
        "--shard-sequences",
        str(p.shard_sequences),
        "--replay-rate",
        repr(p.replay_rate),
        "--fetch-floor",
        repr(p.fetch_floor),
        "--authority",
        plan.authority,
        "--cert",
        str(w.cert),
        "--result",
        str(w.result),
        "--addr-file",
        str(w.addr_file),
    ]
    if p.quorum:
        argv += ["--quorum", str(p.quorum)]
    if p.overlap:
        argv += ["--overlap", str(p.overlap)]
    if join:
        argv.append("--join")
    else:
        argv += ["--initial", plan.initial]
    for addr in bootstrap:
        argv += ["--bootstrap", addr]
    return argv + list(extra)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


def wait_for_addrs(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> list[str]:
    """The addresses a started worker wrote to its address file."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if path.exists():
            addrs: list[str] = json.loads(path.read_text())["addrs"]
            return addrs
        if proc.poll() is not None:
            raise OuterRunFailed(f"worker exited with status {proc.returncode} before listening")
        time.sleep(0.1)
    raise OuterRunFailed(f"worker did not listen within {timeout:.0f}s")


def run_local(
    plan: RunPlan, *, timeout: float, extra: Sequence[str] = ()
) -> list[dict[str, Any] | None]:
    """Start the K workers (``extra``: more ``blob outer worker`` options for each): worker
    0, then, once it listens, the others at once, each bootstrapping to worker 0 (the
    announcements introduce them to each other), so their start-ups overlap; wait for them
    (bounded); their results (None for a worker that failed)."""
    env = worker_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = subprocess.Popen(worker_argv(plan, 0, extra=extra), env=env, stdout=sys.stderr)
        procs.append(first)
        addrs = wait_for_addrs(plan.workers[0].addr_file, first, timeout=120)[:1]
        for i in range(1, plan.params.workers):
            argv = worker_argv(plan, i, bootstrap=addrs, extra=extra)
            procs.append(subprocess.Popen(argv, env=env, stdout=sys.stderr))
        give_up = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results: list[dict[str, Any] | None] = []
    for w, proc in zip(plan.workers, procs, strict=False):
        ok = proc.returncode == 0 and w.result.exists()
        results.append(json.loads(w.result.read_text()) if ok else None)
    return results


def summarise(results: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """Per round: mean loss, bytes per worker, included counts and whether roots agree."""
    done = [r for r in results if r is not None]
    by_round: dict[int, list[dict[str, Any]]] = {}
    for result in done:
        for rec in result["rounds"]:
            by_round.setdefault(rec["round"], []).append(rec)
    rounds = []
    for r in sorted(by_round):
        recs = by_round[r]
        rounds.append(
            {
                "round": r,
                "mean_loss": float(np.mean([x["mean_loss"] for x in recs])),
                "update_bytes": [x["update_bytes"] for x in recs],
                "included": [len(x["included"]) for x in recs],
                "excluded": [len(x["excluded"]) for x in recs],
                "rejected": [len(x["rejected"]) for x in recs],
                "how": [x["how"] for x in recs],
                "roots_agree": len({x["root"] for x in recs}) == 1,
                "root": recs[0]["root"],
            }
        )
    finals = {r["final_root"] for r in done}
    return {
        "workers": len(results),
        "finished": len(done),
        "rounds": rounds,
        "final_root": next(iter(finals)) if len(finals) == 1 else None,
        "roots_agree": len(finals) == 1
        and all(x["roots_agree"] for x in rounds)
        and all(r["agreed"] for r in done),
        "results": list(results),
    }


def default_workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="blob-outer-")
