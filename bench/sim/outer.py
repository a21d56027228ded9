"""The outer loop at scale: K simulated workers through the real agreement code.

Each worker holds the project's own ``training.outer.messages.Ledger`` (which
announcements count), ``training.outer.agreement.ClosureBook`` (the tip), and decides with
``rank``/``proposer_order``/``proposal_time`` (who proposes when, and take-over),
``select_for_closure``, ``sign_closure``/``check_closure``, ``compact_body``/``expand_body``
and ``next_step`` (apply, catch up or stay), and re-sends its announcements by
``training.outer.announce.Announcer``. Announcements are the real canonical messages
(``encode_message``), signed by real Ed25519 keys admitted by one authority, and travel
over a simulated gossipsub mesh (bench.sim.gossip). Update blobs are opaque blobs of
the real size, fetched from their authors as a worker's node fetches them (bench.sim.fetch:
the real scheduler, peer exchange) or, with ``fetch="direct"``, by one `get` each from
the author.

What the shell does by hand (the I/O and the training of ``training.outer.worker``):

1. A round: compute for ``compute_s`` (times a jitter of +-5%), then make the update (its
   blob ID a hash of the worker, round and root), sign its attestation and announce it.
2. Every valid update heard (a ``Candidate``) is fetched from its author; the round is
   ready when the fetched updates a closure could name reach the expected count (K, or
   more when the previous round's were more: ``_expected``) or ``deadline`` after the
   worker's own announcement, and the worker proposes at its slot (``proposal_time`` of its
   place in ``proposer_order``) unless it holds a closure of the round by then.
3. A closure heard (compact) is expanded from the attestations the worker holds, or its
   full blob fetched; a valid one goes into the book; ``next_step`` says what to do:
   Apply (fetch the named updates it lacks, then the result is a hash of the start root
   and the named blobs: aggregation itself is not simulated), CatchUp (fetch the state
   blob, ``state_bytes``), or Stay.
4. Churn: at each round's start, ``churn`` of the workers leave at a random moment of that
   round and as many new ones arrive; a newcomer joins the mesh, says hello, and catches
   up from the first closure it can check (fetching the closure blob and the state blob).

Signature checks and ranks are memoised across the simulated workers
(`shared_verification`): the same bytes against the same trust store give the same verdict
in every worker (the certificates are valid over the whole run), a rank is a hash of its
inputs, and computing each once per worker would cost minutes of CPU per round at K = 256.
Each worker's ledger, book and proposer order still call them.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import blake3
import simpy.core

import training.outer.agreement as agreement_module
import training.outer.messages as messages_module
from bench.sim.fetch import Req, SimFetch, Stream, swarm_config
from bench.sim.fluid import call_later
from bench.sim.gossip import Gossip
from bench.sim.node import Blob, SimNode
from bench.sim.world import INTERNET_REGIONS, World, sim_gc
from identity import (
    Authority,
    MachineKey,
    SoftwareSigner,
    TrustStore,
    sign_attestation,
)
from p2p.fetch.striping import StripeConfig
from training.outer.agreement import (
    MAX_INCLUDED,
    Apply,
    CatchUp,
    Closure,
    ClosureBook,
    check_closure,
    compact_body,
    expand_body,
    next_step,
    proposal_time,
    proposer_order,
    quorum_of,
    select_for_closure,
    sign_closure,
)
from training.outer.announce import Announcer
from training.outer.messages import (
    UPDATE_KIND,
    Candidate,
    ClosureAnnouncement,
    ClosureRefAnnouncement,
    ClosureRefHeard,
    Hello,
    Ledger,
    Refused,
    UpdateAnnouncement,
    encode_message,
)
from training.outer.worker.fetcher import FETCH_RETRY

RUN = "sim-run"
KERNEL = "sim-kernel"
GENESIS = "00" * 32
# Wall-clock seconds the certificates and attestations say (the simulation's t = 0).
EPOCH = 1_800_000_000
MB = 1_000_000
# Other workers a fetch of a closure's blobs names besides the author and proposer (the real
# worker names every worker it heard of, up to 64; fewer keep the simulation's cost down).
MAX_EXTRA_PROVIDERS = 8


def _memoised(
    real: Callable[..., Any], key_of: Callable[[Any, dict[str, Any]], tuple[Any, ...]]
) -> Callable[..., Any]:
    """``real(arg, **kwargs)`` answered once per key: its result, or its error raised again."""
    hits: dict[tuple[Any, ...], tuple[bool, Any]] = {}

    def call(arg: Any, **kwargs: Any) -> Any:
        key = key_of(arg, kwargs)
        hit = hits.get(key)
        if hit is None:
            try:
                hit = (True, real(arg, **kwargs))
            except Exception as exc:
                hit = (False, exc)
            hits[key] = hit
        if hit[0]:
            return hit[1]
        raise hit[1]

    return call


@contextlib.contextmanager
def shared_verification() -> Iterator[None]:
    """Memoise ``verify_attestation`` and ``rank`` in the agreement modules (see the module
    docstring): pure functions, the same inputs in every simulated worker."""
    real = messages_module.verify_attestation
    real_cert = messages_module.verify_certificate
    real_rank = agreement_module.rank
    verify_cert = _memoised(
        real_cert, lambda c, kw: (c.encode(), id(kw.get("trust")), kw.get("peer_id"))
    )
    ranks: dict[tuple[str, str], bytes] = {}

    def memo_rank(start_root: str, peer: str) -> bytes:
        key = (start_root, peer)
        value = ranks.get(key)
        if value is None:
            value = ranks[key] = real_rank(start_root, peer)
        return value

    verify = _memoised(real, lambda d, kw: (bytes(d), kw.get("kind"), id(kw.get("trust"))))

    messages_module.verify_attestation = verify  # type: ignore[assignment]
    agreement_module.verify_attestation = verify  # type: ignore[assignment]
    agreement_module.rank = memo_rank  # type: ignore[assignment]
    messages_module.verify_certificate = verify_cert  # type: ignore[assignment]
    try:
        yield
    finally:
        messages_module.verify_attestation = real  # type: ignore[assignment]
        agreement_module.verify_attestation = real  # type: ignore[assignment]
        agreement_module.rank = real_rank  # type: ignore[assignment]
        messages_module.verify_certificate = real_cert  # type: ignore[assignment]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _h(*parts: str) -> str:
    return blake3.blake3("/".join(parts).encode()).hexdigest()


@dataclass
class OuterParams:
    workers: int = 16
    rounds: int = 3
    compute_s: float = 60.0
    update_bytes: int = 3 * MB
    state_bytes: int = 1000 * MB
    link_mbit: float = 100.0
    deadline: float = 8.0
    proposer_timeout: float = 3.0
    churn: float = 0.0
    # The run's quorum (rule 7: the distinct operators a closure must name); 0: a majority
    # of ``workers``. A closure names at most MAX_INCLUDED workers, so a majority of more
    # than 2 x MAX_INCLUDED - 1 workers cannot close a round: such runs must set it.
    quorum: int = 0
    fetch: str = "swarm"  # or "direct"
    # The proposal for K above MAX_INCLUDED (not the design today): each round only the
    # workers whose rank(R_r, peer) falls in the lowest `sample` / K of the range are
    # fetched, waited for and named; None: every update (the design).
    sample: int | None = None
    # Hosts as (one-way delay s, Mbit/s) in turn (bench/wan's testbed, for calibration);
    # None: three regions (world.INTERNET_REGIONS) with access delays of 2-10 ms.
    hosts: tuple[tuple[float, float], ...] | None = None
    jitter: float = 0.05  # compute time varies by this share each round
    # Seconds to aggregate a closure's updates into the next state and store it (CPU work
    # the network does not see; 0: instant). The proposer spends it before it proposes.
    apply_s: float = 0.0
    seed: int = 0
    exact_every: float = 1.0


@dataclass
class RoundLog:
    """One worker's round: when it started, announced, held the next state; its bytes."""

    worker: str
    round: int
    started: float
    announced: float | None = None
    adopted: float | None = None
    how: str = ""  # applied, caught up
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    gossip_in: int = 0
    gossip_out: int = 0
    gossip_bytes: int = 0  # in and out
    gossip_bytes_in: int = 0
    updates_fetched: int = 0


class OuterSim:
    """One run (see the module docstring)."""

    def __init__(self, params: OuterParams) -> None:
        self.p = params
        self.world = World(
            seed=params.seed,
            exact_every=params.exact_every,
            regions={} if params.hosts else INTERNET_REGIONS,
        )
        rng = self.world.rng
        self.authority = Authority(SoftwareSigner(MachineKey(rng.randbytes(32))))
        self.trust = TrustStore(frozenset({self.authority.public_key_bytes}))
        self.gossip = Gossip(self.world)
        self.workers: dict[str, OuterWorker] = {}
        self.logs: list[RoundLog] = []
        self.closures: dict[int, set[bytes]] = {}  # round -> closure digests proposed
        self.joins = 0
        self.leaves = 0
        self.top_round = -1
        self.regions = ("eu", "us", "asia")
        self.serial = 0
        self.blob_sizes: dict[str, int] = {}  # closure blobs, by ID
        self.quorum = quorum_of(params.workers, params.quorum)
        if self.quorum > MAX_INCLUDED:
            raise ValueError(
                f"a quorum of {self.quorum} operators (of {params.workers} workers) exceeds "
                f"the {MAX_INCLUDED} workers a closure can name (rule 7): set a quorum"
            )

    def now_wall(self) -> int:
        return EPOCH + int(self.world.now)

    def new_worker(self, joiner: bool = False) -> OuterWorker:
        rng = self.world.rng
        key = MachineKey(rng.randbytes(32))
        self.serial += 1
        cert = self.authority.admit(
            key.peer_id,
            operator=f"op-{self.serial}",
            kernel_class=KERNEL,
            not_before=0,
            not_after=EPOCH + 10**8,
            serial=self.serial,
        )
        region = self.regions[self.serial % 3]
        delay, mbit = rng.uniform(0.002, 0.010), self.p.link_mbit
        if self.p.hosts:
            delay, mbit = self.p.hosts[(self.serial - 1) % len(self.p.hosts)]
        host = self.world.host(
            key.peer_id, up_mbit=mbit, down_mbit=mbit, delay_s=delay, region=region
        )
        node = SimNode(self.world, key.peer_id, host)
        w = OuterWorker(self, key, cert, node, joiner=joiner)
        self.workers[w.name] = w
        return w

    def run(self, until: float | None = None) -> dict[str, Any]:
        p = self.p
        started = time.process_time()
        with shared_verification(), sim_gc():
            first = [self.new_worker() for _ in range(p.workers)]
            for w in first:
                w.join_mesh()
            for w in first:
                w.hello()  # presence (training.outer.worker point 1)
                w.start_round(0, GENESIS)
            horizon = until or (p.rounds + 2) * (p.compute_s * 1.1 + 600.0)
            env = self.world.env
            events = 0
            while events % 1000 or not self._finished():
                try:
                    if env.peek() > horizon:
                        break
                    env.step()
                except simpy.core.EmptySchedule:
                    break
                events += 1
                if not events % 1_000_000:
                    top = max((w.round for w in self.workers.values()), default=0)
                    print(
                        f"[sim] t={env.now:.0f} s, round {top}, {events} events, "
                        f"{time.process_time() - started:.0f} s CPU",
                        file=sys.stderr,
                        flush=True,
                    )
        return self.report(time.process_time() - started, events)

    def _finished(self) -> bool:
        live = [w for w in self.workers.values() if w.node.alive and not w.joining]
        return bool(live) and all(w.round >= self.p.rounds for w in live)

    def round_reached(self, r: int) -> None:
        """Some worker started round ``r``: churn for that round begins."""
        if r <= self.top_round or r >= self.p.rounds:
            return
        self.top_round = r
        if r == 0 or self.p.churn <= 0:
            return
        rng = self.world.rng
        live = [w for w in self.workers.values() if w.node.alive and not w.joining]
        count = round(self.p.churn * self.p.workers)
        span = self.p.compute_s
        for w in rng.sample(live, min(count, len(live) - 1)):
            call_later(self.world.env, rng.uniform(0.0, span), w.leave)
        for _ in range(count):
            call_later(self.world.env, rng.uniform(0.0, span), self._join)

    def _join(self) -> None:
        w = self.new_worker(joiner=True)
        self.joins += 1
        w.join_mesh()
        w.hello()

    # --- results ----------------------------------------------------------------------

    def report(self, wall: float, events: int) -> dict[str, Any]:
        p = self.p
        live = [w for w in self.workers.values() if w.node.alive]
        roots: dict[int, set[str]] = {}
        for w in live:
            for r, root in w.history.items():
                roots.setdefault(r, set()).add(root)
        forks = sum(1 for r in roots if len(roots[r]) > 1)
        floor_bytes = (p.workers - 1) * p.update_bytes
        floor_s = floor_bytes / (p.link_mbit * 1e6 / 8)
        rounds = []
        for r in range(p.rounds):
            logs = [x for x in self.logs if x.round == r and x.adopted is not None]
            applied = [x for x in logs if x.how == "applied" and x.announced is not None]
            if not applied:
                continue
            comm = [x.adopted - x.announced for x in applied]  # type: ignore[operator]
            rounds.append(
                {
                    "round": r,
                    "workers": len(applied),
                    "caught_up": sum(1 for x in logs if x.how == "caught up"),
                    "closures": len(self.closures.get(r, ())),
                    "included": _median([w.included[r] for w in live if r in w.included]),
                    "comm_s_median": statistics.median(comm),
                    "comm_s_max": max(comm),
                    "comm_over_floor": statistics.median(comm) / floor_s,
                    "bytes_in_median": statistics.median(x.bytes_in for x in applied),
                    "bytes_out_median": statistics.median(x.bytes_out for x in applied),
                    "bytes_in_over_floor": _median([x.bytes_in for x in applied]) / floor_bytes,
                    "gossip_in_median": statistics.median(x.gossip_in for x in applied),
                    "gossip_out_median": statistics.median(x.gossip_out for x in applied),
                    "gossip_bytes_median": statistics.median(x.gossip_bytes for x in applied),
                    "received_median": statistics.median(
                        x.bytes_in + x.gossip_bytes_in for x in applied
                    ),
                    "round_s": max(x.adopted for x in applied) - min(x.started for x in applied),  # type: ignore[type-var]
                    "utilisation": statistics.median(
                        p.compute_s / (x.adopted - x.started)
                        for x in applied  # type: ignore[operator]
                    ),
                }
            )
        return {
            "params": p.__dict__,
            "forks": forks,
            "rounds_with_roots": {r: len(v) for r, v in sorted(roots.items())},
            "joins": self.joins,
            "leaves": self.leaves,
            "floor_bytes": floor_bytes,
            "floor_s": floor_s,
            "max_included": MAX_INCLUDED,
            "rounds": rounds,
            "sim_end_s": self.world.now,
            "wall_s": wall,
            "events": events,
        }


class OuterWorker:
    """One simulated worker (see the module docstring)."""

    def __init__(
        self, sim: OuterSim, key: MachineKey, cert: Any, node: SimNode, *, joiner: bool
    ) -> None:
        self.sim = sim
        self.world = sim.world
        self.key = key
        self.cert = cert
        self.signer = SoftwareSigner(key)
        self.name = key.peer_id
        self.node = node
        self.ledger = Ledger(RUN, self.name, sim.trust)
        self.book = ClosureBook()
        self.announcer = Announcer()
        self.announce_at = math.inf
        self.round = -1
        self.root = ""
        self.joining = joiner
        self.own: tuple[int, str, str, bytes, float] | None = None  # round, root, blob, att, at
        self.candidates: dict[str, Candidate] = {}
        self.heard: dict[str, Candidate] = {}  # every valid update of the round, sampled or not
        self.fetched: dict[str, str] = {}
        self.fetching: set[str] = set()
        self.attestations: dict[tuple[str, str], bytes] = {}
        self.previous: dict[str, str] = {}
        self.history: dict[int, str] = {}
        self.included: dict[int, int] = {}
        self.slot_at = math.inf
        self.proposed: set[int] = set()
        self.log: RoundLog | None = None
        self.marks: tuple[float, ...] = (0.0, 0.0, 0, 0, 0, 0)
        self.adopting = False
        self.closure_blobs: dict[bytes, tuple[str, int]] = {}
        self.closures_fetching: set[str] = set()

    # --- the mesh ---------------------------------------------------------------------

    def join_mesh(self) -> None:
        self.sim.gossip.join(self.name, self.node.host, self.hear)

    def hello(self) -> None:
        self.publish("hello", encode_message(Hello(RUN, self.cert.encode())))

    def publish(self, name: str, data: bytes) -> None:
        now = self.world.now
        if self.announcer.set(name, data, now):
            self.sim.gossip.publish(self.name, data)
        self._announce_timer()

    def _announce_timer(self) -> None:
        at = self.announcer.next_due()
        if at < self.announce_at:
            self.announce_at = at
            call_later(self.world.env, at - self.world.now, self._resend, at)

    def _resend(self, at: float) -> None:
        if at != self.announce_at or not self.node.alive:
            return
        self.announce_at = math.inf
        for data in self.announcer.due(self.world.now):
            self.sim.gossip.publish(self.name, data)
        self._announce_timer()

    def leave(self) -> None:
        if not self.node.alive:
            return
        self.sim.leaves += 1
        self.sim.gossip.leave(self.name)
        self.node.leave()

    # --- rounds -----------------------------------------------------------------------

    def start_round(self, r: int, root: str) -> None:
        self.round, self.root = r, root
        self.own = None
        self.candidates = {}
        self.heard = {}
        self.fetched = {}
        self.fetching = set()
        self.slot_at = math.inf
        self.announcer.drop("update")
        self.announcer.drop("closure")
        self._mark_round(r)
        self.sim.round_reached(r)
        for event in self.ledger.open_round(r, root, self.sim.now_wall()):
            self._event(event)
        if r >= self.sim.p.rounds:
            return
        jitter = self.world.rng.uniform(1 - self.sim.p.jitter, 1 + self.sim.p.jitter)
        call_later(self.world.env, self.sim.p.compute_s * jitter, self._trained, r, root)

    def _mark_round(self, r: int) -> None:
        host = self.node.host
        stats = self.sim.gossip.stats_of.get(self.name)
        g = (0, 0, 0, 0)
        if stats is not None:
            g = (
                stats.received,
                stats.sent + stats.control,
                stats.bytes_in + stats.bytes_out,
                stats.bytes_in,
            )
        if self.log is not None:
            self.log.bytes_in = host.down.sent - self.marks[0]
            self.log.bytes_out = host.up.sent - self.marks[1]
            self.log.gossip_in = g[0] - self.marks[2]
            self.log.gossip_out = g[1] - self.marks[3]
            self.log.gossip_bytes = g[2] - self.marks[4]
            self.log.gossip_bytes_in = g[3] - self.marks[5]
            self.log.updates_fetched = len(self.fetched) - 1
        self.marks = (host.down.sent, host.up.sent, *g)
        if r < self.sim.p.rounds:
            self.log = RoundLog(self.name, r, self.world.now)
            self.sim.logs.append(self.log)

    def _trained(self, r: int, root: str) -> None:
        if (self.round, self.root) != (r, root) or not self.node.alive:
            return
        blob = _h(self.name, str(r), root)
        attestation = sign_attestation(
            self.signer,
            kind=UPDATE_KIND,
            digest=bytes.fromhex(blob),
            kernel_class=KERNEL,
            subjects=[blob, root, _h("commitment", blob)],
            time=self.sim.now_wall(),
            certificate=self.cert,
        ).encode()
        self.node.seed(Blob(blob, self.sim.p.update_bytes, 1 << 20))
        now = self.world.now
        self.own = (r, root, blob, attestation, now)
        if self.log is not None:
            self.log.announced = now
        self.fetched[self.name] = blob
        self.attestations[(self.name, blob)] = attestation
        addrs = (f"/ip4/{self.name}/tcp/1/p2p/{self.name}",)
        self.publish("update", encode_message(UpdateAnnouncement(RUN, r, blob, attestation, addrs)))
        self._ready()

    # --- hearing ------------------------------------------------------------------------

    def hear(self, data: bytes, sender: str) -> None:
        if not self.node.alive:
            return
        for event in self.ledger.hear(data, sender, self.sim.now_wall()):
            self._event(event)

    def _event(self, event: Any) -> None:
        if isinstance(event, Candidate):
            self.attestations[(event.peer, event.blob)] = event.attestation
            if event.round == self.round:
                self.heard[event.peer] = event
            if event.round == self.round and not self.joining and self._sampled(event.peer):
                self.candidates[event.peer] = event
                self._fetch_update(event)
        elif isinstance(event, ClosureRefHeard):
            self._closure_ref(event)

    def _fetch_update(self, c: Candidate, providers: tuple[str, ...] = ()) -> None:
        """Fetch an update from its author (``providers``: others to ask too)."""
        if c.peer in self.fetching or c.peer in self.fetched:
            return
        self.fetching.add(c.peer)
        r, root = self.round, self.root

        def done() -> None:
            if (self.round, self.root) == (r, root):
                self.fetched[c.peer] = c.blob
                self._ready()
                self._try_apply()

        self._fetch(Blob(c.blob, self.sim.p.update_bytes, 1 << 20), [c.peer, *providers], done)

    def _fetch(self, blob: Blob, providers: list[str], done: Any) -> None:
        """Fetch ``blob`` naming ``providers`` (the live ones), then ``done()``."""
        if self.node.complete(blob):
            call_later(self.world.env, 0.0, done)
            return
        nodes = self.world.nodes
        named = [p for p in dict.fromkeys(providers) if p in nodes and nodes[p].alive]
        if self.sim.p.fetch == "direct":
            holders = [p for p in named if nodes[p].complete(blob)]
            if holders:
                _DirectFetch(self, blob, holders[0], done).start()
            return
        if not named:
            return

        def failed(_: SimFetch) -> None:
            # training.outer.worker_blobs rule 2: tried again after FETCH_RETRY.
            if self.node.alive:
                call_later(self.world.env, FETCH_RETRY, self._fetch, blob, providers, done)

        fetch = SimFetch(
            self.node,
            blob,
            named,
            config=swarm_config(),
            stripes=StripeConfig(),
            on_done=lambda f: done(),
            on_failed=failed,
        )
        fetch.start()

    # --- proposing ----------------------------------------------------------------------

    def _sampled(self, peer: str) -> bool:
        """Whether ``peer``'s update is this round's to fetch (every one without a sample)."""
        sample = self.sim.p.sample
        if sample is None:
            return True
        share = min(1.0, sample / self.sim.p.workers)
        return int.from_bytes(agreement_module.rank(self.root, peer)[:8], "big") < share * 2.0**64

    def _nameable(self) -> int:
        return sum(
            1
            for peer, blob in self.fetched.items()
            if (peer == self.name and self._sampled(peer))
            or (peer in self.candidates and self.candidates[peer].blob == blob)
        )

    def _expected(self) -> int:
        if self.sim.p.sample is not None:
            # The round's sample among the workers known present (and this one).
            known = {*self.ledger.present, *self.candidates, self.name}
            return sum(1 for peer in known if self._sampled(peer))
        late = self.ledger.late.get(self.round - 1, {})
        heard = {**late, **self.previous}
        heard.setdefault(self.name, "")
        return max(self.sim.p.workers, len(heard))

    def _ready(self) -> None:
        own = self.own
        if own is None or (own[0], own[1]) != (self.round, self.root) or self.joining:
            return
        now = self.world.now
        ready = own[4] + self.sim.p.deadline
        if self._nameable() >= self._expected():
            ready = min(ready, now)
        ranked = proposer_order(self.root, [*self.candidates, self.name])
        slot = proposal_time(ready, ranked.index(self.name), self.sim.p.proposer_timeout)
        if slot != self.slot_at:
            self.slot_at = slot
            call_later(self.world.env, max(0.0, slot - now), self._propose, slot)

    def _propose(self, slot: float) -> None:
        if slot != self.slot_at or not self.node.alive or self.round in self.proposed:
            return
        own = self.own
        if own is None or self.book.has_round(self.round, self.root):
            return
        self.proposed.add(self.round)
        if self.sim.p.apply_s > 0:
            # The proposer aggregates before it signs (training.outer.worker_propose).
            r, root = self.round, self.root
            call_later(self.world.env, self.sim.p.apply_s, self._propose_now, r, root)
            return
        self._propose_now(self.round, self.root)

    def _propose_now(self, r: int, root: str) -> None:
        own = self.own
        if (self.round, self.root) != (r, root) or own is None or not self.node.alive:
            return
        if self.book.has_round(self.round, self.root):
            return
        updates = {self.name: (own[2], own[3])} if self._sampled(self.name) else {}
        for peer, blob in self.fetched.items():
            c = self.candidates.get(peer)
            if c is not None and c.blob == blob:
                updates[peer] = (blob, c.attestation)
        # Every other valid update heard is named as left out (rule 1: its author was
        # present), so the closure counts towards the quorum (rule 7) whoever was fetched.
        left = {}
        if own[2] not in (blob for blob, _ in updates.values()):
            left[self.name] = (own[2], own[3], "not in the round's sample")
        for peer, c in self.heard.items():
            if peer not in updates and peer != self.name:
                why = "not fetched in time" if self._sampled(peer) else "not in the round's sample"
                left[peer] = (c.blob, c.attestation, why)
        included, out, passed = select_for_closure(updates, left)
        if len(included) + len(out) + len(passed) < self.sim.quorum:
            return  # below the quorum: no proposal (a later proposer takes over)
        result = _h("result", self.root, *(x.blob for x in included))
        state = _h("state", result)
        closure = Closure(
            RUN, self.round, self.root, self.name, included, result, state, out, passed
        )
        body, attestation = sign_closure(
            self.signer,
            closure,
            kernel_class=KERNEL,
            certificate=self.cert,
            time=self.sim.now_wall(),
        )
        checked = check_closure(
            body,
            attestation,
            run=RUN,
            trust=self.sim.trust,
            now=self.sim.now_wall(),
            quorum=self.sim.quorum,
        )
        self.sim.closures.setdefault(self.round, set()).add(checked.digest)
        self.book.add(checked)
        full = encode_message(ClosureAnnouncement(RUN, body, attestation, ()))
        full_id = blake3.blake3(full).hexdigest()
        self.node.seed(Blob(full_id, len(full), 1 << 20))
        self.sim.blob_sizes[full_id] = len(full)
        addrs = (f"/ip4/{self.name}/tcp/1/p2p/{self.name}",)
        ref = ClosureRefAnnouncement(RUN, compact_body(body), attestation, full_id, addrs)
        self.closure_blobs[checked.digest] = (full_id, len(full))
        self.publish("closure", encode_message(ref))
        self._step()

    # --- closures -----------------------------------------------------------------------

    def _closure_ref(self, event: ClosureRefHeard) -> None:
        msg = event.message

        def lookup(peer: str, blob: str) -> bytes | None:
            return self.attestations.get((peer, blob))

        try:
            body = expand_body(msg.compact, lookup)
        except Exception:
            return
        if body is not None:
            self._closure(body, msg.attestation)
            return
        # Missing an attestation (a newcomer): fetch the full closure blob from its proposer.
        author = msg.addrs[0].rsplit("/p2p/", 1)[-1] if msg.addrs else event.peer
        target = self.sim.workers.get(author)
        size = self.sim.blob_sizes.get(msg.full)
        if target is None or size is None or msg.full in self.closures_fetching:
            return
        self.closures_fetching.add(msg.full)

        def fetched() -> None:
            full = target.closure_full(msg.full)
            if full is not None:
                self._closure(*full)

        self._fetch(Blob(msg.full, size, 1 << 20), [author, event.peer], fetched)

    def closure_full(self, full_id: str) -> tuple[bytes, bytes] | None:
        for digest, (fid, _) in self.closure_blobs.items():
            if fid == full_id:
                for siblings in self.book.by_round.values():
                    if digest in siblings:
                        c = siblings[digest]
                        return c.body, c.attestation
        return None

    def _closure(self, body: bytes, attestation: bytes) -> None:
        if not self.node.alive:
            return
        try:
            checked = check_closure(
                body,
                attestation,
                run=RUN,
                trust=self.sim.trust,
                now=self.sim.now_wall(),
                quorum=self.sim.quorum,
            )
        except Refused:
            return
        for x in (*checked.closure.included, *checked.closure.left):
            self.attestations[(x.peer, x.blob)] = x.attestation
        if self.book.add(checked):
            self._step()

    def _step(self) -> None:
        if self.adopting:
            return
        step = next_step(self.book, self.round, self.root)
        if isinstance(step, Apply):
            self._try_apply()
        elif isinstance(step, CatchUp):
            self._catch_up(step.closure)

    def _try_apply(self) -> None:
        step = next_step(self.book, self.round, self.root)
        if not isinstance(step, Apply) or self.adopting:
            return
        c = step.closure.closure
        missing = [x for x in c.included if self.fetched.get(x.peer) != x.blob]
        for x in missing:
            if x.peer not in self.fetching:
                cand = Candidate(c.round, x.peer, x.blob, (), "", x.attestation)
                self.candidates.setdefault(x.peer, cand)
                # A closure's blobs: from its author, its proposer, then other workers
                # (training.outer.worker_blobs rule 3).
                self._fetch_update(cand, (c.proposer, *self._others(MAX_EXTRA_PROVIDERS)))
        if missing:
            return
        self.included[c.round] = len(c.included)
        self.previous = {x.peer: x.blob for x in c.included}
        if self.sim.p.apply_s > 0 and c.proposer != self.name:
            self.adopting = True  # aggregating (the proposer did before it proposed)

            def done() -> None:
                self.adopting = False
                if self.node.alive and (self.round, self.root) == (c.round, c.start_root):
                    self._adopt(c.round, c.result_root, c.state_blob, "applied")

            call_later(self.world.env, self.sim.p.apply_s, done)
            return
        self._adopt(c.round, c.result_root, c.state_blob, "applied")

    def _catch_up(self, checked: Any) -> None:
        c = checked.closure
        self.adopting = True
        blob = Blob(c.state_blob, self.sim.p.state_bytes, 1 << 20)
        # The proposer first, then other workers (training.outer.worker_blobs rule 3).
        providers = [c.proposer, *self._others(MAX_EXTRA_PROVIDERS)]

        def fetched() -> None:
            self.adopting = False
            if self.node.alive:
                self.previous = {x.peer: x.blob for x in c.included}
                self._adopt(c.round, c.result_root, c.state_blob, "caught up")

        self._fetch(blob, providers, fetched)

    def _others(self, count: int) -> list[str]:
        """Up to ``count`` other live workers (a worker asks every worker it heard of)."""
        live = [n for n, w in self.sim.workers.items() if w.node.alive and n != self.name]
        return self.world.rng.sample(live, min(count, len(live)))

    def _adopt(self, r: int, result: str, state_blob: str, how: str) -> None:
        self.history[r] = result
        if self.log is not None and self.log.round == r:
            self.log.adopted = self.world.now
            self.log.how = how
        elif how == "caught up":
            self.sim.logs.append(RoundLog(self.name, r, self.world.now, None, self.world.now, how))
        self.node.seed(Blob(state_blob, self.sim.p.state_bytes, 1 << 20))
        if self.joining:
            self.joining = False
            self.hello()
        self.start_round(r + 1, result)
        self._step()


class _DirectFetch:
    """One `get` of a whole blob from its author (``OuterParams.fetch == "direct"``)."""

    def __init__(self, worker: OuterWorker, blob: Blob, author: str, done: Any) -> None:
        self.w = worker
        self.blob = blob
        self.author = author
        self.done = done
        self.got = 0

    def start(self) -> None:
        node = self.w.node
        target = self.w.world.nodes.get(self.author)
        if target is None or not target.alive:
            return
        if self.author in node.connected:
            self._ask(target)
            return
        delay = self.w.world.dial_s(node.host, target.host)

        def dialled() -> None:
            if node.alive and target.alive:
                node.connected.add(target.name)
                target.connected.add(node.name)
                self._ask(target)

        call_later(self.w.world.env, delay, dialled)

    def _ask(self, target: SimNode) -> None:
        fake = _Owner(self.w.node)
        stream = Stream(fake, target, 0, self._answer)  # type: ignore[arg-type]
        stream.on_chunk = self._chunk
        self.stream = stream
        stream.send(Req("get", self.blob, tuple(range(self.blob.num_chunks))))

    def _chunk(self, req: Req, index: int, nbytes: int, bad: bool) -> None:
        self.w.node.add_chunk(self.blob, index)

    def _answer(self, req: Req, kind: str, *args: Any) -> None:
        self.stream.reset()
        if kind == "end" and self.w.node.complete(self.blob):
            self.done()
        elif kind == "busy":
            call_later(self.w.world.env, 0.2, self._ask, self.stream.server)


@dataclass
class _Owner:
    """What a `Stream` needs of its fetch: the node and the world."""

    node: SimNode
    world: World = field(init=False)

    def __post_init__(self) -> None:
        self.world = self.node.world
