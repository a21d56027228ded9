"""The worker: the owner of its parts and the driver of its rounds (the theory of
operation is :mod:`training.outer.worker`'s).

The :class:`Worker` holds the round's state (``state``, ``root``, ``candidates``,
``fetched``, ``own``) and changes it in one place, the driver (``_drive``): nothing else
ever sees a half-changed state. It owns the parts that do the rest, each with its own
state and rules: :class:`~training.outer.worker.links.Links` (the topic, dials, pauses,
never alone), :class:`~training.outer.worker.fetcher.BlobFetcher`,
:class:`~training.outer.worker.closures.Closures` (closures heard into the book),
:class:`~training.outer.worker.replays.Replays`,
:class:`~training.outer.worker.aggregator.Aggregator`,
:class:`~training.outer.worker.proposer.Proposer` (its updates and closures) and
:class:`~training.outer.worker.keeper.Keeper` (the rounds adopted, in the result and the
store), around the sans-IO cores (``messages.Ledger``, ``agreement.ClosureBook``,
``announce.Announcer`` and ``PeerDialer``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from blobstore import StoreError
from identity import AdmissionCertificate, Attestation, Signer, TrustStore, sign_attestation
from p2p.transport.meter import WireMeter
from training.outer.aggregate import Aggregate
from training.outer.agreement import (
    Apply,
    BadClosure,
    CatchUp,
    CheckedClosure,
    ClosureBook,
    decode_closure,
    distinct,
    expected,
    nameable,
    next_step,
    present_operators,
    proposal_time,
    proposer_order,
)
from training.outer.announce import Announcer, PeerDialer
from training.outer.loop import OuterState, state_root
from training.outer.messages import (
    STATE_KIND,
    BadMessage,
    Candidate,
    ClosureAnnouncement,
    ClosureHeard,
    ClosureRefHeard,
    Event,
    Hello,
    Ledger,
    PassHeard,
    Rejection,
    StateAnnouncement,
    StateHeard,
    VerdictHeard,
    decode_message,
    encode_message,
    topic,
)
from training.outer.milestones import absent_workers, tag
from training.outer.observe import exclusion_label
from training.outer.params import NoQuorum, OuterNetError, WorkerConfig, write_json
from training.outer.runs import Retention
from training.outer.state_blob import BadStateBlob, decode_state, state_blocks, state_size
from training.outer.trainer import (
    BadResume,
    Trained,
    Trainer,
    check_resume,
    decode_resume,
    layout_digest,
    resume_tags,
)
from training.outer.verification import Level
from training.outer.worker.aggregator import Aggregator
from training.outer.worker.closures import Closures
from training.outer.worker.faults import NO_FAULTS, Faults
from training.outer.worker.fetcher import FETCH_STALL, BlobFetcher, fetch_bound
from training.outer.worker.keeper import Keeper
from training.outer.worker.links import Links
from training.outer.worker.proposer import Proposer
from training.outer.worker.records import Own, RoundRecord
from training.outer.worker.replays import Replays
from training.outer.worker.signals import Changes, Tasks, names, say
from training.outer.worker.signing import Signing, check_signer

if TYPE_CHECKING:
    from p2p.node.node import Node

# Before proposing, the worker lets messages already on the wire (buffered while it was
# busy or paused) reach its book, so it does not propose for a round already closed.
GATHER = 0.3
# Below the quorum at its slot, the worker looks again at least this often (an update or
# pass heard wakes it at once).
QUORUM_TICK = 1.0


class Worker:
    """One worker of a run (see the module and the theory of operation)."""

    def __init__(
        self,
        config: WorkerConfig,
        node: Node,
        signer: Signer,
        certificate: AdmissionCertificate,
        trust: TrustStore,
        faults: Faults = NO_FAULTS,
    ) -> None:
        """``signer``: the machine key's signer (``identity.machine_signer``), so that on a
        TPM-bound machine every update, closure, verdict, milestone and catch-up record
        carries the AK's co-signature. ``faults``: what a test injects (none in a run)."""
        if signer.peer_id != node.peer_id:
            raise OuterNetError(f"the signer is {signer.peer_id}, not the node's {node.peer_id}")
        check_signer(signer, certificate, config.require_hardware)
        self.config = config
        self.params = params = config.params
        self.node = node
        self.certificate = certificate
        self.trust = trust
        self.faults = faults
        self.peer = node.peer_id
        self.label = label = f"{config.shard} {self.peer[-6:]}"
        self.metrics = node.metrics
        # The sans-IO cores.
        self.ledger = Ledger(
            params.run_id, self.peer, trust, require_hardware=config.require_hardware
        )
        self.book = ClosureBook()
        self.announcer = Announcer()
        self.dialer = PeerDialer()
        self.meter = WireMeter()
        # The parts.
        self.changes = changes = Changes()
        self.tasks = tasks = Tasks()
        self.signing = signing = Signing(signer, certificate)
        self.fetcher = fetcher = BlobFetcher(node, params, self.dialer, label)
        self.links = links = Links(
            node,
            topic(params.run_id),
            self.announcer,
            self.dialer,
            self.meter,
            changes,
            alone_bound=fetch_bound(params),
            peer_bound=max(fetch_bound(params), config.start_timeout),
            label=label,
        )
        self.closures = Closures(
            params.run_id,
            trust,
            self.book,
            fetcher,
            changes,
            tasks,
            quorum=params.needed,
            require_hardware=config.require_hardware,
            label=label,
        )
        self.replays = Replays(
            config, node, trust, fetcher, links, signing, changes, tasks, label=label
        )
        self.aggregator = Aggregator(params.outer_config(), fetcher.load, tasks)
        retention = Retention(config.keep_states)
        self.keeper = Keeper(params, node, signing, retention)
        self.proposer = Proposer(
            config, node, trust, self.book, fetcher, links, signing, retention, label=label
        )
        # The round's state, changed by the driver only.
        self.state: OuterState | None = None
        self.root = ""
        self.candidates: dict[str, Candidate] = {}
        self.passes: dict[str, PassHeard] = {}  # the others' passes, for the current round
        self.fetched: dict[str, str] = {}  # peer -> blob, for the current (round, root)
        self.own: Own | None = None  # our update, or our pass (blob ""), for the round
        # Since when (trio time) our slot found fewer operators than the quorum, for the
        # (round, root) it did, and who was present when we last said so.
        self.short: tuple[tuple[int, str], float] | None = None
        self.short_said: tuple[str, ...] = ()
        # When the quorum came back for the (round, root) it was short for: the updates
        # heard since get a deadline to be fetched before the closure names them.
        self.regained: tuple[tuple[int, str], float] | None = None
        # The previous round's updates a closure could name, peer -> blob (rule 2 of
        # outer_agreement: a round is ready when it holds K or, if more, that many).
        self.previous: dict[str, str] = {}
        self.round_started = 0.0
        self.marks: dict[str, float] = {}  # RoundRecord.phases of round marked_round, as times
        self.marked_round = -1
        self.fetch_nursery: trio.Nursery | None = None  # the round's update fetches
        self.proposed_for: set[tuple[int, str]] = set()  # at most one closure each
        # The run.
        self.joined_at: int | None = None
        self.resumed: dict[str, Any] | None = None  # the resume point taken up, if any
        self.start_blob = ""
        self.shapes: dict[str, tuple[int, ...]] = {}
        # The trainer's ``ready(state, root)``, where it has one (training.outer.api, and
        # the round a trainer trains ahead, training.outer.trainer rule 5): told each next
        # state as soon as it is computed and its root checked.
        self.ready: Callable[[OuterState, str], None] | None = None
        # What `blob status` and the metrics show (training.outer.observe).
        self.phase = "joining"
        self.last_included: dict[str, Any] | None = None  # our own update's last inclusion
        self.absent: dict[str, Any] = {"round": None, "workers": []}  # the last adopted round's

    def state_round(self) -> int:
        return -1 if self.state is None else self.state.round

    # --- what the topic brings ---------------------------------------------------------
    def _handle(self, events: list[Event]) -> None:
        """Updates of the current round to fetch, closures into the book, addresses to
        dial, verdicts."""
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
            elif isinstance(event, PassHeard):
                self.dialer.learn(event.peer, event.addrs, trio.current_time())
                self.closures.keep_attestation(event.round, event.peer, "", event.attestation)
                if self.state is not None and event.round == self.state.round:
                    self.passes[event.peer] = event
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
                self.replays.hear(event, None if self.state is None else self.state.round, now)
        if events:
            self.changes.set()

    async def _fetch_update(self, candidate: Candidate, root: str) -> None:
        fetched = await self.fetcher.fetch(candidate.blob, candidate.addrs, float("inf"))
        if fetched and root == self.root:
            self.fetched[candidate.peer] = candidate.blob
            self.changes.set()

    # --- readiness (rule 2 of outer_agreement) -------------------------------------------
    def _operators(self) -> dict[str, str]:
        """Each peer's operator as this worker knows it: its own, then a candidate's, then
        the ledger's (from hellos and late updates)."""
        operators = dict(self.ledger.operators)
        operators.update((p, c.operator) for p, c in self.candidates.items())
        operators.update((p, x.operator) for p, x in self.passes.items())
        operators[self.peer] = self.certificate.operator
        return operators

    def _own_now(self) -> Own | None:
        """Our update or pass for the current (round, root), if it is out."""
        own = self.own
        if own is None or (own.round, own.root) != (self.state_round(), self.root):
            return None
        return own

    def _nameable(self, *, passes: bool = False) -> dict[str, str]:
        """The fetched updates a closure could name (peer -> blob); with ``passes``, the
        round's passes too (blob ""), ours included: what makes a round ready."""
        announced = {p: c.blob for p, c in self.candidates.items()}
        fetched = dict(self.fetched)
        if passes:
            own = self._own_now()
            held = {p: "" for p in self.passes if p not in announced}
            if own is not None and not own.blob:
                held[self.peer] = ""
            announced.update(held)
            fetched.update(held)
        return nameable(
            fetched,
            announced,
            me=self.peer,
            operators=self._operators(),
            banned=self.replays.banned,
        )

    def _present(self) -> dict[str, str]:
        """Rule 7 of outer_agreement: operator -> peer of every worker a closure of ours
        would name now (our update or pass, each update and pass heard; of updates of one
        blob, one: a closure names a blob once, proposer rule 2)."""
        own = self._own_now()
        me = None if own is None else (self.peer, self.certificate.operator)
        blobs = {own.blob} - {""} if own is not None else set()
        heard = []
        for peer in sorted(self.candidates, key=lambda p: p.encode()):
            candidate = self.candidates[peer]
            if candidate.blob not in blobs:
                blobs.add(candidate.blob)
                heard.append((peer, candidate.operator))
        heard += [(p, x.operator) for p, x in self.passes.items() if p not in self.candidates]
        return present_operators(me, heard)

    def _expected(self) -> int:
        return expected(
            self.params.workers,
            self.previous,
            self.ledger.late.get(self.state_round() - 1, {}),
            me=self.peer,
            operators=self._operators(),
            banned=self.replays.banned,
        )

    def _slot(self) -> float | None:
        """When this worker proposes for its current round (None: not yet known)."""
        own = self._own_now()
        if own is None:
            return None
        ready = own.announced_at + self.params.deadline
        if self.regained is not None and self.regained[0] == (own.round, own.root):
            ready = max(ready, self.regained[1] + self.params.deadline)
        if len(self._nameable(passes=True)) >= self._expected():
            ready = min(ready, trio.current_time())
            self._mark("ready")
        if self.replays.pending(own.round - 1):
            ready = max(ready, self.round_started + self.replays.wait_bound())
        ranked = proposer_order(self.root, [*self.candidates, *self.passes, self.peer])
        return proposal_time(ready, ranked.index(self.peer), self.params.proposer_timeout)

    # --- the round's phases (RoundRecord.phases) and the trainer's next state ----------
    def _mark(self, phase: str) -> None:
        """The first time the own round reached ``phase``, while this worker's state is
        still the round's start."""
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
        it while the state blob is kept and the milestone signed, or, training that round
        ahead, moves to it (its update is dropped should another state be adopted
        instead). Only a state computed here is offered, never one caught up to. Not
        after the last round: the final state goes to the trainer as the run's end."""
        self._mark("applied")
        if self.ready is not None and state.round < self.params.rounds:
            self.ready(state, root)

    # --- the driver ---------------------------------------------------------------------
    async def _step(self) -> bool:
        """Act on the tip once; True if the state changed."""
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
                    say(
                        self.label,
                        f"round {r - 1} was the last; waiting {settle:.0f}s for the workers "
                        "to finish it (a better closure of it may still come)...",
                    )
                await self.changes.wait(settled_since + settle)
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
            self._speculate()
            slot = self._slot()
            if (
                slot is not None
                and self.faults.proposes
                and start not in self.proposed_for
                and not self.book.has_round(*start)
                and trio.current_time() >= slot
            ):
                await trio.sleep(GATHER)
                if await self._step():
                    return
                if not self.book.has_round(*start):
                    if await self.links.waited_for_peers(start[0]):
                        continue  # time passed: the tip may have moved
                    if not self._quorum_held(start):
                        await self.changes.wait(trio.current_time() + QUORUM_TICK)
                        continue
                    self.proposed_for.add(start)  # at most one closure per (round, root)
                    if not await self._propose():
                        self.proposed_for.discard(start)
                        await self.changes.wait(trio.current_time() + QUORUM_TICK)
                continue
            now = trio.current_time()
            await self.changes.wait(slot if slot is not None and slot > now else now + 1.0)

    def _quorum_held(self, start: tuple[int, str]) -> bool:
        """Rule 7 of outer_agreement at our slot for ``start`` (round, root): whether a
        closure of ours would name the run's quorum of operators. Below it, say whom we
        wait for (again whenever who is here changes), and stop with :class:`NoQuorum`
        once that has lasted the start timeout: a closure of fewer could fork the run."""
        present = self._present()
        need = self.params.needed
        now = trio.current_time()
        if len(present) >= need:
            if self.short is not None and self.short[0] == start:
                # Back to the quorum (a partition healed, a peer restarted): its updates,
                # heard just now, get a deadline to be fetched (``_slot``).
                self.short, self.regained = None, (start, now)
                return False
            self.short = None
            return True
        if self.short is None or self.short[0] != start:
            self.short = (start, now)
        here = tuple(sorted(f"{op} {p[-6:]}" for op, p in present.items()))
        bound = self.config.start_timeout
        if now - self.short[1] >= bound:
            closed = len(self.keeper.records)
            raise NoQuorum(
                f"round {start[0]}: only {len(present)} of the {need} operators the run's "
                f"quorum needs were here for {bound:.0f}s ({', '.join(here)}); not closing the "
                f"round: the run's other workers are cut off or gone ({closed} round(s) "
                "closed before)"
            )
        if here != self.short_said:
            self.short_said = here
            say(
                self.label,
                f"round {start[0]}: {len(present)} of the {need} operators a closure needs "
                f"(the run's quorum) are here ({', '.join(here)}); waiting for "
                f"{self._missing(present)} (at most {bound - (now - self.short[1]):.0f}s)...",
            )
        return False

    def _missing(self, present: dict[str, str]) -> str:
        """Whom a worker below the quorum waits for: the run's workers it knows of (from
        the closures it adopted, hellos and announcements) that are not ``present``."""
        known = dict(self.ledger.operators)
        for checked in self.keeper.adopted.values():
            known.update(checked.named())
        gone = sorted(f"{op} {p[-6:]}" for p, op in known.items() if op not in present)
        return ", ".join(gone) if gone else "the run's other workers (none heard of yet)"

    # --- training and proposing (point 2a and 2c) ---------------------------------------
    async def _train(self, trainer: Trainer) -> None:
        """Train this worker's update for the current state and announce it, unless the
        state moved on meanwhile (then it is for nobody)."""
        state, root = self.state, self.root
        assert state is not None
        if self.faults.stalls(state.round):
            say(self.label, f"round {state.round}: stalling (test hook)")
            await trio.sleep_forever()
        cheat = self.faults.cheats(state.round)
        self.phase = "training"
        computing = time.monotonic()
        trained: Trained | None = await trio.to_thread.run_sync(
            lambda: trainer.train(state, root, self.peer, cheat=cheat)
        )
        self.metrics.outer_compute.observe(time.monotonic() - computing)
        self.marks, self.marked_round = {"trained": trio.current_time()}, state.round
        self.phase = "waiting for updates"
        if (self.state, self.root) != (state, root):
            return
        if trained is None:  # the trainer skips the round: a pass (proposer rule 5)
            own, message = await self.proposer.commit_pass(state, root)
            self.own = own
            self.closures.keep_attestation(state.round, self.peer, "", own.attestation)
            say(self.label, f"round {state.round}: no update from the trainer; passing")
            await self.links.announce("update", message)
            self._mark("announced")
            return
        own, message = await self.proposer.commit(state, root, trained)
        self.own = own
        self.closures.keep_attestation(state.round, self.peer, own.blob, own.attestation)
        self.fetched[self.peer] = own.blob
        await self.links.announce("update", message)
        self._mark("announced")
        if self.config.keep_resume:
            sampler = await trio.to_thread.run_sync(trainer.sampler_state)
            layout = layout_digest(self.shapes)
            await self.keeper.keep_resume(state.round, trained.inner_after, sampler, layout)

    async def _propose(self) -> bool:
        """Propose our closure of the round; False if what it would name is below the
        quorum after all (an operator's update named under another key than we counted)."""
        state, root, own = self.state, self.root, self.own
        assert state is not None and own is not None
        self._mark("proposing")
        named = await self.proposer.select(
            state, root, own, self.candidates, self.fetched, self.passes, self.replays.banned
        )
        operators = self._operators()
        count = {operators.get(x.peer) for group in named for x in group} - {None}
        if len(count) < self.params.needed:
            return False
        agg, result, _ = await self.aggregator.aggregate(
            state, root, [(x.peer, x.blob) for x in named[0]]
        )
        if (self.state, self.root) != (state, root):
            return True
        self._offer(agg.state, result)
        await self.proposer.close(state, root, named, agg, result)
        return True

    def _speculate(self) -> None:
        """Start this round's aggregate ahead of its closure, when it is due (aggregator
        rule 2): our update out, every update a closure could name fetched, and another
        worker first to propose."""
        state, root = self.state, self.root
        if state is None or self._own_now() is None:
            return
        if not self.aggregator.may_start_ahead(state.round, root):
            return
        if len(self._nameable(passes=True)) < self._expected():
            return
        ready = self._nameable()
        if proposer_order(root, [*self.candidates, *self.passes, self.peer])[0] == self.peer:
            return  # we propose first, and _propose aggregates
        self.aggregator.start_ahead(state, root, tuple(ready.items()))

    # --- adopting a state (points 2b and 5) -----------------------------------------------
    async def _apply(self, checked: CheckedClosure) -> None:
        """Recompute the tip from its named updates and adopt the result, if it is the
        closure's (else the closure is no tip); a named update nobody serves makes it a
        catch-up."""
        c = checked.closure
        assert self.state is not None
        ours = self.proposer.taken(checked.digest)
        if ours is not None:
            agg, blob, size = ours
            await self._adopt(agg.state, checked, "proposed", agg, blob, size)
            return
        self._mark("closure")
        entries = [(x.peer, x.blob) for x in c.included]
        for peer, blob in entries:
            if not await self._fetch_named(checked, blob, self.fetcher.providers(checked, [peer])):
                say(
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
        if self.config.min_level != Level.BOUNDED:
            for x in c.included:
                commitment = Attestation.decode(x.attestation).subjects[2]
                providers = self.fetcher.providers(checked, [x.peer])
                await self.fetcher.fetch(commitment, providers, FETCH_STALL)
        agg, root, ahead = await self.aggregator.aggregate(self.state, self.root, entries)
        if root != c.result_root:
            self.closures.mark_bad(checked, f"result root mismatch (we computed {root[:16]})")
            return
        self._offer(agg.state, root)
        blocks = state_blocks(agg.state)
        blob = await self.node.add_blocks(blocks)
        if blob != c.state_blob:
            self.closures.mark_bad(checked, "state blob mismatch")
            return
        await self._adopt(agg.state, checked, "applied", agg, blob, state_size(blocks), ahead=ahead)

    async def _catch_up(self, checked: CheckedClosure) -> None:
        """Fetch the tip's state blob, check its round and root, and adopt it."""
        c = checked.closure
        providers = self.fetcher.providers(checked, [c.proposer])
        if not await self._fetch_named(checked, c.state_blob, providers):
            self.closures.unavailable_once(checked)
            await self.links.redial()
            return
        try:
            data = await trio.to_thread.run_sync(self.fetcher.load, c.state_blob)
            state = await trio.to_thread.run_sync(lambda: decode_state(data, expected=self.shapes))
        except (BadStateBlob, OSError) as exc:
            self.closures.mark_bad(checked, f"bad state blob: {exc}")
            return
        root = await trio.to_thread.run_sync(state_root, state)
        if state.round != c.round + 1 or root != c.result_root:
            self.closures.mark_bad(checked, "state blob is not the closure's result")
            return
        before = self.state.round if self.state is not None else None
        await self._adopt(state, checked, "caught up", None, c.state_blob, len(data))
        say(self.label, f"caught up from state round {before} to {state.round}")

    async def _fetch_named(
        self, checked: CheckedClosure, blob: str, providers: Sequence[str]
    ) -> bool:
        """Fetch a blob a closure names. While alone (point 6) nobody can serve it: it
        waits for a peer first (stopping if none comes) instead of spending fetch bounds,
        UNAVAILABLE_TRIES of them, on a closure of a run that ended without it."""
        if self.links.alone() and not await trio.to_thread.run_sync(self.node.store.has, blob):
            what = f"nobody to fetch closure {checked.digest.hex()[:12]}'s blobs from"
            await self.links.waited_for_peers(checked.closure.round, what)
        return await self.fetcher.fetch(blob, providers, self.fetcher.bound())

    async def _adopt(
        self,
        state: OuterState,
        checked: CheckedClosure,
        how: str,
        agg: Aggregate | None,
        state_blob: str,
        state_bytes: int,
        *,
        ahead: bool = False,
    ) -> None:
        """Make ``state``, the result of ``checked``, current: record and keep the round,
        draw its replay sample, and say what closed it and who was absent."""
        c = checked.closure
        root = c.result_root  # each caller has checked ``state`` against it
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
            left=[{"peer": x.peer, "blob": x.blob, "reason": x.reason} for x in c.left],
            passed=[x.peer for x in c.passed],
            rejected=[x.to_json() for x in self.ledger.rejections(c.round)],
            state_bytes=state_bytes,
            seconds=trio.current_time() - self.round_started,
            ahead=ahead,
            phases=self._phases(c.round),
        )
        traffic = self.links.traffic()
        record.wire_sent, record.wire_received, record.pubsub_sent, record.pubsub_received = traffic
        if agg is not None:
            self.links.admitted(p for p, _, _ in agg.admitted)
        self._observe_round(record)
        if agg is None:  # caught up: what the closure names, not recomputed here
            record.named = [{"peer": x.peer, "blob": x.blob} for x in c.included]
        own = self.own
        if own is not None and own.round == c.round and own.root == c.start_root and own.blob:
            record.mean_loss = float(np.mean(own.losses))
            record.update_bytes = own.size
            record.moved_at = own.moved_at
        self.keeper.record(record)
        parent = self.keeper.adopted.get(c.round - 1)
        first = self.config.join and self.joined_at is None  # a joiner's first state
        since = None if first else (self.state.round if self.state is not None else c.round)
        await self.keeper.keep(state, checked, agg, record, caught_up_from=since)
        prior = self.state if self.root == c.start_root else None
        self._enter(state, root)
        if c.proposer != self.peer:
            self.announcer.drop("closure")
        if agg is not None and prior is not None:
            self.replays.draw_sample(checked, agg, prior, time.time())
        say(
            self.label,
            f"round {c.round} closed ({how}{', aggregated ahead' if ahead else ''}): "
            f"closure {checked.digest.hex()[:12]} by "
            f"{c.proposer[-6:]}: {len(record.included)} included, "
            f"{len(record.excluded)} excluded, root {root[:16]}",
        )
        absent = absent_workers(parent, checked)
        self.absent = {"round": c.round, "workers": [{"peer": p, "operator": o} for p, o in absent]}
        if absent:
            say(
                self.label,
                f"round {c.round} closed without {names(absent)}: in round {c.round - 1}'s "
                "closure, no update of theirs in this one (left or missed the round)",
            )
        self.keeper.adopt(checked)

    def _enter(self, state: OuterState, root: str) -> None:
        """Make ``state`` current: a new round of updates, fetches and announcements."""
        self.previous = {}
        if self.state is not None and state.round == self.state.round + 1:
            sent = {peer: c.blob for peer, c in self.candidates.items()}
            sent.update((p, "") for p in self.passes if p not in sent)  # a pass: blob ""
            own = self._own_now()
            if own is not None:
                sent[self.peer] = own.blob
            self.previous = distinct(
                sent, me=self.peer, operators=self._operators(), banned=self.replays.banned
            )
        self.state = state
        self.root = root
        self.candidates = {}
        self.passes = {}
        self.fetched = {}
        self.short, self.short_said = None, ()
        self.round_started = trio.current_time()
        self.metrics.outer_round.set(state.round)
        self.aggregator.entered(state.round, root)
        self.announcer.drop("update")
        if self.keeper.records:  # a round closed: every worker is past the start barrier
            self.announcer.drop("hello")
        for name in [n for n in self.announcer.entries if n.startswith("verdict-")]:
            if int(name.split("-")[1]) < state.round - 2:
                self.announcer.drop(name)  # the rounds whose sample it was are settled
        self.fetch_nursery = None  # the driver cancels the old round's fetches
        self.proposer.entered(state.round)
        self._handle(self.ledger.open_round(state.round, root, time.time()))

    # --- what the worker shows (training.outer.observe) -------------------------------
    def _observe_round(self, record: RoundRecord) -> None:
        """The metrics of one adopted round, and our own update's inclusion."""
        included = record.included or record.named
        self.metrics.outer_included.inc(len(included))
        refused = [u for u in self.proposer.refused if u["round"] == record.round]
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

    # --- start, join, finish ---------------------------------------------------------
    async def _barrier(self) -> None:
        """Wait for the run's K workers (or a closure: they started without us), at most
        the start timeout; then go on with those here if they hold the run's quorum
        (outer_agreement rule 7), else stop with :class:`NoQuorum`, having closed nothing."""
        need = self.params.workers - 1
        if len(self.ledger.present) < need and self.book.tip() is None:
            say(
                self.label,
                f"waiting for {need - len(self.ledger.present)} more of the run's "
                f"{self.params.workers} workers to dial in (at most "
                f"{self.config.start_timeout:.0f}s)...",
            )
        with trio.move_on_after(self.config.start_timeout):
            while len(self.ledger.present) < need and self.book.tip() is None:
                await self.changes.wait(trio.current_time() + 1.0)
            return
        present = ", ".join(p[-6:] for p in sorted(self.ledger.present)) or "none"
        operators = {self.certificate.operator}
        operators.update(self.ledger.operators.get(p, p) for p in self.ledger.present)
        here = f"{len(self.ledger.present) + 1} of {self.params.workers} workers present"
        if len(operators) < self.params.needed:
            raise NoQuorum(
                f"start timeout: {here} (others: {present}), {len(operators)} operator(s), "
                f"fewer than the run's quorum of {self.params.needed}; closed no round (are "
                "the workers bootstrapped to a peer they share? see --bootstrap)"
            )
        say(self.label, f"start timeout: {here} (others: {present}); starting without the rest")

    async def _initial(self) -> OuterState:
        initial = self.config.initial
        assert initial is not None
        self.start_blob = initial
        if not await self.fetcher.fetch(initial, self.config.bootstrap, self.config.start_timeout):
            raise OuterNetError(f"could not fetch the initial state {initial} in time")
        data = await trio.to_thread.run_sync(self.fetcher.load, initial)
        await trio.to_thread.run_sync(
            self.node.store.tag, tag(self.params.run_id, "start"), initial
        )
        try:
            return await trio.to_thread.run_sync(lambda: decode_state(data, expected=self.shapes))
        except BadStateBlob as exc:
            raise OuterNetError(f"initial state {initial}: {exc}") from None

    async def _begin(self, hello: Hello) -> None:
        """Enter S_0, say hello and wait at the start barrier. Only ``self.state`` holds
        S_0 from here: a frame that lives the whole run (``run``) keeps no state, or a
        whole one (8 bytes a parameter) would stay resident past round 0."""
        state = await self._initial()
        self._enter(state, state_root(state))
        # "Ready to train": torch loaded and S_0 held, so the start barrier only has to
        # cover the spread of round times, and the others have served S_0 before their
        # rounds (and byte counts) start.
        await self.links.announce("hello", encode_message(hello))
        await self._barrier()

    async def _join(self, hello: Hello) -> None:
        """A late joiner or a restarted worker: catch up from the tip's state blob, then
        say hello (point 1: so that its late updates count)."""
        deadline = trio.current_time() + self.config.start_timeout
        while trio.current_time() < deadline:
            tip = self.book.tip()
            if tip is not None:
                await self._catch_up(tip)
                if self.state is not None:
                    self.joined_at = self.state.round
                    self.start_blob = self.keeper.records[max(self.keeper.records)].state_blob
                    say(self.label, f"joined at round {self.state.round}")
                    await self.links.announce("hello", encode_message(hello))
                    return
            await self.changes.wait(deadline)
        raise OuterNetError("joining: heard no usable closure from an admitted worker")

    def _all_here(self) -> bool:
        """Every other worker of the run heard (the rendezvous then asks seldom)."""
        return len(self.ledger.present) >= self.params.workers - 1

    async def _resume(self, trainer: Trainer) -> None:
        """Take up this worker's resume point (``training.outer.trainer`` rule 2): its inner
        state and sampler into ``trainer``, and its last kept closure into the book, so it
        catches up from its own store when nobody re-announces the tip."""
        store = self.node.store
        run = self.params.run_id
        record_tag, _ = resume_tags(run)
        blob = store.tags().get(record_tag)
        if blob is None:
            raise BadResume(
                f"this store keeps no resume point of run {run} (a worker keeps one once it "
                "has trained a round); start without --resume (--join) instead"
            )
        try:
            data = await trio.to_thread.run_sync(self.fetcher.load, blob)
            try:
                point = decode_resume(data)
            except BadResume as exc:
                raise BadResume(
                    f"{exc}: it is not a resume point `blob outer worker` keeps (one an "
                    "OuterLoop kept resumes with OuterLoop(resume=True))"
                ) from None
            del data
            check_resume(point, run=run, peer=self.peer, shapes=self.shapes)
            inner = await trio.to_thread.run_sync(self.fetcher.load, point.inner)
        except (StoreError, OSError) as exc:
            raise BadResume(f"the resume point cannot be read from this store: {exc}") from None
        await trio.to_thread.run_sync(trainer.load_inner, inner)
        await trio.to_thread.run_sync(trainer.load_sampler, point.sampler)
        del inner
        self.resumed = {"round": point.round, "inner": point.inner}
        say(
            self.label,
            f"resuming after round {point.round}: inner state {point.inner[:12]} (its AdamW "
            "moments and error-feedback residual) and batch sampler loaded",
        )
        prefix = tag(run, "closure") + "-"
        closures = {
            int(name[len(prefix) :]): b
            for name, b in store.tags().items()
            if name.startswith(prefix) and name[len(prefix) :].isdigit()
        }
        if not closures:
            return
        try:
            data = await trio.to_thread.run_sync(self.fetcher.load, closures[max(closures)])
            msg = decode_message(data)
            if not isinstance(msg, ClosureAnnouncement):
                return
            proposer = decode_closure(msg.body).proposer
        except (StoreError, OSError, BadMessage, BadClosure):
            return  # nothing of ours to start from: the tip's proposer re-announces it
        self.closures.hear(ClosureHeard(proposer, msg.body, msg.attestation, ()), time.time())

    async def _finish(self) -> None:
        """Announce the final root; wait (bounded) for those of the last round's workers."""
        assert self.state is not None
        self.phase = "finishing"
        state = self.state
        blob = (
            self.keeper.records[max(self.keeper.records)].state_blob
            if self.keeper.records
            else self.start_blob
        )
        attestation = await self.signing.sign(
            lambda: sign_attestation(
                self.signing.signer,
                kind=STATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=self.signing.kernel_class,
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
        await self.links.announce("state", encode_message(message))
        # Admitted by the aggregation in a round this worker applied: a byzantine worker
        # whose updates were all excluded is not waited for.
        ever = self.links.ever_admitted - {self.peer}
        deadline = trio.current_time() + self.fetcher.bound()
        said: set[str] = set()
        while trio.current_time() < deadline:
            waiting = (ever & set(self.node.connected_peers())) - set(
                self.ledger.roots_heard(state.round)
            )
            # The last round's sample is replayed too (its verdicts complete the milestones).
            verdicts = self.replays.pending(state.round - 1)
            if not waiting and not verdicts:
                break
            what = tuple(self._named(sorted(waiting))) + (("verdicts",) if verdicts else ())
            if not said.issuperset(what):  # said once; again only for something new
                said.update(what)
                final = f"the final roots of {', '.join(what[: len(waiting)])}" if waiting else ""
                sample = f"the verdicts on round {state.round - 1}'s sample" if verdicts else ""
                say(
                    self.label,
                    f"finished round {state.round - 1}; waiting for "
                    f"{' and '.join(x for x in (final, sample) if x)} (at most "
                    f"{deadline - trio.current_time():.0f}s)...",
                )
            await self.changes.wait(min(deadline, trio.current_time() + 1.0))
        else:
            missing = ", ".join(self._named(sorted(waiting))) or "none"
            say(
                self.label,
                f"leaving without the final roots of {missing}"
                + (" or some verdicts" if self.replays.pending(state.round - 1) else ""),
            )
        self.phase = "done"
        say(self.label, "done; exiting")
        await trio.sleep(1.0)

    def _named(self, peers: Sequence[str]) -> list[str]:
        """Peers as logs name them: operator (from the closures adopted) and short ID."""
        operators = {p: op for checked in self.keeper.adopted.values() for p, op in checked.named()}
        return [f"{operators.get(p, 'worker')} {p[-6:]}" for p in peers]

    async def run(self) -> dict[str, Any]:
        sub = await self.node.subscribe(self.links.topic)
        if self.config.addr_file is not None:
            write_json(
                self.config.addr_file, {"peer_id": self.peer, "addrs": self.node.reachable_addrs}
            )
        hello = Hello(self.params.run_id, self.certificate.encode())
        for addr in self.config.bootstrap:
            self.dialer.learn(addr.rsplit("/p2p/", 1)[-1], [addr], trio.current_time())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.links.receive_loop, sub, self.ledger, self._handle)
            nursery.start_soon(self.links.announce_loop)
            nursery.start_soon(self.links.dial_loop)
            nursery.start_soon(self.links.meter_loop)
            # The run's blob every worker holds: its spec's where the caller names it, else
            # the initial state (a joiner without the spec's ID has none to ask about).
            key = self.config.rendezvous or self.config.initial
            if key is not None:
                points = [a.rsplit("/p2p/", 1)[-1] for a in self.config.bootstrap]
                nursery.start_soon(self.links.rendezvous_loop, key, points, self._all_here)
            self.tasks.open(nursery)
            make = self.config.make_trainer or Trainer
            trainer = await trio.to_thread.run_sync(make, self.params, self.config.shard)
            trainer = self.faults.trainer(trainer)
            kernel_class = self.signing.kernel_class = trainer.kernel_class
            self.ready = getattr(trainer, "ready", None)
            if self.certificate.kernel_class != kernel_class:
                raise OuterNetError(
                    f"this machine's kernel class is {kernel_class}, but its certificate "
                    f"admits {self.certificate.kernel_class}; get a certificate for this one"
                )
            self.shapes = trainer.shapes()
            say(self.label, f"model ready (kernel class {kernel_class})")
            if self.config.resume:
                await self._resume(trainer)
            if self.config.join:
                await self._join(hello)
            else:
                await self._begin(hello)
            # Rounds are counted from here: fetching the initial state is not a round's.
            wire_start = self.links.mark()
            assert self.state is not None
            initial_root = self.root
            say(self.label, f"starting at round {self.state.round} (root {self.root[:16]})")
            try:
                await self._drive(trainer)
            finally:
                # A round trained ahead (training.outer.trainer rule 5) stops with the
                # rounds: its thread holds the model, which the caller may take next.
                close = getattr(trainer, "close", None)
                if close is not None:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(close)
            await self._finish()
            nursery.cancel_scope.cancel()
        assert self.state is not None
        heard = self.ledger.roots_heard(self.state.round)
        records = self.keeper.records
        rounds = [asdict(records[r]) for r in sorted(records)]
        result = {
            "run": self.params.run_id,
            "params": asdict(self.params),
            "peer_id": self.peer,
            "shard": self.config.shard,
            "operator": self.certificate.operator,
            "kernel_class": self.signing.kernel_class,
            "joined_at": self.joined_at,
            "resumed": self.resumed,
            "initial_root": initial_root,
            "start_state_blob": self.start_blob,
            "rounds": rounds,
            "final_round": self.state.round,
            "final_root": self.root,
            "final_roots_heard": heard,
            "refused_closures": self.closures.refused,
            "refused_updates": self.proposer.refused[:256],
            "verdicts": self.replays.verdicts,
            "banned": self.replays.banned,
            "false_accusations": self.replays.false_accusations,
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
