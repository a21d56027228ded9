"""The decentralised DiLoCo outer loop over blobnet nodes: one worker, and a local launcher.

Theory of operation
-------------------
A run is K workers, each a process with its own blobnet node, store and machine key,
admitted by the run's authority, that agree on a global state S_r round after round.

1. Every worker is given the same :class:`RunParams` (run ID, K, rounds, inner steps,
   deadline, seed, codec and model size; the outer optimiser is
   ``MODE_DEFAULTS["sparseloco"]``). S_0 is made once, by the launcher, and named by its
   state blob ID (``training.state_blob``): nobody re-derives a random init.
2. Announcements go over floodsub on ``blobnet/outer/<run ID>`` in a star around worker 0,
   the hub, which every other worker bootstraps to (every subscriber relays). The hub is a
   single point of failure for announcements, not for data: blobs are fetched from their
   announcer and from any connected peer that has them, and blobnet verifies every chunk.
3. Once ready to train (torch loaded, S_0 fetched and checked) a worker announces
   ``hello`` (with its certificate) every second for the rest of the run, and starts
   round 0 once K admitted workers, itself included, have said so (or after the start
   timeout, with whoever has): the deadline then only has to cover the spread of round
   times, not of process start-up.
4. Round r, from S_r with root R_r: H inner steps on its own shard (torch on one thread, in
   a worker thread so the node keeps serving), the SparseLoCo update through its
   error-feedback residual, put as a blob, attested (kind ``blobnet/outer-update``,
   digest = blob ID, subjects = [blob, R_r], its kernel class and certificate) and
   announced, re-published every second until the round closes.
5. The round closes as soon as updates of K distinct workers (its own included) are
   fetched and decoded, or at the deadline: ``deadline`` seconds after its own
   announcement. Stragglers and dropouts are left out; the round still completes.
   Which announcements count is the :class:`~training.outer_messages.Ledger`'s job (its
   rules 1-6); an update whose blob does not decode against S_r's shapes is rejected.
6. S_{r+1} = ``apply_round(S_r, included)``: the mean in ascending peer-ID order and an
   elementwise float32 outer step, so workers that included the same set reach the same
   bits. Its root and state blob (whose ID is then the same too) are attested (kind
   ``blobnet/outer-state``) and announced until the next state. The roots heard from the
   others are compared with our own; a difference is printed on stderr as a line starting
   ``DISAGREE`` and recorded in the result.
7. Agreement is checked, not enforced: an update that reaches some workers before their
   deadline and others after it, or an announcer that dies when only some workers have
   its blob, splits the included sets and so the roots; rule 6 makes that loud. Workers
   that fetched a blob serve it (peers connected through the hub are asked ``have``),
   which narrows the second case.
8. A worker started with ``join`` waits for a state announcement, then for the next one
   (a round boundary, so it starts that round with the others), fetches that state blob,
   checks its round and root against the announcement, and takes part from that round.
   It says hello only then (it is not part of the start barrier), and counts towards K in
   place of a dropout; with more than K live workers, the first K updates close a round
   and the extra one may split it (rule 7).
9. After the last round a worker keeps announcing until it has heard the final root of
   every worker it included in the last round (bounded by the deadline), plus a short
   grace so the others hear ours, then writes its result file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from blobstore import Store, StoreError
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
    sign_attestation,
    verify_certificate,
)
from training.codec import F32, CodecError, CodecParams, ErrorFeedback
from training.errors import TrainingError
from training.outer import (
    MODE_DEFAULTS,
    OuterConfig,
    OuterState,
    apply_round,
    decode_update,
    initial_state,
    load_params,
    make_update,
    model_params,
    run_inner_steps,
    state_root,
    synthetic_tokens,
)
from training.outer_messages import (
    STATE_KIND,
    UPDATE_KIND,
    Candidate,
    Disagreement,
    Event,
    Hello,
    Ledger,
    Rejection,
    StateAnnouncement,
    StateHeard,
    UpdateAnnouncement,
    check_run_id,
    encode_message,
    topic,
)
from training.state_blob import decode_state, encode_state

if TYPE_CHECKING:
    from p2p.node import Node

OUTER_MODE = "sparseloco"
# Announcements are re-published this often so late subscribers hear them (floodsub
# keeps no history); receivers deduplicate.
REPUBLISH_INTERVAL = 1.0
# After the last round: time for the others to hear our final root once we heard theirs.
FINAL_GRACE = 2.0
# A fetch that failed (peer busy, connection lost) is tried again after this pause.
FETCH_RETRY = 0.5
# A fetch attempt with no progress for this long is abandoned and tried again.
FETCH_STALL = 20.0
# How often a worker checks that it is still connected to its bootstrap peers (the hub):
# announcements only reach it through them.
RECONNECT_INTERVAL = 5.0
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
    seed: int = 0
    batch: int = 8
    seq_len: int = 64
    inner_lr: float = 2e-3
    chunk: int = 4096
    k: int = 48
    model_size: str = "tiny"
    shard_sequences: int = 512

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.workers < 1 or self.rounds < 0 or self.inner_steps < 1 or self.deadline <= 0:
            raise ValueError("workers and inner steps must be >= 1, rounds >= 0, deadline > 0")
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
        self.feedback = ErrorFeedback(params.codec(), decay=params.ef_decay)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(v.shape) for name, v in model_params(self.model).items()}

    def train(self, state: OuterState) -> tuple[bytes, list[float]]:
        """H inner steps from ``state``; the encoded update and the losses."""
        import torch

        torch.set_num_threads(1)  # per OS thread under OpenMP: set in the thread that runs
        load_params(self.model, state.params)
        rows = self.tokens.shape[0]
        batches = [
            torch.from_numpy(self.tokens[self.rng.integers(0, rows, size=self.params.batch)])
            for _ in range(self.params.inner_steps)
        ]
        losses = run_inner_steps(self.model, self.optimizer, batches)
        return make_update(state.params, model_params(self.model), self.feedback), losses


# --- the worker ----------------------------------------------------------------------


@dataclass
class RoundRecord:
    round: int
    start_root: str
    root: str = ""
    state_blob: str = ""
    included: list[dict[str, str]] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    missing: list[dict[str, str]] = field(default_factory=list)
    closed_by: str = ""
    mean_loss: float = float("nan")
    update_bytes: int = 0
    state_bytes: int = 0
    seconds: float = 0.0


def _say(label: str, text: str) -> None:
    print(f"outer[{label}] {text}", file=sys.stderr, flush=True)


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temp file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Worker:
    """One worker's I/O shell around its :class:`Ledger` (rules 3-9 of the module)."""

    def __init__(
        self,
        config: WorkerConfig,
        node: Node,
        key: MachineKey,
        certificate: AdmissionCertificate,
        trust: TrustStore,
    ) -> None:
        self.config = config
        self.params = config.params
        self.node = node
        self.signer = SoftwareSigner(key)
        self.certificate = certificate
        self.peer = node.peer_id
        self.label = f"{config.shard} {self.peer[-6:]}"
        self.topic = topic(self.params.run_id)
        self.ledger = Ledger(self.params.run_id, self.peer, trust)
        self.announcements: dict[str, bytes] = {}
        self.changed = trio.Event()
        self.candidates: dict[int, list[Candidate]] = {}
        self.fetching: tuple[int, trio.Nursery] | None = None
        self.decoded: dict[str, dict[str, F32]] = {}
        self.fetched_blobs: dict[str, str] = {}
        self.state: OuterState | None = None
        self.disagreements: list[Disagreement] = []
        self.records: list[RoundRecord] = []
        self.joined_at: int | None = None
        self.start_blob = ""
        self.kernel_class = ""

    # --- messages in and out ---------------------------------------------------------
    async def _receive_loop(self, sub: Any) -> None:
        from libp2p.peer.id import ID

        while True:
            msg = await sub.get()
            try:
                sender = ID(msg.from_id).to_base58()
            except Exception:  # a malformed source field: not a message we can judge
                continue
            self._handle(self.ledger.hear(msg.data, sender, time.time()))

    def _handle(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Candidate):
                self.candidates.setdefault(event.round, []).append(event)
                if self.fetching is not None and self.fetching[0] == event.round:
                    self.fetching[1].start_soon(self._fetch_update, event)
            elif isinstance(event, Rejection):
                _say(
                    self.label,
                    f"round {event.round}: rejected update {event.blob[:12]} from "
                    f"{event.peer}: {event.reason}",
                )
            elif isinstance(event, Disagreement):
                self.disagreements.append(event)
                print(
                    f"DISAGREE run {self.params.run_id} state round {event.round}: "
                    f"{event.peer} has root {event.theirs}, this worker ({self.peer}) has "
                    f"{event.ours}",
                    file=sys.stderr,
                    flush=True,
                )
        if events:
            self.changed.set()

    async def _announce(self, name: str, data: bytes) -> None:
        self.announcements[name] = data
        await self._publish(data)

    async def _publish(self, data: bytes) -> None:
        try:
            await self.node.publish(self.topic, data)
        except Exception as exc:  # libp2p raises many types; an announcement is retried
            _say(self.label, f"publish failed (retrying): {exc!r}")

    async def _republish_loop(self) -> None:
        while True:
            await trio.sleep(REPUBLISH_INTERVAL)
            for data in list(self.announcements.values()):
                await self._publish(data)

    async def _reconnect_loop(self) -> None:
        from p2p.errors import P2PError

        while True:
            await trio.sleep(RECONNECT_INTERVAL)
            connected = set(self.node.connected_peers())
            for addr in self.config.bootstrap:
                if addr.rsplit("/p2p/", 1)[-1] not in connected:
                    try:
                        await self.node.connect(addr)
                        _say(self.label, f"reconnected to {addr}")
                    except P2PError as exc:
                        _say(self.label, f"bootstrap peer unreachable (retrying): {exc}")

    async def _wait_changed(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self.changed.wait()
        self.changed = trio.Event()

    # --- blobs -----------------------------------------------------------------------
    async def _fetch_bytes(self, blob: str, providers: Sequence[str], deadline: float) -> bytes:
        """The blob's bytes, fetched (and verified) if not local; retried until deadline."""
        from p2p.errors import P2PError

        with trio.move_on_at(deadline):
            while True:
                # An attempt that makes no progress for FETCH_STALL seconds is abandoned
                # and retried (a peer or connection that hangs must not hang the round).
                with trio.move_on_after(FETCH_STALL) as attempt:

                    def progressed(_: object, attempt: trio.CancelScope = attempt) -> None:
                        attempt.deadline = trio.current_time() + FETCH_STALL

                    try:
                        await self.node.fetch(
                            blob, providers=list(providers), progress=progressed, announce=False
                        )
                        path = self.node.store.path(blob)
                        return await trio.to_thread.run_sync(path.read_bytes)
                    except (P2PError, StoreError, OSError, trio.BrokenResourceError) as exc:
                        _say(self.label, f"fetch {blob[:12]} failed (retrying): {exc}")
                if attempt.cancelled_caught:
                    _say(self.label, f"fetch {blob[:12]} stalled (retrying)")
                await trio.sleep(FETCH_RETRY)
        raise OuterNetError(f"could not fetch blob {blob} from {', '.join(providers)} in time")

    async def _fetch_update(self, candidate: Candidate) -> None:
        state = self.state
        assert state is not None
        try:
            data = await self._fetch_bytes(candidate.blob, candidate.addrs, float("inf"))
            update = await trio.to_thread.run_sync(decode_update, data, state)
        except CodecError as exc:
            self.ledger.reject(candidate.round, candidate.peer, candidate.blob, "undecodable")
            _say(self.label, f"update {candidate.blob[:12]} from {candidate.peer}: {exc}")
            return
        if state is self.state and candidate.peer not in self.decoded:
            self.decoded[candidate.peer] = update
            self.fetched_blobs[candidate.peer] = candidate.blob
            self.changed.set()

    # --- rounds ----------------------------------------------------------------------
    async def _round(self, trainer: Trainer, state: OuterState) -> OuterState:
        r = state.round
        started = trio.current_time()
        root = state_root(state)
        record = RoundRecord(r, root)
        self.state = state
        self.decoded = {}
        self.fetched_blobs = {}
        self._handle(self.ledger.open_round(r, root, time.time()))
        async with trio.open_nursery() as fetches:
            self.fetching = (r, fetches)
            for candidate in list(self.candidates.get(r, [])):
                fetches.start_soon(self._fetch_update, candidate)
            if self.config.stall_round == r:
                _say(self.label, f"round {r}: stalling (test hook)")
                await trio.sleep_forever()
            update, losses = await trio.to_thread.run_sync(trainer.train, state)
            blob = await self.node.add_bytes(update)
            self.decoded[self.peer] = await trio.to_thread.run_sync(decode_update, update, state)
            self.fetched_blobs[self.peer] = blob
            attestation = sign_attestation(
                self.signer,
                kind=UPDATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=self.kernel_class,
                subjects=[blob, root],
                time=int(time.time()),
                certificate=self.certificate,
            )
            announcement = UpdateAnnouncement(
                self.params.run_id, r, blob, attestation.encode(), tuple(self.node.addrs)
            )
            await self._announce("update", encode_message(announcement))
            deadline = trio.current_time() + self.params.deadline
            while True:
                if len(self.decoded) >= self.params.workers:
                    record.closed_by = "all"
                    break
                if trio.current_time() >= deadline:
                    record.closed_by = "deadline"
                    break
                await self._wait_changed(deadline)
            fetches.cancel_scope.cancel()
        self.fetching = None
        self.announcements.pop("update", None)
        included = dict(self.decoded)
        following = await trio.to_thread.run_sync(
            apply_round, state, included, self.params.outer_config()
        )
        record.root = state_root(following)
        record.included = [{"peer": p, "blob": self.fetched_blobs[p]} for p in sorted(included)]
        record.rejected = [x.to_json() for x in self.ledger.rejections(r)]
        record.missing = [
            {"peer": c.peer, "blob": c.blob}
            for c in self.candidates.pop(r, [])
            if c.peer not in included
        ]
        record.mean_loss = float(np.mean(losses))
        record.update_bytes = len(update)
        await self._publish_state(following, record)
        record.seconds = trio.current_time() - started
        self.records.append(record)
        _say(
            self.label,
            f"round {r}: {len(included)}/{self.params.workers} updates ({record.closed_by}), "
            f"{len(record.rejected)} rejected, loss {record.mean_loss:.4f}, "
            f"root {record.root[:16]}",
        )
        return following

    async def _publish_state(self, state: OuterState, record: RoundRecord) -> None:
        data = await trio.to_thread.run_sync(encode_state, state)
        blob = await self.node.add_bytes(data)
        root = state_root(state)
        record.state_blob = blob
        record.state_bytes = len(data)
        attestation = sign_attestation(
            self.signer,
            kind=STATE_KIND,
            digest=bytes.fromhex(blob),
            kernel_class=self.kernel_class,
            subjects=[blob, root],
            time=int(time.time()),
            certificate=self.certificate,
        )
        announcement = StateAnnouncement(
            self.params.run_id,
            state.round,
            root,
            blob,
            attestation.encode(),
            tuple(self.node.addrs),
        )
        await self._announce("state", encode_message(announcement))
        self._handle(self.ledger.own_root(state.round, root))

    # --- start, join, finish ---------------------------------------------------------
    async def _barrier(self) -> None:
        need = self.params.workers - 1
        with trio.move_on_after(self.config.start_timeout):
            while len(self.ledger.present) < need:
                await self._wait_changed(trio.current_time() + REPUBLISH_INTERVAL)
            return
        _say(self.label, f"start timeout: {len(self.ledger.present) + 1} workers present")

    async def _initial(self, shapes: dict[str, tuple[int, ...]]) -> OuterState:
        initial = self.config.initial
        assert initial is not None
        self.start_blob = initial
        deadline = trio.current_time() + self.config.start_timeout
        data = await self._fetch_bytes(initial, self.config.bootstrap, deadline)
        return await trio.to_thread.run_sync(lambda: decode_state(data, expected=shapes))

    async def _join(self, shapes: dict[str, tuple[int, ...]]) -> OuterState:
        """Rule 8: adopt the state announced at the next round boundary."""
        deadline = trio.current_time() + self.config.start_timeout
        while self.ledger.latest_state is None and trio.current_time() < deadline:
            await self._wait_changed(deadline)
        if self.ledger.latest_state is None:
            raise OuterNetError("joining: heard no state announcement from an admitted worker")
        first = self.ledger.latest_state.round
        _say(self.label, f"joining: heard state round {first}; waiting for the next")
        while first < self.params.rounds and trio.current_time() < deadline:
            if self.ledger.latest_state.round > first:
                break
            await self._wait_changed(deadline)
        heard: StateHeard = self.ledger.latest_state
        self.start_blob = heard.blob
        data = await self._fetch_bytes(heard.blob, heard.addrs, deadline)
        state = await trio.to_thread.run_sync(lambda: decode_state(data, expected=shapes))
        if state.round != heard.round or state_root(state) != heard.root:
            raise OuterNetError(
                f"state blob {heard.blob} from {heard.peer} is not the announced state "
                f"(round {state.round}, root {state_root(state)})"
            )
        self.joined_at = state.round
        self.ledger.current = state.round
        self._handle(self.ledger.own_root(state.round, heard.root))
        _say(self.label, f"joined at round {state.round} (root {heard.root[:16]})")
        return state

    async def _finish(self, state: OuterState) -> None:
        """Rule 9: hear the final roots of the last round's workers, then a grace."""
        last = self.records[-1] if self.records else None
        expected = {x["peer"] for x in last.included} - {self.peer} if last else set()
        deadline = trio.current_time() + self.params.deadline
        while trio.current_time() < deadline:
            if expected <= set(self.ledger.roots_heard(state.round)):
                break
            await self._wait_changed(deadline)
        await trio.sleep(FINAL_GRACE)

    async def run(self) -> dict[str, Any]:
        sub = await self.node.subscribe(self.topic)
        if self.config.addr_file is not None:
            _write_json(self.config.addr_file, {"peer_id": self.peer, "addrs": self.node.addrs})
        hello = Hello(self.params.run_id, self.certificate.encode())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop, sub)
            nursery.start_soon(self._republish_loop)
            nursery.start_soon(self._reconnect_loop)
            trainer = await trio.to_thread.run_sync(Trainer, self.params, self.config.shard)
            self.kernel_class = trainer.kernel_class
            if self.certificate.kernel_class != self.kernel_class:
                raise OuterNetError(
                    f"this machine's kernel class is {self.kernel_class}, but its certificate "
                    f"admits {self.certificate.kernel_class}; get a certificate for this one"
                )
            shapes = trainer.shapes()
            _say(self.label, f"model ready (kernel class {self.kernel_class})")
            if self.config.join:
                state = await self._join(shapes)
                await self._announce("hello", encode_message(hello))
            else:
                state = await self._initial(shapes)
                self._handle(self.ledger.own_root(state.round, state_root(state)))
                await self._announce("hello", encode_message(hello))
                await self._barrier()
            initial_root = state_root(state)
            _say(self.label, f"starting at round {state.round} (root {initial_root[:16]})")
            while state.round < self.params.rounds:
                state = await self._round(trainer, state)
            await self._finish(state)
            nursery.cancel_scope.cancel()
        final_root = state_root(state)
        heard = self.ledger.roots_heard(state.round)
        result = {
            "run": self.params.run_id,
            "params": asdict(self.params),
            "peer_id": self.peer,
            "shard": self.config.shard,
            "operator": self.certificate.operator,
            "kernel_class": self.kernel_class,
            "joined_at": self.joined_at,
            "initial_root": initial_root,
            "start_state_blob": self.start_blob,
            "rounds": [asdict(r) for r in self.records],
            "final_round": state.round,
            "final_root": final_root,
            "final_roots_heard": heard,
            "disagreements": [d.to_json() for d in self.disagreements],
            "agreed": not self.disagreements and all(v == final_root for v in heard.values()),
            "malformed_messages": self.ledger.malformed,
        }
        _write_json(self.config.result_path, result)
        return result


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
    key, certificate, trust = _load_identity(config)
    async with open_node(
        config.store_root,
        key=key,
        listen=[config.listen],
        bootstrap=list(config.bootstrap),
        dht=False,
        pubsub=True,
    ) as node:
        return await Worker(config, node, key, certificate, trust).run()


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


def run_local(plan: RunPlan, *, timeout: float) -> list[dict[str, Any] | None]:
    """Start the K workers (worker 0 the hub), wait for them (bounded); their results
    (None for a worker that failed)."""
    env = worker_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        hub = subprocess.Popen(worker_argv(plan, 0), env=env, stdout=sys.stderr)
        procs.append(hub)
        addrs = wait_for_addrs(plan.workers[0].addr_file, hub, timeout=120)
        for i in range(1, plan.params.workers):
            argv = worker_argv(plan, i, bootstrap=addrs)
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
                "rejected": [len(x["rejected"]) for x in recs],
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
