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
"""

from __future__ import annotations

import time

import trio

from identity import Attestation
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
from training.outer.worker._stack_links import WorkerLinks
from training.outer.worker._stack_state import _Sampled, _say

# Verdicts kept for the result file: a sampled share of each round's updates, for rounds
# of at most MAX_RUN_WORKERS (64) workers; beyond this they are acted on, not listed.
MAX_VERDICTS = 4096
# Verdicts heard on the round this worker has not applied yet (the replayer applied it and
# replayed first): held until its sample is drawn; a round's sample of 64 workers, twice.
MAX_EARLY_VERDICTS = 128


class WorkerReplay(WorkerLinks):
    """Samples, replays and verdicts (see :mod:`training.outer.worker._stack_replay`)."""

    def _draw_sample(self, checked: CheckedClosure, agg: Aggregate, start: OuterState) -> None:
        """Round r's sample, drawn from the root its closure produced; replay our share."""
        c = checked.closure
        rate = self.params.replay_rate
        by_peer = {x.peer: (x, op) for x, op in zip(c.included, checked.operators, strict=True)}
        operators = {p: by_peer[p][1] for p, _, _ in agg.admitted}
        # The start states replay needs (this round's and the last): in a run that samples
        # none (replay rate 0, below the replayed level) none are kept, which at 124M
        # parameters is 2 GB a worker would hold for nothing.
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
