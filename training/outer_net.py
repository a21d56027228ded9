"""The decentralised DiLoCo outer loop's run parameters, torch side and local launcher.

A run is K workers, each a process with its own blobnet node, store and machine key,
admitted by the run's authority, that agree on a global state S_r round after round.

- :class:`RunParams` is what every worker must be given identically (run ID, K, rounds,
  inner steps, deadline, proposer timeout, seed, codec and model size; the outer optimiser
  is ``MODE_DEFAULTS["sparseloco"]``). S_0 is made once, by the launcher, and named by its
  state blob ID (``training.state_blob``): nobody re-derives a random init.
- :class:`Trainer` is a worker's torch side (model, inner AdamW kept across rounds as in
  DiLoCo, shard, sampler, error-feedback residual).
- The worker itself, how rounds are closed and agreed on, is ``training.outer_worker``
  (the trio shell) over ``training.outer_agreement`` (closures, proposer rotation, fork
  choice), ``training.outer_aggregate`` (bounded, robust aggregation) and
  ``training.outer_messages`` (announcements and the update ledger).
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
from typing import Any

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
    verify_certificate,
)
from p2p.gossip import MAX_RUN_WORKERS
from training.codec import CodecParams, ErrorFeedback
from training.errors import TrainingError
from training.outer import (
    MODE_DEFAULTS,
    OuterConfig,
    OuterState,
    initial_state,
    load_params,
    make_update,
    model_params,
    run_inner_steps,
    state_root,
    synthetic_tokens,
)
from training.outer_messages import check_run_id
from training.state_blob import encode_state

OUTER_MODE = "sparseloco"
DEFAULT_START_TIMEOUT = 300.0
# Certificates issued by the launcher start this early (clock skew) and last this long.
CERT_SKEW = 300
CERT_LIFETIME = 7 * 24 * 3600


class OuterNetError(TrainingError):
    """The run cannot go on: a bad setup (key, certificate, initial state) or a peer that
    never answered within its bound."""

    exit_code = 1


class OuterRunFailed(TrainingError):
    """A local run ended with workers that failed or roots that disagree."""

    exit_code = 1


@dataclass(frozen=True)
class RunParams:
    """What every worker of a run must be given identically."""

    run_id: str
    workers: int
    rounds: int
    inner_steps: int
    deadline: float = 8.0
    proposer_timeout: float = 3.0
    seed: int = 0
    batch: int = 8
    seq_len: int = 64
    inner_lr: float = 2e-3
    chunk: int = 4096
    # 80 of 4096 values kept per chunk: what bench/outer.py tuned (157x fewer bytes than a
    # dense float32 update; bench/figures/outer-issue-18-grid.md).
    k: int = 80
    model_size: str = "tiny"
    shard_sequences: int = 512
    # Share of each round's updates that another worker replays (training.outer_replay):
    # at 0.25 each worker replays about a quarter of an update per round (a quarter of
    # its training compute) and a cheat in 8 rounds is caught with probability 0.9.
    replay_rate: float = 0.25
    # The least time a worker gives one fetch (a closure's blobs, a state blob) on top of
    # three deadlines: dials, stream opens and slow links. It also bounds how long a
    # finished worker lingers for a missing final root and how long one with nobody
    # connected waits before it stops (training.outer_worker points 3 and 6).
    fetch_floor: float = 10.0

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.workers < 1 or self.rounds < 0 or self.inner_steps < 1 or self.deadline <= 0:
            raise ValueError("workers and inner steps must be >= 1, rounds >= 0, deadline > 0")
        if self.workers > MAX_RUN_WORKERS:
            raise ValueError(f"a run has at most {MAX_RUN_WORKERS} workers (p2p.gossip's limits)")
        if self.proposer_timeout <= 0:
            raise ValueError("the proposer timeout must be > 0")
        if not 0.0 <= self.replay_rate <= 1.0:
            raise ValueError("the replay rate must be in [0, 1]")
        if not self.fetch_floor > 0:
            raise ValueError("the fetch floor must be > 0")
        self.codec()

    def codec(self) -> CodecParams:
        return CodecParams(chunk=self.chunk, k=self.k)

    def outer_config(self) -> OuterConfig:
        mode = MODE_DEFAULTS[OUTER_MODE]
        return OuterConfig(lr=mode["outer_lr"], momentum=mode["outer_momentum"])

    @property
    def ef_decay(self) -> float:
        return MODE_DEFAULTS[OUTER_MODE]["ef_decay"]

    def shard_seed(self, shard: int) -> int:
        return self.seed * 1000 + 1 + shard


@dataclass(frozen=True)
class WorkerConfig:
    params: RunParams
    shard: int
    store_root: Path
    key_path: Path
    cert_path: Path
    authorities: tuple[bytes, ...]
    result_path: Path
    initial: str | None = None
    join: bool = False
    bootstrap: tuple[str, ...] = ()
    listen: str = "/ip4/127.0.0.1/tcp/0"
    addr_file: Path | None = None
    start_timeout: float = DEFAULT_START_TIMEOUT
    # Test hook: sleep before training in this round (so a test can kill the worker in a
    # known place mid-round).
    stall_round: int | None = None
    # Test hook: from this round on, train on other batch rows than the commitment names
    # (an update that does not match its commitment; replay must catch it).
    cheat_from_round: int | None = None
    # Name the final state blob <this peer ID>/NAME at the end (p2p/NAMES.md).
    publish: str | None = None
    # Behind NAT (issue 20): relays to reserve on when no relay can dial this worker back
    # (its own admission certificate is what the relays check), and whether a fetch may
    # cross a relay when hole punching to a NATed worker fails.
    relays: tuple[str, ...] = ()
    assume_private: bool = False
    relayed_fetch: bool = False


# --- the torch side ------------------------------------------------------------------


def outer_kernel_class() -> str:
    """The kernel class ID this process's workers run under (CPU, one thread)."""
    from training import determinism
    from training.kernel_class import detect

    determinism.enter("cpu", threads=1)
    return detect("cpu").id


class Trainer:
    """A worker's torch side: model, inner AdamW (local across rounds, as in DiLoCo),
    shard, batch sampler and error-feedback residual. Every method runs in one thread."""

    def __init__(self, params: RunParams, shard: int) -> None:
        import torch

        from training.model import make_tiny_llama

        self.params = params
        self.kernel_class = outer_kernel_class()
        self.model = make_tiny_llama(params.model_size, seed=params.seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=params.inner_lr,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            foreach=False,
            fused=False,
        )
        self.tokens = synthetic_tokens(
            params.shard_seed(shard), params.shard_sequences, params.seq_len
        )
        self.rng = np.random.default_rng([params.seed, shard])
        # Names and shapes travel once per run, in the state blob; updates carry a digest.
        self.feedback = ErrorFeedback(params.codec(), decay=params.ef_decay, schema_ref=True)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(v.shape) for name, v in model_params(self.model).items()}

    def next_rows(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The batch rows of the next round (inner steps x batch), from the sampler."""
        rows = self.tokens.shape[0]
        return np.stack(
            [
                self.rng.integers(0, rows, size=self.params.batch)
                for _ in range(self.params.inner_steps)
            ]
        )

    def train(self, state: OuterState, root: str, author: str, *, cheat: bool = False) -> Trained:
        """H inner steps from ``state`` (whose root is ``root``) on the sampler's next rows:
        the update blob (in its envelope, ``training.outer_aggregate.wrap_update``), the
        losses and what the update's commitment needs (``training.outer_replay``).
        ``cheat`` (a test hook) trains on other rows than it reports."""
        before = self.inner_state()
        rows = self.next_rows()
        used = self.next_rows() if cheat else rows
        update, losses, after = self.train_rows(state, root, author, used)
        return Trained(update, losses, rows, before, after)

    def train_rows(
        self,
        state: OuterState,
        root: str,
        author: str,
        rows: np.ndarray[Any, np.dtype[np.int64]],
    ) -> tuple[bytes, list[float], bytes]:
        """H inner steps on these batch rows: (update blob, losses, inner state after)."""
        import torch

        from training.outer_aggregate import wrap_update

        torch.set_num_threads(1)  # per OS thread under OpenMP: set in the thread that runs
        load_params(self.model, state.params)
        batches = [torch.from_numpy(self.tokens[r]) for r in rows]
        losses = run_inner_steps(self.model, self.optimizer, batches)
        payload = make_update(state.params, model_params(self.model), self.feedback)
        update = wrap_update(payload, round_=state.round, start_root=root, author=author)
        return update, losses, self.inner_state()

    def inner_state(self) -> bytes:
        """The inner AdamW moments and the error-feedback residual, canonically encoded."""
        from training.outer_replay import encode_inner

        state = self.optimizer.state_dict()["state"]
        opt: list[tuple[bytes, bytes, bytes] | None] = []
        for i, _ in enumerate(self.model.parameters()):
            entry = state.get(i)
            if not entry:
                opt.append(None)
                continue
            opt.append(
                tuple(  # type: ignore[arg-type]
                    entry[key].detach().numpy().astype("<f4").tobytes()
                    for key in ("step", "exp_avg", "exp_avg_sq")
                )
            )
        return encode_inner(opt, self.feedback.residual)

    def load_inner(self, data: bytes) -> None:
        """Adopt an inner state (``inner_state``'s bytes); BadInnerState if it does not fit."""
        import torch

        from training.outer_replay import decode_inner

        params = list(self.model.parameters())
        optimizer, residual = decode_inner(data, [p.numel() for p in params], self.shapes())
        saved = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for i, (entry, p) in enumerate(zip(optimizer, params, strict=True)):
            if entry is None:
                continue
            step, m, v = (np.frombuffer(x, dtype="<f4").astype(np.float32) for x in entry)
            state[i] = {
                "step": torch.from_numpy(step).reshape(()),
                "exp_avg": torch.from_numpy(m).reshape(p.shape),
                "exp_avg_sq": torch.from_numpy(v).reshape(p.shape),
            }
        saved["state"] = state
        self.optimizer.load_state_dict(saved)
        self.feedback.residual = residual


@dataclass(frozen=True)
class Trained:
    """One round's training: what the update commitment records (training.outer_replay)."""

    update: bytes
    losses: list[float]
    rows: np.ndarray[Any, np.dtype[np.int64]]
    inner_before: bytes
    inner_after: bytes


# --- the worker ----------------------------------------------------------------------


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temp file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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


async def run_worker(config: WorkerConfig) -> dict[str, Any]:
    """Run one worker to the end of the run; returns (and writes) its result."""
    from p2p.node import open_node

    if config.initial is None and not config.join:
        raise OuterNetError("a worker needs the initial state blob ID (--initial) or --join")
    if config.publish is not None:
        from p2p.names import check_name

        check_name(config.publish)  # a bad name is refused before any training
    key, certificate, trust = _load_identity(config)
    from p2p.nat_cli import behind_nat
    from p2p.node import NodeConfig

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
        from training.outer_worker import Worker

        result = await Worker(config, node, key, certificate, trust).run()
        if config.publish is not None and result["rounds"]:
            record = await node.publish_name(config.publish, result["rounds"][-1]["state_blob"])
            result["name"] = record.to_json()
            write_json(config.result_path, result)
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


def prepare_run(workdir: Path, params: RunParams, *, slots: int | None = None) -> RunPlan:
    """A temp authority, one key and certificate per worker slot (distinct operators), and
    the initial state blob in worker 0's store. ``slots`` (default K) may exceed K to admit
    joiners."""
    from training.model import make_tiny_llama

    workdir.mkdir(parents=True, exist_ok=True)
    authority_key = create_key_file(workdir / "authority.key")
    authority = Authority(SoftwareSigner(authority_key))
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
    """Start the K workers, each bootstrapping to every one started before it (``extra``:
    more ``blob outer worker`` options for each), and wait for them (bounded); their
    results (None for a worker that failed)."""
    env = worker_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        addrs: list[str] = []
        for i in range(plan.params.workers):
            argv = worker_argv(plan, i, bootstrap=addrs, extra=extra)
            proc = subprocess.Popen(argv, env=env, stdout=sys.stderr)
            procs.append(proc)
            addrs = addrs + wait_for_addrs(plan.workers[i].addr_file, proc, timeout=120)[:1]
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
