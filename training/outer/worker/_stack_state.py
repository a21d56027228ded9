"""What every part of a worker shares: its state, the record it keeps of each round, and
what it shows (``blob status``, the metrics).

:class:`WorkerState` is the base of :class:`training.outer.worker.Worker`; the theory of
operation it serves is stated in :mod:`training.outer.worker`. Held here:

1. The state, set up once by ``__init__`` (the worker's every part reads and changes these
   attributes; none declares its own).
2. Signing (point 7): one signature at a time, off the event loop.
3. What an operator sees (``training.outer.observe``): the worker's ``blob status``
   section and the metrics of each adopted round.
4. :func:`check_signer`: a signer whose attestations the run would refuse is refused
   before the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from identity import AdmissionCertificate, Signer, TrustStore
from p2p.transport.meter import WireMeter
from training.outer.aggregate import Aggregate
from training.outer.agreement import CheckedClosure, ClosureBook, distinct, expected, nameable
from training.outer.announce import Announcer, PeerDialer
from training.outer.loop import OuterState
from training.outer.messages import (
    Candidate,
    ClosureHeard,
    ClosureRefHeard,
    Event,
    Ledger,
    Rejection,
    StateHeard,
    VerdictHeard,
    topic,
)
from training.outer.observe import exclusion_label
from training.outer.params import OuterNetError, WorkerConfig
from training.outer.runs import Retention
from training.outer.worker.closures import Closures
from training.outer.worker.fetcher import BlobFetcher, fetch_bound
from training.outer.worker.links import Links
from training.outer.worker.replays import Replays
from training.outer.worker.signals import Changes, Tasks, say
from training.outer.worker.signing import Signing, check_signer

if TYPE_CHECKING:
    from p2p.node.node import Node

_T = TypeVar("_T")


@dataclass
class RoundRecord:
    """What a worker did for one round (the result file's ``rounds``)."""

    round: int
    start_root: str
    root: str
    state_blob: str
    closure: str  # the closure's digest, hex
    closure_blob: str
    proposer: str
    how: str  # "proposed", "applied" or "caught up"
    included: list[dict[str, str]] = field(default_factory=list)
    excluded: list[dict[str, str]] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    mean_loss: float = float("nan")
    update_bytes: int = 0
    state_bytes: int = 0
    seconds: float = 0.0
    # Payload bytes this worker's TCP sockets sent / received since the previous record
    # (p2p.transport.meter): announcements, closures, attestations and blobs alike.
    wire_sent: int = 0
    wire_received: int = 0
    milestone_blob: str = ""
    pubsub_sent: int = 0  # announcement payloads published (own messages, once each)
    pubsub_received: int = 0  # announcement payloads delivered to this worker
    named: list[dict[str, str]] = field(default_factory=list)  # caught-up rounds only
    ahead: bool = False  # applied from the aggregate computed ahead (worker_adopt point 4)
    # Where the round's communication went: seconds from this worker's update handed over
    # by its trainer to "announced", "ready" (the updates a closure waits for are in),
    # "proposing" (its own closure begun) or "closure" (another's checked), and "applied"
    # (the next state offered to the trainer). Rounds this worker sent an update in only.
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class _Own:
    """This worker's update for one (round, root)."""

    round: int
    root: str
    blob: str
    attestation: bytes
    losses: list[float]
    size: int
    announced_at: float


@dataclass
class _Ahead:
    """An apply started before its closure came (``WorkerAdopt._speculate``): the
    aggregate of ``entries`` (peer, blob; ascending peer order) on the state of
    ``(round, root)``, and that state's root, once ``done`` is set (None: it failed)."""

    round: int
    root: str
    entries: tuple[tuple[str, str], ...]
    done: trio.Event
    result: tuple[Aggregate, str] | None = None


class WorkerState:
    """The state every part of :class:`~training.outer.worker.Worker` shares (set by
    ``__init__``), signing, and what the worker shows."""

    def __init__(
        self,
        config: WorkerConfig,
        node: Node,
        signer: Signer,
        certificate: AdmissionCertificate,
        trust: TrustStore,
    ) -> None:
        """``signer``: the machine key's signer (``identity.machine_signer``), so that on a
        TPM-bound machine every update, closure, verdict, milestone and catch-up record
        carries the AK's co-signature."""
        if signer.peer_id != node.peer_id:
            raise OuterNetError(f"the signer is {signer.peer_id}, not the node's {node.peer_id}")
        check_signer(signer, certificate, config.require_hardware)
        self.config = config
        self.params = config.params
        self.node = node
        self.certificate = certificate
        self.trust = trust
        self.peer = node.peer_id
        self.label = f"{config.shard} {self.peer[-6:]}"
        self.topic = topic(self.params.run_id)
        self.ledger = Ledger(
            self.params.run_id, self.peer, trust, require_hardware=config.require_hardware
        )
        self.book = ClosureBook()
        self.announcer = Announcer()
        self.changes = Changes()
        self.tasks = Tasks()
        self.signing = Signing(signer, certificate)
        self.state: OuterState | None = None
        self.root = ""
        self.candidates: dict[str, Candidate] = {}
        self.fetched: dict[str, str] = {}  # peer -> blob, for the current (round, root)
        self.fetch_nursery: trio.Nursery | None = None
        self.round_started = 0.0
        self.marks: dict[str, float] = {}  # RoundRecord.phases of round marked_round, as times
        self.marked_round = -1
        self.own: _Own | None = None
        self.proposed: dict[bytes, tuple[Aggregate, str, int]] = {}
        self.records: dict[int, RoundRecord] = {}
        self.retention = Retention(config.keep_states)
        self.dialer = PeerDialer()
        self.joined_at: int | None = None
        self.start_blob = ""
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.proposed_for: set[tuple[int, str]] = set()
        self.refused_updates: list[dict[str, Any]] = []
        self.meter = WireMeter()
        self.fetcher = BlobFetcher(node, self.params, self.dialer, self.label)
        self.links = Links(
            node,
            self.topic,
            self.announcer,
            self.dialer,
            self.meter,
            self.changes,
            alone_bound=fetch_bound(self.params),
            label=self.label,
        )
        self.unavailable: dict[bytes, int] = {}  # closure digest -> failed fetch rounds
        self.closures = Closures(
            self.params.run_id,
            trust,
            self.book,
            self.fetcher,
            self.changes,
            self.tasks,
            require_hardware=config.require_hardware,
            label=self.label,
        )
        self.replays = Replays(
            config,
            node,
            trust,
            self.fetcher,
            self.links,
            self.signing,
            self.changes,
            self.tasks,
            label=self.label,
        )
        # The closures adopted for the last rounds (round -> closure): a milestone names
        # the workers the previous round's closure named and its own does not.
        self.adopted: dict[int, CheckedClosure] = {}
        # What `blob status` and the metrics show (training.outer.observe).
        self.metrics = node.metrics
        self.phase = "joining"
        self.last_included: dict[str, Any] | None = None  # our own update's last inclusion
        self.absent: dict[str, Any] = {"round": None, "workers": []}  # the last adopted round's
        # The trainer's ``ready(state, root)``, where it has one (training.outer.api):
        # told each next state as soon as it is computed and its root checked.
        self.ready: Callable[[OuterState, str], None] | None = None
        self.ahead: _Ahead | None = None  # this round's apply, started early
        # The previous round's updates a closure could name, peer -> blob (rule 2 of
        # outer_agreement: a round is ready when it holds K or, if more, that many).
        self.previous: dict[str, str] = {}

    def state_round(self) -> int:
        return -1 if self.state is None else self.state.round

    def _operators(self) -> dict[str, str]:
        """Each peer's operator as this worker knows it: its own, then a candidate's, then
        the ledger's (from hellos and late updates)."""
        operators = dict(self.ledger.operators)
        operators.update((p, c.operator) for p, c in self.candidates.items())
        operators[self.peer] = self.certificate.operator
        return operators

    def _distinct(self, updates: Mapping[str, str]) -> dict[str, str]:
        return distinct(
            updates, me=self.peer, operators=self._operators(), banned=self.replays.banned
        )

    def _expected(self) -> int:
        late = self.ledger.late.get(self.state_round() - 1, {})
        return expected(
            self.params.workers,
            self.previous,
            late,
            me=self.peer,
            operators=self._operators(),
            banned=self.replays.banned,
        )

    def _nameable(self) -> dict[str, str]:
        announced = {p: c.blob for p, c in self.candidates.items()}
        return nameable(
            self.fetched,
            announced,
            me=self.peer,
            operators=self._operators(),
            banned=self.replays.banned,
        )

    async def _fetch_update(self, candidate: Candidate, root: str) -> None:
        fetched = await self.fetcher.fetch(candidate.blob, candidate.addrs, float("inf"))
        if fetched and root == self.root:
            self.fetched[candidate.peer] = candidate.blob
            self.changes.set()

    def _handle(self, events: list[Event]) -> None:
        """What the topic brought: updates of the current round to fetch, closures into
        the book, addresses to dial, verdicts."""
        now = time.time()
        for event in events:
            if isinstance(event, Candidate):
                self.dialer.learn(event.peer, event.addrs, trio.current_time())
                self.closures.keep_attestation(
                    event.round, event.peer, event.blob, event.attestation
                )
                if (
                    self.state is not None
                    and event.round == self.state.round
                    and event.peer not in self.candidates
                ):
                    self.candidates[event.peer] = event
                    if self.fetch_nursery is not None:
                        self.fetch_nursery.start_soon(self._fetch_update, event, self.root)
            elif isinstance(event, Rejection):
                say(
                    self.label,
                    f"round {event.round}: rejected update {event.blob[:12]} from "
                    f"{event.peer}: {event.reason}",
                )
            elif isinstance(event, ClosureHeard):
                self.closures.hear(event, now)
            elif isinstance(event, ClosureRefHeard):
                self.closures.hear_compact(event, now)
            elif isinstance(event, StateHeard):
                self.dialer.learn(event.peer, event.addrs, trio.current_time())
            elif isinstance(event, VerdictHeard):
                self.replays.hear(event, self.state.round if self.state else None, now)
        if events:
            self.changes.set()

    def _mark(self, phase: str) -> None:
        """The first time the own round reached ``phase`` (``RoundRecord.phases``), while
        this worker's state is still the round's start."""
        if self.marks and self.state is not None and self.state.round == self.marked_round:
            self.marks.setdefault(phase, trio.current_time())

    def _phases(self, round_: int) -> dict[str, float]:
        """``RoundRecord.phases`` of ``round_``: empty unless it is the marked round."""
        began = self.marks.get("trained")
        if self.marked_round != round_ or began is None:
            return {}
        return {p: round(t - began, 3) for p, t in self.marks.items() if p != "trained"}

    def _offer(self, state: OuterState, root: str) -> None:
        """``state`` is computed and its root checked, and will be adopted unless its
        closure turns out bad or loses: a trainer with ``ready`` starts the next round on
        it while the state blob is kept and the milestone signed (its update is dropped
        should another state be adopted instead). Not after the last round: the final
        state goes to the trainer as the run's end."""
        self._mark("applied")
        if self.ready is not None and state.round < self.params.rounds:
            self.ready(state, root)

    def _observe_round(self, record: RoundRecord) -> None:
        """The metrics of one adopted round, and our own update's inclusion (observe)."""
        included = record.included or record.named
        self.metrics.outer_included.inc(len(included))
        refused = [u for u in self.refused_updates if u["round"] == record.round]
        for excluded in [*record.excluded, *(refused if record.how == "proposed" else [])]:
            self.metrics.outer_excluded.labels(reason=exclusion_label(excluded["reason"])).inc()
        own = self.own
        if own is not None and own.round == record.round and own.root == record.start_root:
            # From our update being ready to the outer step applied: the round's
            # communication (and waiting), as the anchors count it.
            self.metrics.outer_comm.observe(max(0.0, trio.current_time() - own.announced_at))
            if any(x["peer"] == self.peer for x in included):
                self.last_included = {"round": record.round, "blob": own.blob}

    def status(self) -> dict[str, Any]:
        """The worker's section of ``blob status`` (training.outer.observe rule 2)."""
        return {
            "run": self.params.run_id,
            "round": self.state_round(),
            "rounds": self.params.rounds,
            "phase": self.phase,
            "root": self.root,
            "last_included": self.last_included,
            "heard": sorted(self.candidates),  # peers whose update for this round arrived
            "absent": self.absent,  # named by the last round's parent closure, not by it
            "excluded_operators": dict(self.replays.banned),
        }
