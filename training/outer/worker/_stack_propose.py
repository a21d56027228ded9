"""Training and proposing (point 2 of :mod:`training.outer.worker`): this worker's update
for its round (trained in a thread, stored with its inner state and commitment, attested
and announced), its proposer slot, and the closure it proposes.

1. An update trained for a state that moved on meanwhile is dropped.
2. A closure names each blob and each operator at most once and no excluded operator's
   update; in a run that asks more than bounded updates, none whose commitment offers
   less than the run's level; and none the run's score refuses.
3. The closure travels in compact form; its full form is a blob others may fetch.
"""

from __future__ import annotations

import time

import trio

from blobstore import blob_id_of
from identity import Attestation, sign_attestation
from training.outer.agreement import (
    Closure,
    check_closure,
    compact_body,
    proposal_time,
    proposer_order,
    select_for_closure,
    sign_closure,
)
from training.outer.messages import (
    UPDATE_KIND,
    ClosureAnnouncement,
    ClosureRefAnnouncement,
    Refused,
    UpdateAnnouncement,
    encode_message,
)
from training.outer.replay import (
    BadCommitment,
    UpdateCommitment,
    decode_commitment,
    inner_digest,
    loss_bits,
)
from training.outer.runs import drop_blob
from training.outer.state_blob import state_blocks, state_size
from training.outer.trainer import Trainer
from training.outer.worker._stack_adopt import WorkerAdopt
from training.outer.worker._stack_state import _Own
from training.outer.worker.signals import say


class WorkerPropose(WorkerAdopt):
    """Training this worker's update and proposing closures (see
    :mod:`training.outer.worker._stack_propose`)."""

    async def _train(self, trainer: Trainer) -> None:
        state, root = self.state, self.root
        assert state is not None
        if self.config.stall_round == state.round:
            say(self.label, f"round {state.round}: stalling (test hook)")
            await trio.sleep_forever()
        cheat = self.config.cheat_from_round is not None
        cheat = cheat and state.round >= (self.config.cheat_from_round or 0)
        self.phase = "training"
        computing = time.monotonic()
        trained = await trio.to_thread.run_sync(
            lambda: trainer.train(state, root, self.peer, cheat=cheat)
        )
        self.metrics.outer_compute.observe(time.monotonic() - computing)
        self.marks, self.marked_round = {"trained": trio.current_time()}, state.round
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
        attestation = await self.signing.sign(
            lambda: sign_attestation(
                self.signing.signer,
                kind=UPDATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=self.signing.kernel_class,
                subjects=[blob, root, commitment_blob],
                time=int(time.time()),
                certificate=self.certificate,
            ).encode()
        )
        now = trio.current_time()
        size = len(trained.update)
        self.own = _Own(state.round, root, blob, attestation, trained.losses, size, now)
        self.closures.keep_attestation(state.round, self.peer, blob, attestation)
        self.fetched[self.peer] = blob
        message = UpdateAnnouncement(
            self.params.run_id, state.round, blob, attestation, tuple(self.node.reachable_addrs)
        )
        await self.links.announce("update", encode_message(message))
        self._mark("announced")

    async def _level_refusal(self, peer: str, attestation: bytes) -> str:
        """Why an update's commitment keeps it out of this run's closures ('' if it does
        not): unavailable, malformed, or offering less than the run's minimum level."""
        from training.outer.spec import LEVELS

        commitment = Attestation.decode(attestation).subjects[2]
        providers = [*self.dialer.addrs(peer), *self.fetcher.everyone()]
        if not await self.fetcher.fetch(commitment, providers, self.fetcher.bound()):
            return "its commitment is unavailable"
        try:
            data = await trio.to_thread.run_sync(self.fetcher.load, commitment)
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
        if len(self._nameable()) >= self._expected():
            ready = min(ready, trio.current_time())
            self._mark("ready")
        if self.replays.pending(own.round - 1):
            ready = max(ready, self.round_started + self.replays.wait_bound())
        ranked = proposer_order(self.root, [*self.candidates, self.peer])
        return proposal_time(ready, ranked.index(self.peer), self.params.proposer_timeout)

    async def _propose(self) -> None:
        state, root, own = self.state, self.root, self.own
        assert state is not None and own is not None
        self._mark("proposing")
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
            if candidate.operator in self.replays.banned:
                reason = self.replays.banned[candidate.operator]
            elif candidate.operator in operators:
                reason = "one operator twice"
            elif candidate.blob in blobs:
                reason = "a copy (blob already named)"
            elif await trio.to_thread.run_sync(self.fetcher.author, candidate.blob) != peer:
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
                data = await trio.to_thread.run_sync(self.fetcher.load, blob)
                reason = await trio.to_thread.run_sync(score, state, root, peer, data)
                if reason:
                    say(self.label, f"round {state.round}: left out {peer[-6:]}: {reason}")
                    self.refused_updates.append(
                        {"round": state.round, "peer": peer, "blob": blob, "reason": reason}
                    )
                    del updates[peer]
        included = select_for_closure(updates)
        entries = [(x.peer, x.blob) for x in included]
        agg, result, _ = await self._aggregated(entries)
        if (self.state, self.root) != (state, root):
            return
        self._offer(agg.state, result)
        # The closure names the state blob by its ID, hashed here; the blob is stored
        # after the closure is out (the others compute the state themselves, and a worker
        # catching up retries a provider that does not hold it yet).
        blocks = state_blocks(agg.state)
        blob = await trio.to_thread.run_sync(lambda: blob_id_of(blocks))
        closure = Closure(self.params.run_id, state.round, root, self.peer, included, result, blob)
        body, attestation = await self.signing.sign(
            lambda: sign_closure(
                self.signing.signer,
                closure,
                kernel_class=self.signing.kernel_class,
                certificate=self.certificate,
                time=int(time.time()),
            )
        )
        try:
            checked = check_closure(
                body, attestation, run=self.params.run_id, trust=self.trust, now=time.time()
            )
        except Refused as exc:  # our own closure: a bug, but one the run survives
            say(self.label, f"BUG: our own closure is invalid ({exc}); not proposing")
            return
        self.proposed[checked.digest] = (agg, blob, state_size(blocks))
        self.book.add(checked)
        self.fetcher.learn_closure(checked, tuple(self.node.reachable_addrs))
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
        await self.links.announce("closure", encode_message(message))
        if await self.node.add_blocks(blocks) != blob:
            raise AssertionError("the state blob's ID changed between hashing and storing")
