"""One worker of a decentralised outer-loop run: the trio shell around the sans-IO cores.

Theory of operation
-------------------
The decisions are made elsewhere, as pure functions of what the worker has heard:
which update announcements count (``training.outer.messages.Ledger``), which closure is
the tip and what to do about it (``training.outer.agreement``), how the named updates
become the next state (``training.outer.aggregate``) and when to re-send an announcement
(``training.outer.announce``). This module moves bytes between them and the node:

1. Tasks: one reads the run's gossipsub topic into the ledger and the closure book; one
   re-publishes announcements with back-off; one dials every admitted peer it has heard
   of and is not connected to, for the whole run, with back-off
   (``training.outer.announce.PeerDialer``), so the TCP connections form a mesh whoever
   bootstrapped to whom, and a worker back from a pause finds the living peers even if
   its bootstrap peers are dead; one samples the sockets' byte counts and notices a pause
   (the monotonic clock jumped): it keeps its live connections (dropping them lost the
   closures published meanwhile) and dials every missing peer at once; only a state fetch
   that fails drops every connection to dial afresh; fetches run as tasks of the
   round; the driver (``_drive``) does everything that changes the worker's state, so
   nothing else ever sees a half-changed state.
2. The driver, in a loop: (a) if it holds no update for its current state and round,
   trains one (torch in a thread; messages keep flowing), unless the state changed
   meanwhile, then puts, attests and announces it; (b) asks ``next_step``: Apply (fetch the
   tip's named updates it lacks, aggregate, check the result root and state blob ID),
   CatchUp (fetch the tip's state blob, check round and root, adopt), or Stay; (c) on
   Stay, proposes a closure when its slot comes (rule 2 of ``outer_agreement``): updates
   of all K workers fetched, or the deadline after its own announcement passed, plus its
   position in the round's rank order times the proposer timeout.
3. After the last round it waits until the tip has not changed for a settle time (a better
   closure of the last round may still arrive, and rule 3 applies to it like any other),
   announces its final root, and waits (bounded by ``_linger_bound``), serving blobs, for
   the final roots of every worker whose update it ever applied and is still connected to
   (a worker back from a pause that outlasted the others' last rounds needs someone to
   catch up from; a dead one has no connection and is not waited for) and for the
   verdicts on the last round's sample; then it writes its result. Its tasks are
   cancelled before the node closes, so shutdown is clean; a peer's death is a fetch that
   fails and is retried elsewhere, never an error.
4. Replay (``training.outer.replay``): with each update the worker stores its inner state
   and a commitment, named in its update attestation. After applying round r it draws
   round r's sample from the new root; for each sampled update it is the replayer of, it
   replays it (a task of the run, torch in a thread) and announces a signed verdict. A
   mismatch it heard counts once its own replay agrees; then that operator's updates stay
   out of every closure it proposes. A proposer waits (bounded by ``_verdict_wait``) for
   the verdicts on the previous round's sample before proposing, so a confirmed cheat is
   left out of the next closure it makes.
5. Disk: the state blobs of the last ``keep_states`` rounds (``WorkerConfig``) stay tagged
   ``outer/<run>/state/<round>``, its own inner-state blobs of those rounds stay; older
   ones are untagged and deleted, and a replayer deletes an inner state it fetched once
   replayed (``training.outer.runs`` point 4).
   Each applied closure is kept as a blob (tagged), with its milestone and a collection
   of the update blobs it names (``training.outer.milestones`` rule 2), so ``blob gc``
   leaves ``blob outer verify`` what it needs until ``blob outer forget``.
6. Never alone: a worker stopped past the others' last round and linger (45 s in the
   setting of ``bench/outer.py --churn``) wakes to find them gone. Closing the
   remaining rounds alone (at once if it had heard none of their closures, else once
   their blobs were dropped as unavailable, rule 4 of outer_agreement) and exiting 0 on a
   rival root, "agreed" because it heard no final root to compare, would be a silent
   fork. So a worker that trained with others proposes, and fetches the blobs a closure names,
   only while connected to an admitted peer; with none for ``_alone_bound`` it stops
   with an error (a closure it heard whose blobs nobody left can serve no longer costs
   it ``UNAVAILABLE_TRIES`` fetch bounds first). A SIGSTOPped peer's TCP
   connections stay up, so the others do not stop while it is paused. The price: the
   last survivor of a run whose other workers all died stops too instead of finishing
   alone (it cannot tell them from a run that went on without it).
7. Signing: everything the worker attests (updates, closures, verdicts, milestones,
   catch-ups, its final root) goes through the signer it is given, the machine's
   (``identity.machine_signer``): on a TPM-bound key each carries the AK's co-signature.
   In a run that requires hardware it refuses, before it starts, a signer that is not
   TPM-backed, and takes from others only TPM co-signed updates, closures and verdicts
   (``training.outer.messages`` rule 7). A round it caught up over, not recomputing it,
   it keeps with a signed catch-up record instead of a milestone
   (``training.outer.milestones`` rule 5).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import trio

from blobstore import StoreError
from identity import (
    AdmissionCertificate,
    Attestation,
    HardwareSigner,
    Signer,
    TrustStore,
    sign_attestation,
)
from p2p.transport.meter import SAMPLE_INTERVAL, WireMeter
from training.outer.aggregate import Aggregate, aggregate, unwrap_update
from training.outer.agreement import (
    Apply,
    BadClosure,
    CatchUp,
    CheckedClosure,
    Closure,
    ClosureBook,
    check_closure,
    compact_body,
    expand_body,
    proposal_time,
    proposer_order,
    select_for_closure,
    sign_closure,
)
from training.outer.announce import Announcer, PeerDialer
from training.outer.codec import CodecError
from training.outer.loop import OuterState, state_root
from training.outer.messages import (
    STATE_KIND,
    UPDATE_KIND,
    BadMessage,
    Candidate,
    ClosureAnnouncement,
    ClosureHeard,
    ClosureRefAnnouncement,
    ClosureRefHeard,
    Event,
    Hello,
    Ledger,
    Refused,
    Rejection,
    StateAnnouncement,
    StateHeard,
    UpdateAnnouncement,
    VerdictAnnouncement,
    VerdictHeard,
    check_hardware,
    decode_message,
    encode_message,
    topic,
)
from training.outer.milestones import (
    RunTerms,
    absent_workers,
    catch_up_for,
    closure_hardware,
    keep_catch_up,
    keep_round,
    milestone_for,
    sign_catch_up,
    sign_milestone,
    tag,
)
from training.outer.observe import exclusion_label, verdict_label
from training.outer.params import OuterNetError, WorkerConfig, write_json
from training.outer.replay import (
    UNAVAILABLE,
    BadCommitment,
    BadVerdict,
    UpdateCommitment,
    Verdict,
    check_claims,
    check_verdict,
    decode_commitment,
    inner_digest,
    loss_bits,
    replay,
    replayer_for,
    sampled,
    sign_verdict,
)
from training.outer.runs import Retention, drop_blob
from training.outer.state_blob import BadStateBlob, decode_state, encode_state
from training.outer.trainer import Trainer

if TYPE_CHECKING:
    from p2p.node.node import Node

_T = TypeVar("_T")

# A fetch attempt with no progress for this long is abandoned and tried again.
FETCH_STALL = 20.0
# A failed fetch is tried again after this pause.
FETCH_RETRY = 0.5
# Before proposing, the worker lets messages already on the wire (buffered while it was
# busy or paused) reach its book, so it does not propose for a round already closed.
GATHER = 0.3
# Fetch bounds a closure's blobs may fail before the closure is dropped (rule 4 of
# outer_agreement): long enough to outlast a worker's own pause or a peer's restart.
UNAVAILABLE_TRIES = 4
# Most peers asked for a closure's blobs besides its proposer and authors (every admitted
# worker of the largest run).
MAX_PROVIDERS = 64
# Verdicts kept for the result file: a sampled share of each round's updates, for rounds
# of at most MAX_RUN_WORKERS (64) workers; beyond this they are acted on, not listed.
MAX_VERDICTS = 4096
# Verdicts heard on the round this worker has not applied yet (the replayer applied it and
# replayed first): held until its sample is drawn; a round's sample of 64 workers, twice.
MAX_EARLY_VERDICTS = 128
# Update attestations kept for expanding compact closures: two rounds of the largest run's
# workers, with room for the re-announcements of a round that changed root.
MAX_ATTESTATIONS = 1024
# Full closures fetched at once (for compact ones we could not expand): a handful of
# siblings per round (outer_agreement.MAX_CLOSURES_PER_ROUND) is all a run has.
MAX_CLOSURE_FETCHES = 16
# The dial loop looks for peers to dial this often (PeerDialer decides whom).
DIAL_TICK = 0.5
# Dials of one tick run at once, at most this many (a dead host's dial waits its timeout).
MAX_CONCURRENT_DIALS = 8
# An event loop that did not run for this long was stopped (SIGSTOP, a suspended laptop).
# A loaded 2-vCPU machine stalled a worker's loop for 5-6 s while torch was imported in a
# thread (the GIL); a false alarm only costs a redial. Stops shorter than this are caught
# by a fetch that fails (_catch_up redials then).
PAUSE_GAP = 7.0


def _say(label: str, text: str) -> None:
    stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 10) % 10}"
    print(f"outer[{label}] {stamp} {text}", file=sys.stderr, flush=True)


def _names(workers: Sequence[tuple[str, str]]) -> str:
    """Workers as a log names them: operator and short peer ID, from (peer, operator)."""
    return ", ".join(f"{operator} {peer[-6:]}" for peer, operator in workers)


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


@dataclass(frozen=True)
class _Sampled:
    """One sampled update of a round this worker applied (point 4)."""

    round: int
    start_root: str
    author: str
    operator: str
    blob: str
    commitment: str
    replayer: str


def check_signer(signer: Signer, certificate: AdmissionCertificate, require_hardware: bool) -> None:
    """Refuse, before the run, a signer whose attestations the run would refuse: on a
    TPM-bound machine the certificate must record its AK (else every attestation would be
    refused as unproven), and a run that requires hardware needs a hardware signer."""
    if isinstance(signer, HardwareSigner) and certificate.ak != signer.ak:
        raise OuterNetError(
            "this machine key is TPM-bound, but its certificate does not record that TPM's "
            "attestation key; admit the machine on its TPM (`blob tpm challenge` / `blob tpm "
            "admit`)"
        )
    if require_hardware and not isinstance(signer, HardwareSigner):
        raise OuterNetError(
            "this run requires hardware-signed attestations, and this machine key is not "
            "TPM-bound; bind it (`blob tpm bind`) and admit it on its TPM"
        )


class Worker:
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
        self.signer = signer
        self.certificate = certificate
        self.trust = trust
        self.peer = node.peer_id
        self.label = f"{config.shard} {self.peer[-6:]}"
        self.topic = topic(self.params.run_id)
        self.ledger = Ledger(
            self.params.run_id, self.peer, trust, require_hardware=config.require_hardware
        )
        self.book = ClosureBook()
        self.closure_addrs: dict[bytes, tuple[str, ...]] = {}
        self.announcer = Announcer()
        self.changed = trio.Event()
        self.state: OuterState | None = None
        self.root = ""
        self.candidates: dict[str, Candidate] = {}
        self.fetched: dict[str, str] = {}  # peer -> blob, for the current (round, root)
        self.fetch_nursery: trio.Nursery | None = None
        self.round_started = 0.0
        self.own: _Own | None = None
        self.proposed: dict[bytes, tuple[Aggregate, str, int]] = {}
        self.records: dict[int, RoundRecord] = {}
        self.refused_closures: list[dict[str, Any]] = []
        self.retention = Retention(config.keep_states)
        self.dialer = PeerDialer()
        self.joined_at: int | None = None
        self.start_blob = ""
        self.kernel_class = ""
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.proposed_for: set[tuple[int, str]] = set()
        self.refused_updates: list[dict[str, Any]] = []
        self.meter = WireMeter()
        self.inflight: dict[str, trio.Event] = {}
        # Announcement payloads this worker published / was delivered (each once; gossipsub
        # relays and control messages are not in these, only in the wire counts).
        self.pubsub_bytes = [0, 0]
        self.pubsub_mark = (0, 0)
        self.unavailable: dict[bytes, int] = {}  # closure digest -> failed fetch rounds
        self.ever_admitted: set[str] = set()  # peers whose updates we applied (point 3)
        self.run_nursery: trio.Nursery | None = None
        self.attestations: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.closure_fetches: set[str] = set()
        # Replay (point 4): the states the last rounds started from (round -> (root,
        # state)), the verdicts awaited per (round, author), those held, confirmations
        # running, and operators whose cheat this worker confirmed.
        self.starts: dict[int, tuple[str, OuterState]] = {}
        self.awaited: dict[tuple[int, str], _Sampled] = {}
        self.early_verdicts: list[VerdictHeard] = []  # on rounds not applied yet
        self.verdicts: list[dict[str, Any]] = []
        self.confirming: set[tuple[int, str]] = set()
        self.banned: dict[str, str] = {}  # operator -> reason
        self.false_accusations: list[dict[str, Any]] = []
        self.wire_mark = (0, 0)
        # The closures adopted for the last rounds (round -> closure): a milestone names
        # the workers the previous round's closure named and its own does not.
        self.adopted: dict[int, CheckedClosure] = {}
        # What `blob status` and the metrics show (training.outer.observe).
        self.metrics = node.metrics
        self.phase = "joining"
        self.last_included: dict[str, Any] | None = None  # our own update's last inclusion
        self.absent: dict[str, Any] = {"round": None, "workers": []}  # the last adopted round's
        self.sign_lock = trio.Lock()  # one signature at a time (_sign)

    # --- messages in and out ---------------------------------------------------------
    async def _receive_loop(self, sub: Any) -> None:
        from libp2p.peer.id import ID

        while True:
            msg = await sub.get()
            try:
                sender = ID(msg.from_id).to_base58()
            except Exception:  # a malformed source field: not a message we can judge
                continue
            self.pubsub_bytes[1] += len(msg.data)
            self._handle(self.ledger.hear(msg.data, sender, time.time()))

    def _handle(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Candidate):
                self.dialer.learn(event.peer, event.addrs, trio.current_time())
                self._keep_attestation(event.round, event.peer, event.blob, event.attestation)
                if (
                    self.state is not None
                    and event.round == self.state.round
                    and event.peer not in self.candidates
                ):
                    self.candidates[event.peer] = event
                    if self.fetch_nursery is not None:
                        self.fetch_nursery.start_soon(self._fetch_update, event, self.root)
            elif isinstance(event, Rejection):
                _say(
                    self.label,
                    f"round {event.round}: rejected update {event.blob[:12]} from "
                    f"{event.peer}: {event.reason}",
                )
            elif isinstance(event, ClosureHeard):
                self._hear_closure(event)
            elif isinstance(event, ClosureRefHeard):
                self._hear_closure_ref(event)
            elif isinstance(event, StateHeard):
                self.dialer.learn(event.peer, event.addrs, trio.current_time())
            elif isinstance(event, VerdictHeard):
                self._hear_verdict(event)
        if events:
            self.changed.set()

    def _hear_closure(self, event: ClosureHeard) -> None:
        try:
            checked = check_closure(
                event.body,
                event.attestation,
                run=self.params.run_id,
                trust=self.trust,
                now=time.time(),
            )
            if self.config.require_hardware:
                closure_hardware(checked)  # messages rule 7
        except Refused as refused:
            if len(self.refused_closures) < 64:
                self.refused_closures.append({"peer": event.peer, "reason": refused.reason})
                _say(self.label, f"refused a closure from {event.peer}: {refused}")
            return
        if checked.closure.proposer != event.peer:
            return  # relayed under another sender's name: the proposer's own copy counts
        self.dialer.learn(event.peer, event.addrs, trio.current_time())
        if self.book.add(checked):
            self.closure_addrs[checked.digest] = event.addrs

    def _keep_attestation(self, round_: int, peer: str, blob: str, attestation: bytes) -> None:
        """Update attestations heard, by (peer, blob): compact closures name them by
        digest (outer_agreement rule 5). Kept for the rounds a closure may still name."""
        if len(self.attestations) >= MAX_ATTESTATIONS:
            for key in [k for k, (r, _) in self.attestations.items() if r < round_ - 1]:
                del self.attestations[key]
        if len(self.attestations) < MAX_ATTESTATIONS:
            self.attestations[(peer, blob)] = (round_, attestation)

    def _attestation_of(self, peer: str, blob: str) -> bytes | None:
        held = self.attestations.get((peer, blob))
        return None if held is None else held[1]

    def _hear_closure_ref(self, event: ClosureRefHeard) -> None:
        """A compact closure: expand it from the attestations we hold, or fetch it whole."""
        msg = event.message
        if msg.run != self.params.run_id:
            return
        try:
            full = expand_body(msg.compact, self._attestation_of)
        except BadClosure as exc:
            if len(self.refused_closures) < 64:
                self.refused_closures.append({"peer": event.peer, "reason": str(exc)})
            return
        if full is not None:
            self._hear_closure(ClosureHeard(event.peer, full, msg.attestation, msg.addrs))
        elif (
            msg.full not in self.closure_fetches
            and len(self.closure_fetches) < MAX_CLOSURE_FETCHES
            and self.run_nursery is not None
        ):
            self.closure_fetches.add(msg.full)
            self.run_nursery.start_soon(self._fetch_closure, event)

    async def _fetch_closure(self, event: ClosureRefHeard) -> None:
        msg = event.message
        try:
            providers = [*msg.addrs, *self._everyone()]
            if not await self._fetch(msg.full, providers, self._fetch_bound()):
                return
            data = await trio.to_thread.run_sync(self._load, msg.full)
            try:
                full = decode_message(data)
                same = isinstance(full, ClosureAnnouncement) and (
                    full.attestation == msg.attestation and compact_body(full.body) == msg.compact
                )
            except (BadMessage, BadClosure):
                same = False
            if not same or not isinstance(full, ClosureAnnouncement):
                _say(self.label, f"closure blob {msg.full[:12]} is not the announced closure")
                return
            self._hear_closure(ClosureHeard(event.peer, full.body, full.attestation, msg.addrs))
            self.changed.set()
        finally:
            self.closure_fetches.discard(msg.full)

    async def _publish(self, data: bytes) -> None:
        self.pubsub_bytes[0] += len(data)
        try:
            await self.node.publish(self.topic, data)
        except Exception as exc:  # libp2p raises many types; announcements are re-sent
            _say(self.label, f"publish failed (will re-send): {exc!r}")

    async def _announce(self, name: str, data: bytes) -> None:
        if self.announcer.set(name, data, trio.current_time()):
            await self._publish(data)
            self.changed.set()

    async def _announce_loop(self) -> None:
        while True:
            with trio.move_on_at(self.announcer.next_due()):
                await trio.sleep_forever()
            for data in self.announcer.due(trio.current_time()):
                await self._publish(data)

    async def _meter_loop(self) -> None:
        """Sample the sockets' byte counts; after a pause, dial every peer not connected
        at once. Live connections are kept: dropping them all on waking lost the closure
        the others published meanwhile, and with the others finished the woken worker
        proposed a rival one alone (3 forks in 5 runs of bench/outer.py --churn 5). A
        connection that only looks alive is dropped when a fetch over it fails
        (_catch_up's _redial)."""
        last = trio.current_time()
        while True:
            self.meter.sample()
            await trio.sleep(SAMPLE_INTERVAL)
            now = trio.current_time()
            if now - last > PAUSE_GAP:
                _say(self.label, f"woke after {now - last:.0f}s without running")
                self.dialer.all_due(now)
            last = now

    async def _dial_loop(self) -> None:
        """Dial every admitted peer heard of and not connected (PeerDialer's back-off)."""
        limit = trio.Semaphore(MAX_CONCURRENT_DIALS)

        async def dial(peer: str, addrs: tuple[str, ...]) -> None:
            async with limit:
                ok = await self._dial(peer, addrs)
            if ok:
                self.dialer.succeeded(peer, trio.current_time())
            else:
                self.dialer.failed(peer, trio.current_time())

        while True:
            due = self.dialer.due(trio.current_time(), self.node.connected_peers())
            async with trio.open_nursery() as nursery:
                for peer, addrs in due:
                    if peer != self.peer:
                        nursery.start_soon(dial, peer, addrs)
            await trio.sleep(DIAL_TICK)

    async def _dial(self, peer: str, addrs: Sequence[str]) -> bool:
        from p2p.errors import P2PError

        # Node.connect lifts py-libp2p's 60 s negative dial cache; PeerDialer's back-off
        # governs these dials instead.
        for addr in addrs:
            try:
                await self.node.connect(addr)
                return True
            except P2PError:
                continue
        return False

    async def _wait_changed(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self.changed.wait()
        self.changed = trio.Event()

    # --- blobs -----------------------------------------------------------------------
    async def _fetch(self, blob: str, providers: Sequence[str], bound: float) -> bool:
        """Fetch ``blob`` into the store (verified chunk by chunk); False if not in time."""

        if await trio.to_thread.run_sync(self.node.store.has, blob):
            return True
        # One fetch per blob at a time in this process: a second would find the first's
        # partial blob locked. The later caller waits for the one in flight, then retries.
        with trio.move_on_after(bound):
            while blob in self.inflight:
                await self.inflight[blob].wait()
                if await trio.to_thread.run_sync(self.node.store.has, blob):
                    return True
        if blob in self.inflight:
            return False
        done = self.inflight[blob] = trio.Event()
        try:
            return await self._fetch_once(blob, providers, bound)
        finally:
            del self.inflight[blob]
            done.set()

    async def _fetch_once(self, blob: str, providers: Sequence[str], bound: float) -> bool:
        from p2p.errors import P2PError

        with trio.move_on_after(bound):
            while True:
                with trio.move_on_after(FETCH_STALL) as attempt:

                    def progressed(_: object, attempt: trio.CancelScope = attempt) -> None:
                        attempt.deadline = trio.current_time() + FETCH_STALL

                    try:
                        await self.node.fetch(
                            blob, providers=list(providers), progress=progressed, announce=False
                        )
                        return True
                    except (P2PError, StoreError, OSError, trio.BrokenResourceError) as exc:
                        _say(self.label, f"fetch {blob[:12]} failed (retrying): {exc}")
                if attempt.cancelled_caught:
                    _say(self.label, f"fetch {blob[:12]} stalled (retrying)")
                await trio.sleep(FETCH_RETRY)
        return False

    def _load(self, blob: str) -> bytes:
        return self.node.store.path(blob).read_bytes()

    def _author(self, blob: str) -> str | None:
        """The author an update blob's envelope names (None: not an update blob)."""
        try:
            return unwrap_update(self._load(blob)).author
        except (CodecError, OSError):
            return None

    async def _fetch_update(self, candidate: Candidate, root: str) -> None:
        if await self._fetch(candidate.blob, candidate.addrs, float("inf")) and root == self.root:
            self.fetched[candidate.peer] = candidate.blob
            self.changed.set()

    def _providers(self, checked: CheckedClosure, peers: Sequence[str] = ()) -> list[str]:
        """Who may hold a closure's blobs: its proposer and the named peers first, then every
        worker heard of (each that applied the closure holds them)."""
        out = list(self.closure_addrs.get(checked.digest, ()))
        for peer in peers:
            out.extend(self.dialer.addrs(peer))
        for peer in list(self.dialer.peers)[:MAX_PROVIDERS]:
            out.extend(self.dialer.addrs(peer)[:1])
        return list(dict.fromkeys(out))

    def _fetch_bound(self) -> float:
        return 3 * self.params.deadline + self.params.fetch_floor

    # --- adopting a state -------------------------------------------------------------
    async def _adopt(
        self,
        state: OuterState,
        checked: CheckedClosure,
        how: str,
        agg: Aggregate | None,
        state_blob: str,
        state_bytes: int,
    ) -> None:
        c = checked.closure
        root = state_root(state)
        closure_blob = await self.node.add_bytes(
            encode_message(ClosureAnnouncement(c.run, checked.body, checked.attestation, ()))
        )
        record = RoundRecord(
            c.round,
            c.start_root,
            root,
            state_blob,
            checked.digest.hex(),
            closure_blob,
            c.proposer,
            how,
            included=[{"peer": p, "blob": b} for p, b, _ in agg.admitted] if agg else [],
            excluded=[e.to_json() for e in agg.excluded] if agg else [],
            rejected=[x.to_json() for x in self.ledger.rejections(c.round)],
            state_bytes=state_bytes,
            seconds=trio.current_time() - self.round_started,
        )
        sent, received = self.meter.sample()
        record.wire_sent = sent - self.wire_mark[0]
        record.wire_received = received - self.wire_mark[1]
        self.wire_mark = (sent, received)
        record.pubsub_sent = self.pubsub_bytes[0] - self.pubsub_mark[0]
        record.pubsub_received = self.pubsub_bytes[1] - self.pubsub_mark[1]
        self.pubsub_mark = (self.pubsub_bytes[0], self.pubsub_bytes[1])
        if agg is not None:
            self.ever_admitted.update(p for p, _, _ in agg.admitted)
        self._observe_round(record)
        if agg is None:  # caught up: what the closure names, not recomputed here
            record.named = [{"peer": x.peer, "blob": x.blob} for x in c.included]
        own = self.own
        if own is not None and own.round == c.round and own.root == c.start_root:
            record.mean_loss = float(np.mean(own.losses))
            record.update_bytes = own.size
        previous = self.records.get(c.round - 1)
        stale = previous is not None and previous.root != c.start_root
        for old in [r for r in self.records if r >= c.round or stale]:
            del self.records[old]  # a dead branch (we caught up to another chain)
        self.records[c.round] = record
        store = self.node.store
        parent = self.adopted.get(c.round - 1)  # absent_workers checks it is the parent
        if agg is not None:
            milestone = await self._sign(
                lambda: sign_milestone(
                    self.signer,
                    milestone_for(checked, agg, self._terms(), parent),
                    kernel_class=self.kernel_class,
                    certificate=self.certificate,
                    time=int(time.time()),
                )
            )
            record.milestone_blob = await self.node.add_bytes(milestone)
            await trio.to_thread.run_sync(
                lambda: keep_round(
                    store, checked, closure_blob=closure_blob, milestone_blob=record.milestone_blob
                )
            )
        elif not (self.config.join and self.joined_at is None):
            # Not recomputed: a signed catch-up record says so (outer_milestones rule 5).
            since = self.state.round if self.state is not None else c.round
            catch_up = await self._sign(
                lambda: sign_catch_up(
                    self.signer,
                    catch_up_for(checked, since),
                    kernel_class=self.kernel_class,
                    certificate=self.certificate,
                    time=int(time.time()),
                )
            )
            catch_up_blob = await self.node.add_bytes(catch_up)
            await trio.to_thread.run_sync(
                lambda: keep_catch_up(
                    store, checked, closure_blob=closure_blob, record_blob=catch_up_blob
                )
            )
        else:  # a joiner's first state: where its own account of the run starts
            await trio.to_thread.run_sync(store.tag, tag(self.params.run_id, "start"), state_blob)
        name = tag(self.params.run_id, "state", state.round)
        await trio.to_thread.run_sync(store.tag, name, state_blob)
        await trio.to_thread.run_sync(
            store.tag, tag(self.params.run_id, "closure", c.round), closure_blob
        )
        for old_tag, old_blob in self.retention.state(state.round, name, state_blob):
            try:
                if old_tag:
                    await trio.to_thread.run_sync(store.untag, old_tag)
            except StoreError:
                pass
            await trio.to_thread.run_sync(drop_blob, store, old_blob)
        prior = self.state if self.root == c.start_root else None
        self._enter(state, root)
        if c.proposer != self.peer:
            self.announcer.drop("closure")
        if agg is not None and prior is not None:
            self._draw_sample(checked, agg, prior)
        _say(
            self.label,
            f"round {c.round} closed ({how}): closure {checked.digest.hex()[:12]} by "
            f"{c.proposer[-6:]}: {len(record.included)} included, "
            f"{len(record.excluded)} excluded, root {root[:16]}",
        )
        absent = absent_workers(parent, checked)
        self.absent = {"round": c.round, "workers": [{"peer": p, "operator": o} for p, o in absent]}
        if absent:
            _say(
                self.label,
                f"round {c.round} closed without {_names(absent)}: in round {c.round - 1}'s "
                "closure, no update of theirs in this one (left or missed the round)",
            )
        self.adopted = {r: x for r, x in self.adopted.items() if c.round - 2 < r < c.round}
        self.adopted[c.round] = checked

    async def _sign(self, sign: Callable[[], _T]) -> _T:
        """Sign off the event loop, one signature at a time: a TPM co-signature is a
        round trip to the chip (a hardware TPM re-creates its AK for each, tens to hundreds
        of milliseconds), and a TPM serves one session at a time."""
        async with self.sign_lock:
            return await trio.to_thread.run_sync(sign)

    def _terms(self) -> RunTerms:
        """What this run's milestones sign of its parameters (outer_milestones rule 1)."""
        outer = self.params.outer_config()
        return RunTerms(self.params.rounds, self.params.replay_rate, outer.lr, outer.momentum)

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
            "excluded_operators": dict(self.banned),
        }

    def _enter(self, state: OuterState, root: str) -> None:
        """Make ``state`` current: a new round of updates, fetches and announcements."""
        self.state = state
        self.root = root
        self.candidates = {}
        self.fetched = {}
        self.round_started = trio.current_time()
        self.metrics.outer_round.set(state.round)
        self.announcer.drop("update")
        for name in [n for n in self.announcer.entries if n.startswith("verdict-")]:
            if int(name.split("-")[1]) < state.round - 2:
                self.announcer.drop(name)  # the rounds whose sample it was are settled
        self.fetch_nursery = None  # the driver cancels the old round's fetches
        # Our closures of rounds before this state lost (or were adopted and popped): each
        # held a whole state; should one win later, _apply recomputes it.
        self.proposed = {d: v for d, v in self.proposed.items() if v[0].state.round > state.round}
        self._handle(self.ledger.open_round(state.round, root, time.time()))

    async def _apply(self, checked: CheckedClosure) -> None:
        c = checked.closure
        assert self.state is not None
        if checked.digest in self.proposed:
            agg, blob, size = self.proposed.pop(checked.digest)
            await self._adopt(agg.state, checked, "proposed", agg, blob, size)
            return
        entries = [(x.peer, x.blob) for x in c.included]
        for peer, blob in entries:
            if not await self._fetch_named(checked, blob, self._providers(checked, [peer])):
                _say(
                    self.label,
                    f"closure {checked.digest.hex()[:12]}: update {blob[:12]} unavailable",
                )
                await self._catch_up(checked)
                return
        # In a run that asks more than bounded updates, the commitments name each update's
        # verification level; kept beside the closure so `blob outer levels` and verify can
        # check them from this store (a missing one is only reported there: the state does
        # not depend on it). A bounded run needs none of them, and fetches none: an
        # update whose commitment nobody serves would stall every apply.
        if self.config.min_level != "bounded":
            for x in c.included:
                commitment = Attestation.decode(x.attestation).subjects[2]
                await self._fetch(commitment, self._providers(checked, [x.peer]), FETCH_STALL)
        state, root_before = self.state, self.root
        agg = await trio.to_thread.run_sync(
            lambda: aggregate(
                state, entries, self._load, self.params.outer_config(), start_root=root_before
            )
        )
        root = state_root(agg.state)
        if root != c.result_root:
            self._bad(checked, f"result root mismatch (we computed {root[:16]})")
            return
        data = await trio.to_thread.run_sync(encode_state, agg.state)
        blob = await self.node.add_bytes(data)
        if blob != c.state_blob:
            self._bad(checked, "state blob mismatch")
            return
        await self._adopt(agg.state, checked, "applied", agg, blob, len(data))

    async def _catch_up(self, checked: CheckedClosure) -> None:
        c = checked.closure
        providers = self._providers(checked, [c.proposer])
        if not await self._fetch_named(checked, c.state_blob, providers):
            self._unavailable(checked)
            await self._redial()
            return
        try:
            data = await trio.to_thread.run_sync(self._load, c.state_blob)
            state = await trio.to_thread.run_sync(lambda: decode_state(data, expected=self.shapes))
        except (BadStateBlob, OSError) as exc:
            self._bad(checked, f"bad state blob: {exc}")
            return
        if state.round != c.round + 1 or state_root(state) != c.result_root:
            self._bad(checked, "state blob is not the closure's result")
            return
        before = self.state.round if self.state is not None else None
        await self._adopt(state, checked, "caught up", None, c.state_blob, len(data))
        _say(self.label, f"caught up from state round {before} to {state.round}")

    async def _fetch_named(
        self, checked: CheckedClosure, blob: str, providers: Sequence[str]
    ) -> bool:
        """Fetch a blob a closure names. While alone (point 6) nobody can serve it: it
        waits for a peer first (stopping if none comes) instead of spending fetch bounds,
        UNAVAILABLE_TRIES of them, on a closure of a run that ended without it."""
        if self._alone() and not await trio.to_thread.run_sync(self.node.store.has, blob):
            what = f"nobody to fetch closure {checked.digest.hex()[:12]}'s blobs from"
            await self._waited_for_peers(checked.closure.round, what)
        return await self._fetch(blob, providers, self._fetch_bound())

    async def _redial(self) -> None:
        """Drop every connection; the dial loop makes new ones within a second. After this
        worker was paused (SIGSTOP, a laptop lid), connections its peers have long closed
        can linger here looking alive, so nobody answers its fetches and new dials to the
        same peers are refused; fresh connections fix that."""
        from libp2p.peer.id import ID

        for peer in self.node.connected_peers():
            with trio.move_on_after(5):
                try:
                    await self.node.host.disconnect(ID.from_base58(peer))
                except Exception as exc:  # libp2p raises many types; the dial loop retries
                    _say(self.label, f"disconnect {peer[-6:]} failed: {exc!r}")
        self.dialer.all_due(trio.current_time())
        _say(self.label, "dropped all connections to dial again")

    def _unavailable(self, checked: CheckedClosure) -> None:
        """A closure whose blobs could not be fetched in time: the network's fault, or its
        proposer's. It stays the tip (so this worker does not propose a rival closure and
        fork) for ``UNAVAILABLE_TRIES`` fetch bounds; only then is it dropped."""
        tries = self.unavailable.get(checked.digest, 0) + 1
        self.unavailable[checked.digest] = tries
        if tries >= UNAVAILABLE_TRIES:
            self._bad(checked, f"blobs unavailable after {tries} tries")
        else:
            _say(self.label, f"closure {checked.digest.hex()[:12]}: blobs unavailable, retrying")

    def _bad(self, checked: CheckedClosure, reason: str) -> None:
        self.book.mark_bad(checked.digest, reason)
        self.refused_closures.append(
            {"peer": checked.closure.proposer, "round": checked.closure.round, "reason": reason}
        )
        _say(self.label, f"closure {checked.digest.hex()[:12]} is no tip: {reason}")

    # --- replay (point 4) -------------------------------------------------------------
    def _draw_sample(self, checked: CheckedClosure, agg: Aggregate, start: OuterState) -> None:
        """Round r's sample, drawn from the root its closure produced; replay our share."""
        c = checked.closure
        rate = self.params.replay_rate
        by_peer = {x.peer: (x, op) for x, op in zip(c.included, checked.operators, strict=True)}
        operators = {p: by_peer[p][1] for p, _, _ in agg.admitted}
        self.starts[c.round] = (c.start_root, start)
        for old in [r for r in self.starts if r < c.round - 1]:
            del self.starts[old]
        for key in [k for k in self.awaited if k[0] < c.round - 1]:
            del self.awaited[key]
        for peer, blob, _ in agg.admitted:
            replayer = replayer_for(c.result_root, peer, operators)
            if replayer is None or not sampled(c.result_root, peer, rate):
                continue
            included, operator = by_peer[peer]
            subjects = Attestation.decode(included.attestation).subjects
            sample = _Sampled(c.round, c.start_root, peer, operator, blob, subjects[2], replayer)
            self.awaited[(c.round, peer)] = sample
            if replayer == self.peer and self.run_nursery is not None:
                self.run_nursery.start_soon(self._replay, sample, False)
        early = [e for e in self.early_verdicts if e.verdict.round == c.round]
        self.early_verdicts = []
        for event in early:
            self._hear_verdict(event)

    def _verdict_wait(self) -> float:
        """How long a proposer waits for the previous round's verdicts (point 4)."""
        return 2 * self.params.deadline

    def _verdicts_pending(self, round_: int) -> bool:
        """Verdicts on round ``round_``'s sample not yet held, or confirmations running."""
        held = {(v["round"], v["author"]) for v in self.verdicts}
        return any(
            key[0] == round_ and (key not in held or key in self.confirming) for key in self.awaited
        ) or any(key[0] == round_ for key in self.confirming)

    async def _replay(self, sample: _Sampled, confirm: bool) -> None:
        """Replay one sampled update; announce the verdict (or, confirming another's
        mismatch, only act on it)."""
        key = (sample.round, sample.author)
        try:
            outcome = await self._replay_outcome(sample)
        finally:
            self.confirming.discard(key)
            self.changed.set()
        verdict = Verdict(
            self.params.run_id,
            sample.round,
            sample.author,
            sample.blob,
            sample.commitment,
            outcome,
        )
        _say(
            self.label,
            f"round {sample.round}: replayed {sample.author[-6:]}'s update "
            f"{'(confirming) ' if confirm else ''}-> {outcome}",
        )
        if confirm:
            if verdict.mismatched:
                self._ban(sample, outcome)
            elif len(self.false_accusations) < MAX_VERDICTS:
                # The assigned replayer said mismatch; our replay matched: its word is
                # not evidence (rule 4 of outer_replay), and it is recorded.
                self.false_accusations.append({**verdict.to_json(), "by": sample.replayer})
            return
        label = verdict_label(outcome, mismatched=verdict.mismatched, unavailable=UNAVAILABLE)
        self.metrics.replay_verdicts.labels(verdict=label).inc()
        self._record_verdict(verdict, self.peer)
        if verdict.mismatched:
            self._ban(sample, outcome)
        attestation = await self._sign(
            lambda: sign_verdict(
                self.signer,
                verdict,
                kernel_class=self.kernel_class,
                certificate=self.certificate,
                time=int(time.time()),
            )
        )
        message = VerdictAnnouncement(
            verdict.run,
            verdict.round,
            verdict.author,
            verdict.update,
            verdict.commitment,
            verdict.outcome,
            attestation,
        )
        await self._announce(f"verdict-{sample.round}-{sample.author}", encode_message(message))
        await self._keep_verdict(message)

    async def _keep_verdict(self, message: VerdictAnnouncement) -> None:
        """Keep a verdict as a tagged blob beside the milestones (outer_milestones rule 3)."""
        blob = await self.node.add_bytes(encode_message(message))
        name = tag(self.params.run_id, "verdict", message.round) + f"-{message.author}"
        await trio.to_thread.run_sync(self.node.store.tag, name, blob)

    async def _replay_outcome(self, sample: _Sampled) -> str:
        held = self.starts.get(sample.round)
        if held is None or held[0] != sample.start_root:
            return UNAVAILABLE  # not expected: we drew the sample from a state we held
        start = held[1]
        providers = [*self.dialer.addrs(sample.author), *self._everyone()]
        bound = self._fetch_bound()
        if not await self._fetch(sample.commitment, providers, bound):
            return UNAVAILABLE
        try:
            data = await trio.to_thread.run_sync(self._load, sample.commitment)
            c = decode_commitment(data)
        except BadCommitment as exc:
            return f"mismatch: {exc}"
        claim = check_claims(
            c,
            run=self.params.run_id,
            round_=sample.round,
            start_root=sample.start_root,
            author=sample.author,
            update=sample.blob,
        )
        if claim:
            return f"mismatch: {claim}"
        had_inner = await trio.to_thread.run_sync(self.node.store.has, c.inner)
        if not await self._fetch(c.inner, providers, bound):
            return UNAVAILABLE
        inner = await trio.to_thread.run_sync(self._load, c.inner)
        if not had_inner:  # fetched for this replay only (a blob we held may be evidence)
            await trio.to_thread.run_sync(drop_blob, self.node.store, c.inner)
        update = await trio.to_thread.run_sync(self._load, sample.blob)
        make = self.config.make_trainer
        return await trio.to_thread.run_sync(
            lambda: replay(self.params, c, inner, start, update, make)
        )

    def _everyone(self) -> list[str]:
        return [
            a for p in list(self.dialer.peers)[:MAX_PROVIDERS] for a in self.dialer.addrs(p)[:1]
        ]

    def _hear_verdict(self, event: VerdictHeard) -> None:
        """A verdict from another worker: it counts if it is the assigned replayer's, on
        an update we applied; a mismatch is acted on once our own replay agrees."""
        msg = event.verdict
        sample = self.awaited.get((msg.round, msg.author))
        # On the round we have not applied yet (another worker applied and replayed it
        # first); later rounds' verdicts are not early but unfounded, and are not held.
        ahead = self.state is not None and msg.round == self.state.round
        if sample is None and msg.run == self.params.run_id and ahead:
            if len(self.early_verdicts) < MAX_EARLY_VERDICTS:
                self.early_verdicts.append(event)  # heard again once the sample is drawn
            return
        if msg.run != self.params.run_id or sample is None or sample.replayer != event.peer:
            return
        if (msg.update, msg.commitment) != (sample.blob, sample.commitment):
            return
        verdict = Verdict(msg.run, msg.round, msg.author, msg.update, msg.commitment, msg.outcome)
        try:
            signed = check_verdict(verdict, msg.attestation, trust=self.trust, now=time.time())
            if self.config.require_hardware:
                check_hardware(signed, "verdict")  # messages rule 7
        except (BadVerdict, Refused) as exc:
            _say(self.label, f"refused a verdict from {event.peer[-6:]}: {exc}")
            return
        if signed.signer_peer_id != event.peer:
            return
        if not self._record_verdict(verdict, event.peer):
            return
        if self.run_nursery is not None:
            self.run_nursery.start_soon(self._keep_verdict, msg)
        key = (msg.round, msg.author)
        if verdict.mismatched and key not in self.confirming and self.run_nursery is not None:
            self.confirming.add(key)
            self.run_nursery.start_soon(self._replay, sample, True)

    def _record_verdict(self, verdict: Verdict, replayer: str) -> bool:
        """Keep a verdict (the first per round and author); True if it is new."""
        if any((v["round"], v["author"]) == (verdict.round, verdict.author) for v in self.verdicts):
            return False
        if len(self.verdicts) < MAX_VERDICTS:
            self.verdicts.append({**verdict.to_json(), "replayer": replayer})
        self.changed.set()
        return True

    def _ban(self, sample: _Sampled, outcome: str) -> None:
        if sample.operator not in self.banned:
            self.banned[sample.operator] = f"failed replay of round {sample.round} ({outcome})"
            _say(self.label, f"operator {sample.operator} excluded: {self.banned[sample.operator]}")

    # --- training and proposing -------------------------------------------------------
    async def _train(self, trainer: Trainer) -> None:
        state, root = self.state, self.root
        assert state is not None
        if self.config.stall_round == state.round:
            _say(self.label, f"round {state.round}: stalling (test hook)")
            await trio.sleep_forever()
        cheat = self.config.cheat_from_round is not None
        cheat = cheat and state.round >= (self.config.cheat_from_round or 0)
        self.phase = "training"
        computing = time.monotonic()
        trained = await trio.to_thread.run_sync(
            lambda: trainer.train(state, root, self.peer, cheat=cheat)
        )
        self.metrics.outer_compute.observe(time.monotonic() - computing)
        self.phase = "waiting for updates"
        if (self.state, self.root) != (state, root):
            return  # the state moved on while we trained: this update is for nobody
        blob = await self.node.add_bytes(trained.update)
        # What a replayer needs (training.outer.replay, rule 1): the inner state before
        # the round, and the commitment naming it, the rows, the losses and the update.
        inner = await self.node.add_bytes(trained.inner_before)
        for old in self.retention.inner(state.round, inner):
            await trio.to_thread.run_sync(drop_blob, self.node.store, old)
        commitment = UpdateCommitment(
            self.params.run_id,
            state.round,
            root,
            self.peer,
            self.config.shard,
            self.params.inner_steps,
            self.params.batch,
            trained.rows.astype("<u4").tobytes(),
            loss_bits(trained.losses),
            self.params.chunk,
            self.params.k,
            inner,
            inner_digest(trained.inner_after),
            blob,
            self.config.level,
        )
        commitment_blob = await self.node.add_bytes(commitment.encode())
        attestation = await self._sign(
            lambda: sign_attestation(
                self.signer,
                kind=UPDATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=self.kernel_class,
                subjects=[blob, root, commitment_blob],
                time=int(time.time()),
                certificate=self.certificate,
            ).encode()
        )
        now = trio.current_time()
        size = len(trained.update)
        self.own = _Own(state.round, root, blob, attestation, trained.losses, size, now)
        self._keep_attestation(state.round, self.peer, blob, attestation)
        self.fetched[self.peer] = blob
        message = UpdateAnnouncement(
            self.params.run_id, state.round, blob, attestation, tuple(self.node.reachable_addrs)
        )
        await self._announce("update", encode_message(message))

    async def _level_refusal(self, peer: str, attestation: bytes) -> str:
        """Why an update's commitment keeps it out of this run's closures ('' if it does
        not): unavailable, malformed, or offering less than the run's minimum level."""
        from training.outer.spec import LEVELS

        commitment = Attestation.decode(attestation).subjects[2]
        providers = [*self.dialer.addrs(peer), *self._everyone()]
        if not await self._fetch(commitment, providers, self._fetch_bound()):
            return "its commitment is unavailable"
        try:
            data = await trio.to_thread.run_sync(self._load, commitment)
            level = decode_commitment(data).level
        except (BadCommitment, OSError) as exc:
            return f"bad commitment: {exc}"
        least = self.config.min_level
        if LEVELS.index(level) < LEVELS.index(least):
            return f"offers verification level {level!r}; the run requires {least!r}"
        return ""

    def _slot(self) -> float | None:
        """Rule 2: when this worker proposes for its current round (None: not yet known)."""
        own = self.own
        if own is None or (own.round, own.root) != (self.state_round(), self.root):
            return None
        ready = own.announced_at + self.params.deadline
        if len(self.fetched) >= self.params.workers:
            ready = min(ready, trio.current_time())
        if self._verdicts_pending(own.round - 1):
            ready = max(ready, self.round_started + self._verdict_wait())
        ranked = proposer_order(self.root, [*self.candidates, self.peer])
        return proposal_time(ready, ranked.index(self.peer), self.params.proposer_timeout)

    def state_round(self) -> int:
        return -1 if self.state is None else self.state.round

    async def _propose(self) -> None:
        state, root, own = self.state, self.root, self.own
        assert state is not None and own is not None
        updates = {self.peer: (own.blob, own.attestation)}
        operators = {self.certificate.operator}
        blobs = {own.blob}
        for peer in sorted(self.fetched, key=lambda p: p.encode()):
            candidate = self.candidates.get(peer)
            if candidate is None or candidate.blob != self.fetched[peer]:
                continue
            # Rule 1 of outer_agreement: one blob and one operator once per closure. The
            # author of a blob named twice is in its envelope; an operator's first key
            # (in peer order) counts.
            reason = ""
            if candidate.operator in self.banned:
                reason = self.banned[candidate.operator]
            elif candidate.operator in operators:
                reason = "one operator twice"
            elif candidate.blob in blobs:
                reason = "a copy (blob already named)"
            elif await trio.to_thread.run_sync(self._author, candidate.blob) != peer:
                reason = "a copy (the blob's envelope names another author)"
            if reason:
                self.refused_updates.append(
                    {"round": state.round, "peer": peer, "blob": candidate.blob, "reason": reason}
                )
                continue
            updates[peer] = (candidate.blob, candidate.attestation)
            operators.add(candidate.operator)
            blobs.add(candidate.blob)
        # Levels: only a run that asks more than bounded updates reads their commitments
        # (each read is a fetch a proposal waits on).
        leveled = updates if self.config.min_level != "bounded" else {}
        for peer, (blob, attestation) in sorted(leveled.items()):
            reason = await self._level_refusal(peer, attestation)
            if reason:
                self.refused_updates.append(
                    {"round": state.round, "peer": peer, "blob": blob, "reason": reason}
                )
                del updates[peer]
        score = self.config.score
        if score is not None:  # the scored level (training.outer.api point 4)
            for peer, (blob, _) in sorted(updates.items()):
                data = await trio.to_thread.run_sync(self._load, blob)
                reason = await trio.to_thread.run_sync(score, state, root, peer, data)
                if reason:
                    _say(self.label, f"round {state.round}: left out {peer[-6:]}: {reason}")
                    self.refused_updates.append(
                        {"round": state.round, "peer": peer, "blob": blob, "reason": reason}
                    )
                    del updates[peer]
        included = select_for_closure(updates)
        entries = [(x.peer, x.blob) for x in included]
        agg = await trio.to_thread.run_sync(
            lambda: aggregate(
                state, entries, self._load, self.params.outer_config(), start_root=root
            )
        )
        if (self.state, self.root) != (state, root):
            return
        data = await trio.to_thread.run_sync(encode_state, agg.state)
        blob = await self.node.add_bytes(data)
        closure = Closure(
            self.params.run_id, state.round, root, self.peer, included, state_root(agg.state), blob
        )
        body, attestation = await self._sign(
            lambda: sign_closure(
                self.signer,
                closure,
                kernel_class=self.kernel_class,
                certificate=self.certificate,
                time=int(time.time()),
            )
        )
        try:
            checked = check_closure(
                body, attestation, run=self.params.run_id, trust=self.trust, now=time.time()
            )
        except Refused as exc:  # our own closure: a bug, but one the run survives
            _say(self.label, f"BUG: our own closure is invalid ({exc}); not proposing")
            return
        self.proposed[checked.digest] = (agg, blob, len(data))
        self.book.add(checked)
        self.closure_addrs[checked.digest] = tuple(self.node.reachable_addrs)
        # The full closure is a blob others may fetch; what travels is its compact form.
        full = await self.node.add_bytes(
            encode_message(ClosureAnnouncement(self.params.run_id, body, attestation, ()))
        )
        message = ClosureRefAnnouncement(
            self.params.run_id,
            compact_body(body),
            attestation,
            full,
            tuple(self.node.reachable_addrs),
        )
        await self._announce("closure", encode_message(message))

    # --- the driver -------------------------------------------------------------------
    async def _step(self) -> bool:
        """Act on the tip once; True if the state changed."""
        from training.outer.agreement import next_step

        assert self.state is not None
        before = (self.state.round, self.root)
        step = next_step(self.book, self.state.round, self.root)
        if isinstance(step, Apply):
            await self._apply(step.closure)
        elif isinstance(step, CatchUp):
            await self._catch_up(step.closure)
        return (self.state.round, self.root) != before

    async def _drive(self, trainer: Trainer) -> None:
        rounds = self.params.rounds
        settled_since = trio.current_time()
        said_settling = False
        while True:
            assert self.state is not None
            if await self._step():
                settled_since = trio.current_time()
                continue
            r = self.state.round
            if r >= rounds:
                settle = 2 * self.params.proposer_timeout + 2.0
                if trio.current_time() - settled_since >= settle:
                    return
                if not said_settling:
                    said_settling = True
                    _say(
                        self.label,
                        f"round {r - 1} was the last; waiting {settle:.0f}s for the workers "
                        "to finish it (a better closure of it may still come)...",
                    )
                await self._wait_changed(settled_since + settle)
                continue
            own = self.own
            async with trio.open_nursery() as fetches:
                self.fetch_nursery = fetches
                for candidate in list(self.candidates.values()):
                    fetches.start_soon(self._fetch_update, candidate, self.root)
                if own is None or (own.round, own.root) != (r, self.root):
                    await self._train(trainer)
                await self._round_loop()
                fetches.cancel_scope.cancel()
            self.fetch_nursery = None
            settled_since = trio.current_time()

    async def _round_loop(self) -> None:
        """Until the state changes: follow the tip, or propose when our slot comes."""
        assert self.state is not None
        start = (self.state.round, self.root)
        while (self.state.round, self.root) == start:
            if await self._step():
                return
            slot = self._slot()
            if (
                slot is not None
                and self.config.cheat_from_round is None  # the test cheater never proposes
                and start not in self.proposed_for
                and not self.book.has_round(*start)
                and trio.current_time() >= slot
            ):
                await trio.sleep(GATHER)
                if await self._step():
                    return
                if not self.book.has_round(*start):
                    if await self._waited_for_peers(start[0]):
                        continue  # time passed: the tip may have moved
                    self.proposed_for.add(start)  # at most one closure per (round, root)
                    await self._propose()
                continue
            now = trio.current_time()
            await self._wait_changed(slot if slot is not None and slot > now else now + 1.0)

    def _alone(self) -> bool:
        """Trained with others (applied an update of theirs) and connected to no admitted
        peer: a closure made now would agree with nobody (point 6)."""
        if not self.ever_admitted - {self.peer}:
            return False  # round 0, or nobody else's update applied: nobody to fork from
        peers = set(self.dialer.peers) - {self.peer}
        return not peers & set(self.node.connected_peers())

    async def _waited_for_peers(self, r: int, what: str = "not proposing alone") -> bool:
        """Point 6: before proposing for round ``r`` (or fetching a closure's blobs), wait
        while alone; False if there was no need. With nobody back within ``_alone_bound``
        it stops: every closure it made alone would be a fork of whatever the others
        agreed on, and a closure's blobs cannot come from nobody."""
        if not self._alone():
            return False
        _say(self.label, f"round {r}: no worker of the run connected; {what}")
        self.dialer.all_due(trio.current_time())  # the wait is for them: dial all now
        with trio.move_on_after(self._alone_bound()):
            # The dial loop connects; the node has no event for a new connection.
            while self._alone():  # noqa: ASYNC110
                await trio.sleep(DIAL_TICK)
            return True
        raise OuterNetError(
            f"round {r}: no worker of the run is reachable, so the run went on or ended "
            "without this worker (paused or cut off past the others' end); not closing "
            "rounds alone"
        )

    def _alone_bound(self) -> float:
        """How long a worker with no admitted peer connected waits for one (point 6): as
        long as a finished worker lingers for a missing final root."""
        return self._linger_bound()

    # --- start, join, finish ---------------------------------------------------------
    async def _barrier(self) -> None:
        need = self.params.workers - 1
        if len(self.ledger.present) < need and self.book.tip() is None:
            _say(
                self.label,
                f"waiting for {need - len(self.ledger.present)} more of the run's "
                f"{self.params.workers} workers to dial in (at most "
                f"{self.config.start_timeout:.0f}s)...",
            )
        with trio.move_on_after(self.config.start_timeout):
            while len(self.ledger.present) < need and self.book.tip() is None:
                await self._wait_changed(trio.current_time() + 1.0)
            return
        present = ", ".join(p[-6:] for p in sorted(self.ledger.present)) or "none"
        _say(
            self.label,
            f"start timeout: {len(self.ledger.present) + 1} of {self.params.workers} workers "
            f"present (others: {present}); starting without the rest",
        )

    async def _initial(self) -> OuterState:
        initial = self.config.initial
        assert initial is not None
        self.start_blob = initial
        if not await self._fetch(initial, self.config.bootstrap, self.config.start_timeout):
            raise OuterNetError(f"could not fetch the initial state {initial} in time")
        data = await trio.to_thread.run_sync(self._load, initial)
        await trio.to_thread.run_sync(
            self.node.store.tag, tag(self.params.run_id, "start"), initial
        )
        try:
            return await trio.to_thread.run_sync(lambda: decode_state(data, expected=self.shapes))
        except BadStateBlob as exc:
            raise OuterNetError(f"initial state {initial}: {exc}") from None

    async def _join(self) -> None:
        """A late joiner or a restarted worker: catch up from the tip's state blob."""
        deadline = trio.current_time() + self.config.start_timeout
        while trio.current_time() < deadline:
            tip = self.book.tip()
            if tip is not None:
                await self._catch_up(tip)
                if self.state is not None:
                    self.joined_at = self.state.round
                    self.start_blob = self.records[max(self.records)].state_blob
                    _say(self.label, f"joined at round {self.state.round}")
                    return
            await self._wait_changed(deadline)
        raise OuterNetError("joining: heard no usable closure from an admitted worker")

    async def _finish(self) -> None:
        """Announce the final root; wait (bounded) for those of the last round's workers."""
        assert self.state is not None
        self.phase = "finishing"
        state = self.state
        blob = self.records[max(self.records)].state_blob if self.records else self.start_blob
        attestation = await self._sign(
            lambda: sign_attestation(
                self.signer,
                kind=STATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=self.kernel_class,
                subjects=[blob, self.root],
                time=int(time.time()),
                certificate=self.certificate,
            )
        )
        message = StateAnnouncement(
            self.params.run_id,
            state.round,
            self.root,
            blob,
            attestation.encode(),
            tuple(self.node.reachable_addrs),
        )
        await self._announce("state", encode_message(message))
        # Admitted by the aggregation in a round this worker applied: a byzantine worker
        # whose updates were all excluded is not waited for.
        ever = self.ever_admitted - {self.peer}
        deadline = trio.current_time() + self._linger_bound()
        said: tuple[str, ...] = ()
        while trio.current_time() < deadline:
            waiting = (ever & set(self.node.connected_peers())) - set(
                self.ledger.roots_heard(state.round)
            )
            # The last round's sample is replayed too (its verdicts complete the milestones).
            verdicts = self._verdicts_pending(state.round - 1)
            if not waiting and not verdicts:
                break
            what = tuple(self._named(sorted(waiting))) + (("verdicts",) if verdicts else ())
            if what != said:  # say what it waits for when that changes, not every second
                said = what
                final = f"the final roots of {', '.join(what[: len(waiting)])}" if waiting else ""
                sample = f"the verdicts on round {state.round - 1}'s sample" if verdicts else ""
                _say(
                    self.label,
                    f"finished round {state.round - 1}; waiting for "
                    f"{' and '.join(x for x in (final, sample) if x)} (at most "
                    f"{deadline - trio.current_time():.0f}s)...",
                )
            await self._wait_changed(min(deadline, trio.current_time() + 1.0))
        else:
            missing = ", ".join(self._named(sorted(waiting))) or "none"
            _say(
                self.label,
                f"leaving without the final roots of {missing}"
                + (" or some verdicts" if self._verdicts_pending(state.round - 1) else ""),
            )
        self.phase = "done"
        _say(self.label, "done; exiting")
        await trio.sleep(1.0)

    def _named(self, peers: Sequence[str]) -> list[str]:
        """Peers as logs name them: operator (from the closures adopted) and short ID."""
        operators = {
            p: op
            for checked in self.adopted.values()
            for p, op in zip(checked.closure.peers(), checked.operators, strict=True)
        }
        return [f"{operators.get(p, 'worker')} {p[-6:]}" for p in peers]

    def _linger_bound(self) -> float:
        """How long a finished worker waits for the others' final roots (point 3)."""
        return self._fetch_bound()

    async def run(self) -> dict[str, Any]:
        sub = await self.node.subscribe(self.topic)
        if self.config.addr_file is not None:
            write_json(
                self.config.addr_file, {"peer_id": self.peer, "addrs": self.node.reachable_addrs}
            )
        hello = Hello(self.params.run_id, self.certificate.encode())
        for addr in self.config.bootstrap:
            self.dialer.learn(addr.rsplit("/p2p/", 1)[-1], [addr], trio.current_time())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop, sub)
            nursery.start_soon(self._announce_loop)
            nursery.start_soon(self._dial_loop)
            nursery.start_soon(self._meter_loop)
            self.run_nursery = nursery
            make = self.config.make_trainer or Trainer
            trainer = await trio.to_thread.run_sync(make, self.params, self.config.shard)
            self.kernel_class = trainer.kernel_class
            if self.certificate.kernel_class != self.kernel_class:
                raise OuterNetError(
                    f"this machine's kernel class is {self.kernel_class}, but its certificate "
                    f"admits {self.certificate.kernel_class}; get a certificate for this one"
                )
            self.shapes = trainer.shapes()
            _say(self.label, f"model ready (kernel class {self.kernel_class})")
            if self.config.join:
                await self._join()
            else:
                state = await self._initial()
                self._enter(state, state_root(state))
                # "Ready to train": torch loaded and S_0 held, so the start barrier only
                # has to cover the spread of round times, and the others have served S_0
                # before their rounds (and byte counts) start.
                await self._announce("hello", encode_message(hello))
                await self._barrier()
            # Rounds are counted from here: fetching the initial state is not a round's.
            self.wire_mark = self.meter.sample()
            wire_start = self.wire_mark
            self.pubsub_mark = (self.pubsub_bytes[0], self.pubsub_bytes[1])
            self.announcer.drop("hello")  # presence only matters for the start barrier
            assert self.state is not None
            initial_root = self.root
            _say(self.label, f"starting at round {self.state.round} (root {self.root[:16]})")
            await self._drive(trainer)
            await self._finish()
            nursery.cancel_scope.cancel()
        assert self.state is not None
        heard = self.ledger.roots_heard(self.state.round)
        rounds = [asdict(self.records[r]) for r in sorted(self.records)]
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
            "rounds": rounds,
            "final_round": self.state.round,
            "final_root": self.root,
            "final_roots_heard": heard,
            "refused_closures": self.refused_closures,
            "refused_updates": self.refused_updates[:256],
            "verdicts": self.verdicts,
            "banned": self.banned,
            "false_accusations": self.false_accusations,
            "equivocations": [list(e) for e in self.book.equivocations],
            "agreed": all(v == self.root for v in heard.values()),
            "malformed_messages": self.ledger.malformed,
            # This process's peak resident memory (Linux reports KiB): what a worker costs.
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "wire_sent": self.meter.sample()[0] - wire_start[0],
            "wire_received": self.meter.totals()[1] - wire_start[1],
        }
        if self.config.result_path is not None:
            write_json(self.config.result_path, result)
        return result
