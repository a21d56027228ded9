"""Replay verdicts (point 4 of :mod:`training.outer.worker`): drawing the sample of each
round applied, replaying this worker's share, announcing and keeping signed verdicts,
hearing the others', and excluding an operator whose cheat this worker's replay confirmed.

1. A round's sample is drawn from the root its closure produced. Verdicts heard on the
   round not applied yet are held (at most ``MAX_EARLY_VERDICTS``) until it is drawn.
2. A verdict counts only from the update's assigned replayer, on the update and
   commitment applied here. A mismatch is acted on once this worker's own replay agrees;
   else the accusation is recorded as false.
3. Every verdict kept is also a tagged blob beside the milestones (outer_milestones
   rule 3).
4. The states the last two rounds started from are kept for replay, and none in a run
   that samples none (at 124M parameters the two are 2 GB a worker would hold for nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from identity import Attestation, TrustStore
from training.outer.aggregate import Aggregate
from training.outer.agreement import CheckedClosure
from training.outer.loop import OuterState
from training.outer.messages import (
    Refused,
    VerdictAnnouncement,
    VerdictHeard,
    check_hardware,
    encode_message,
)
from training.outer.milestones import tag
from training.outer.observe import verdict_label
from training.outer.params import WorkerConfig
from training.outer.replay import (
    UNAVAILABLE,
    BadCommitment,
    BadVerdict,
    Verdict,
    check_claims,
    check_verdict,
    decode_commitment,
    replay,
    replayer_for,
    sampled,
    sign_verdict,
)
from training.outer.runs import drop_blob
from training.outer.worker.fetcher import BlobFetcher
from training.outer.worker.links import Links
from training.outer.worker.signals import Changes, Tasks, say
from training.outer.worker.signing import Signing

if TYPE_CHECKING:
    from p2p.node.node import Node

# Verdicts kept for the result file: a sampled share of each round's updates, for rounds
# of at most MAX_RUN_WORKERS (64) workers; beyond this they are acted on, not listed.
MAX_VERDICTS = 4096
# Verdicts heard on the round this worker has not applied yet (the replayer applied it and
# replayed first): held until its sample is drawn; a round's sample of 64 workers, twice.
MAX_EARLY_VERDICTS = 128


@dataclass(frozen=True)
class Sample:
    """One sampled update of a round this worker applied."""

    round: int
    start_root: str
    author: str
    operator: str
    blob: str
    commitment: str
    replayer: str


class Replays:
    """Samples, replays and verdicts of one worker (see the module's rules)."""

    def __init__(
        self,
        config: WorkerConfig,
        node: Node,
        trust: TrustStore,
        fetcher: BlobFetcher,
        links: Links,
        signing: Signing,
        changes: Changes,
        tasks: Tasks,
        *,
        label: str,
    ) -> None:
        self.config = config
        self.params = config.params
        self.node = node
        self.peer = node.peer_id
        self.trust = trust
        self.fetcher = fetcher
        self.links = links
        self.signing = signing
        self.changes = changes
        self.tasks = tasks
        self.label = label
        self.metrics = node.metrics
        # Round -> (its start root, its start state), for the last two rounds (rule 4).
        self.starts: dict[int, tuple[str, OuterState]] = {}
        self.awaited: dict[tuple[int, str], Sample] = {}  # (round, author) -> its sample
        self.early_verdicts: list[VerdictHeard] = []  # on the round not applied yet
        self.verdicts: list[dict[str, Any]] = []  # kept, the first per (round, author)
        self.confirming: set[tuple[int, str]] = set()  # our replays of a heard mismatch
        self.banned: dict[str, str] = {}  # operator -> reason (its cheat confirmed here)
        self.false_accusations: list[dict[str, Any]] = []

    def draw_sample(
        self, checked: CheckedClosure, agg: Aggregate, start: OuterState, now: float
    ) -> None:
        """Round r's sample, drawn from the root its closure produced (``agg`` applied on
        ``start``); replay our share, and hear again the verdicts held for it (``now``:
        the wall clock their certificates are checked at)."""
        c = checked.closure
        rate = self.params.replay_rate
        by_peer = {x.peer: (x, op) for x, op in zip(c.included, checked.operators, strict=True)}
        operators = {p: by_peer[p][1] for p, _, _ in agg.admitted}
        if rate > 0:
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
            sample = Sample(c.round, c.start_root, peer, operator, blob, subjects[2], replayer)
            self.awaited[(c.round, peer)] = sample
            if replayer == self.peer:
                self.tasks.start(self.replay, sample, False)
        early = [e for e in self.early_verdicts if e.verdict.round == c.round]
        self.early_verdicts = []
        for event in early:
            self.hear(event, c.round + 1, now)

    def wait_bound(self) -> float:
        """How long a proposer waits for the previous round's verdicts (point 4)."""
        return 2 * self.params.deadline

    def pending(self, round_: int) -> bool:
        """Verdicts on round ``round_``'s sample not yet held, or confirmations running."""
        held = {(v["round"], v["author"]) for v in self.verdicts}
        return any(
            key[0] == round_ and (key not in held or key in self.confirming) for key in self.awaited
        ) or any(key[0] == round_ for key in self.confirming)

    async def replay(self, sample: Sample, confirm: bool) -> None:
        """Replay one sampled update; announce the verdict (or, confirming another's
        mismatch, only act on it)."""
        key = (sample.round, sample.author)
        try:
            outcome = await self._outcome(sample)
        finally:
            self.confirming.discard(key)
            self.changes.set()
        verdict = Verdict(
            self.params.run_id,
            sample.round,
            sample.author,
            sample.blob,
            sample.commitment,
            outcome,
        )
        say(
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
        self._record(verdict, self.peer)
        if verdict.mismatched:
            self._ban(sample, outcome)
        s = self.signing
        attestation = await s.sign(
            lambda: sign_verdict(
                s.signer,
                verdict,
                kernel_class=s.kernel_class,
                certificate=s.certificate,
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
        await self.links.announce(
            f"verdict-{sample.round}-{sample.author}", encode_message(message)
        )
        await self._keep(message)

    async def _keep(self, message: VerdictAnnouncement) -> None:
        """Keep a verdict as a tagged blob beside the milestones (rule 3)."""
        blob = await self.node.add_bytes(encode_message(message))
        name = tag(self.params.run_id, "verdict", message.round) + f"-{message.author}"
        await trio.to_thread.run_sync(self.node.store.tag, name, blob)

    async def _outcome(self, sample: Sample) -> str:
        held = self.starts.get(sample.round)
        if held is None or held[0] != sample.start_root:
            return UNAVAILABLE  # not expected: we drew the sample from a state we held
        start = held[1]
        fetcher = self.fetcher
        providers = [*fetcher.dialer.addrs(sample.author), *fetcher.everyone()]
        bound = fetcher.bound()
        if not await fetcher.fetch(sample.commitment, providers, bound):
            return UNAVAILABLE
        try:
            data = await trio.to_thread.run_sync(fetcher.load, sample.commitment)
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
            overlap=self.params.overlap,
        )
        if claim:
            return f"mismatch: {claim}"
        # The inner state, and the state an overlapped update's steps started from.
        needed = [c.inner, *([c.origin] if c.overlapped else [])]
        loaded: list[bytes] = []
        for blob in needed:
            had = await trio.to_thread.run_sync(self.node.store.has, blob)
            if not await fetcher.fetch(blob, providers, bound):
                return UNAVAILABLE
            loaded.append(await trio.to_thread.run_sync(fetcher.load, blob))
            if not had:  # fetched for this replay only (a blob we held may be evidence)
                await trio.to_thread.run_sync(drop_blob, self.node.store, blob)
        inner, origin = loaded[0], loaded[1] if c.overlapped else b""
        update = await trio.to_thread.run_sync(fetcher.load, sample.blob)
        make = self.config.make_trainer
        return await trio.to_thread.run_sync(
            lambda: replay(self.params, c, inner, start, update, make, origin)
        )

    def hear(self, event: VerdictHeard, current_round: int | None, now: float) -> None:
        """A verdict from another worker, heard while this worker's state is of
        ``current_round`` (None: before its first): it counts if it is the assigned
        replayer's, on an update we applied; a mismatch is acted on once our own replay
        agrees. ``now``: the wall clock its certificate is checked at."""
        msg = event.verdict
        sample = self.awaited.get((msg.round, msg.author))
        # On the round we have not applied yet (another worker applied and replayed it
        # first); later rounds' verdicts are not early but unfounded, and are not held.
        ahead = msg.round == current_round
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
            signed = check_verdict(verdict, msg.attestation, trust=self.trust, now=now)
            if self.config.require_hardware:
                check_hardware(signed, "verdict")  # messages rule 7
        except (BadVerdict, Refused) as exc:
            say(self.label, f"refused a verdict from {event.peer[-6:]}: {exc}")
            return
        if signed.signer_peer_id != event.peer:
            return
        if not self._record(verdict, event.peer):
            return
        self.tasks.start(self._keep, msg)
        key = (msg.round, msg.author)
        if verdict.mismatched and key not in self.confirming and self.tasks.running:
            self.confirming.add(key)
            self.tasks.start(self.replay, sample, True)

    def _record(self, verdict: Verdict, replayer: str) -> bool:
        """Keep a verdict (the first per round and author); True if it is new."""
        if any((v["round"], v["author"]) == (verdict.round, verdict.author) for v in self.verdicts):
            return False
        if len(self.verdicts) < MAX_VERDICTS:
            self.verdicts.append({**verdict.to_json(), "replayer": replayer})
        self.changes.set()
        return True

    def _ban(self, sample: Sample, outcome: str) -> None:
        if sample.operator not in self.banned:
            self.banned[sample.operator] = f"failed replay of round {sample.round} ({outcome})"
            say(self.label, f"operator {sample.operator} excluded: {self.banned[sample.operator]}")
