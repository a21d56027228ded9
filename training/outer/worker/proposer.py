"""This worker's update and the closures it proposes (point 2 of
:mod:`training.outer.worker`): the update stored with its inner state and commitment,
and attested; a closure's updates chosen, signed and announced.

1. An update's blobs are the update, the inner state before the round, for an overlapped
   round the state its steps started from, and the commitment naming them
   (``training.outer.replay`` rule 1); own inner states and starting states older than
   ``keep_states`` rounds are deleted.
2. A closure names each operator once and each blob at most once. It includes no
   excluded operator's update; in a run that asks more than bounded updates, none whose
   commitment offers less than the run's level; none the run's score refuses; none it
   could not fetch by its slot. Each of these it names as left out, with its reason, so
   its author counts toward the quorum (outer_agreement rule 7), unless its blob is named
   otherwise (a copy: it shows a key was up, not that it did any work); each pass heard
   it names as passed. A closure may include nothing: the state then carries over. The updates it
   judged and left out are listed in ``refused`` (those merely not fetched are not).
5. A pass (this worker's trainer had nothing for the round) is attested over the round's
   start root (``training.outer.messages.PASS_KIND``) and announced in place of an update.
3. The closure travels in compact form; its full form is a blob others may fetch. It names
   the state blob by its ID, hashed; the blob is stored after the closure is out (the
   others compute the state themselves, and a worker catching up retries a provider that
   does not hold it yet).
4. A closure this worker proposed keeps its aggregate until it is adopted or a later
   state makes it moot, so adopting it recomputes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from blobstore import blob_id_of
from identity import Attestation, TrustStore, sign_attestation
from training.outer.aggregate import Aggregate
from training.outer.agreement import (
    Closure,
    ClosureBook,
    Included,
    LeftOut,
    Passed,
    check_closure,
    compact_body,
    select_for_closure,
    sign_closure,
)
from training.outer.loop import OuterState
from training.outer.messages import (
    PASS_KIND,
    UPDATE_KIND,
    Candidate,
    ClosureAnnouncement,
    ClosureRefAnnouncement,
    PassAnnouncement,
    PassHeard,
    Refused,
    UpdateAnnouncement,
    encode_message,
    pass_digest,
)
from training.outer.params import WorkerConfig
from training.outer.replay import (
    BadCommitment,
    UpdateCommitment,
    decode_commitment,
    inner_digest,
    loss_bits,
)
from training.outer.runs import Retention, drop_blob
from training.outer.state_blob import state_blocks, state_size
from training.outer.trainer import Trained
from training.outer.verification import Level
from training.outer.worker.fetcher import BlobFetcher
from training.outer.worker.links import Links
from training.outer.worker.records import Own
from training.outer.worker.signals import say
from training.outer.worker.signing import Signing

if TYPE_CHECKING:
    from p2p.node.node import Node


# Updates left out that the worker remembers (its result file lists the first 256): a
# round's worth for the largest run, many times over.
MAX_REFUSED = 4096


class Proposer:
    """This worker's updates and closures (see the module's rules)."""

    def __init__(
        self,
        config: WorkerConfig,
        node: Node,
        trust: TrustStore,
        book: ClosureBook,
        fetcher: BlobFetcher,
        links: Links,
        signing: Signing,
        retention: Retention,
        *,
        label: str,
    ) -> None:
        self.config = config
        self.params = config.params
        self.node = node
        self.peer = node.peer_id
        self.trust = trust
        self.book = book
        self.fetcher = fetcher
        self.links = links
        self.signing = signing
        self.retention = retention
        self.label = label
        self.refused: list[dict[str, Any]] = []  # updates left out of our closures (rule 2)
        # Our closures' aggregates (rule 4): digest -> (aggregate, state blob, its size).
        self.proposed: dict[bytes, tuple[Aggregate, str, int]] = {}

    async def commit(self, state: OuterState, root: str, trained: Trained) -> tuple[Own, bytes]:
        """Store and attest ``trained``, this worker's update from ``state`` (of root
        ``root``; rule 1): the update and its announcement."""
        node, params = self.node, self.params
        blob = await node.add_bytes(trained.update)
        inner = await node.add_bytes(trained.inner_before)
        kept = [inner]
        origin = ""
        if trained.origin:
            origin = await node.add_bytes(trained.origin)
            kept.append(origin)
        for held in kept:
            for old in self.retention.inner(state.round, held):
                await trio.to_thread.run_sync(drop_blob, node.store, old)
        commitment = UpdateCommitment(
            params.run_id,
            state.round,
            root,
            self.peer,
            self.config.shard,
            params.inner_steps,
            params.batch,
            trained.rows.astype("<u4").tobytes(),
            loss_bits(trained.losses),
            params.chunk,
            params.k,
            inner,
            inner_digest(trained.inner_after),
            blob,
            self.config.level,
            origin,
            trained.moved_at or 0,
        )
        commitment_blob = await node.add_bytes(commitment.encode())
        s = self.signing
        attestation = await s.sign(
            lambda: sign_attestation(
                s.signer,
                kind=UPDATE_KIND,
                digest=bytes.fromhex(blob),
                kernel_class=s.kernel_class,
                subjects=[blob, root, commitment_blob],
                time=int(time.time()),
                certificate=s.certificate,
            ).encode()
        )
        now = trio.current_time()
        size = len(trained.update)
        own = Own(state.round, root, blob, attestation, trained.losses, size, now, trained.moved_at)
        message = UpdateAnnouncement(
            params.run_id, state.round, blob, attestation, tuple(node.reachable_addrs)
        )
        return own, encode_message(message)

    async def commit_pass(self, state: OuterState, root: str) -> tuple[Own, bytes]:
        """Attest a pass for ``state`` (of root ``root``; rule 5): this worker's place in
        the round, without an update, and its announcement."""
        s, run = self.signing, self.params.run_id
        attestation = await s.sign(
            lambda: sign_attestation(
                s.signer,
                kind=PASS_KIND,
                digest=pass_digest(run, state.round, root),
                kernel_class=s.kernel_class,
                subjects=[root],
                time=int(time.time()),
                certificate=s.certificate,
            ).encode()
        )
        own = Own(state.round, root, "", attestation, [], 0, trio.current_time())
        message = PassAnnouncement(run, state.round, attestation, tuple(self.node.reachable_addrs))
        return own, encode_message(message)

    async def select(
        self,
        state: OuterState,
        root: str,
        own: Own,
        candidates: Mapping[str, Candidate],
        fetched: Mapping[str, str],
        passes: Mapping[str, PassHeard],
        banned: Mapping[str, str],
    ) -> tuple[tuple[Included, ...], tuple[LeftOut, ...], tuple[Passed, ...]]:
        """Rule 2: what our closure of ``state`` (of root ``root``) names, of our update
        (or pass), the ``candidates`` announced, the blobs ``fetched`` (peer -> blob) and
        the ``passes`` heard; ``banned``: operator -> why it is excluded."""
        updates: dict[str, tuple[str, bytes]] = {}
        left: dict[str, tuple[str, bytes, str]] = {}
        passed: dict[str, bytes] = {}
        if own.blob:
            updates[self.peer] = (own.blob, own.attestation)
        else:
            passed[self.peer] = own.attestation
        operators = {self.signing.certificate.operator}
        blobs = {own.blob} - {""}
        for peer in sorted(candidates, key=lambda p: p.encode()):
            candidate = candidates[peer]
            if peer == self.peer or candidate.operator in operators:
                # Rule 1 of outer_agreement: an operator's first key (in peer order) counts,
                # its others are not named at all.
                self._refuse(state.round, peer, candidate.blob, "one operator twice")
                continue
            operators.add(candidate.operator)
            # One blob once per closure: the author of a blob named twice is in its
            # envelope.
            reason = ""
            if candidate.operator in banned:
                reason = banned[candidate.operator]
            elif candidate.blob in blobs:
                reason = "a copy (blob already named)"
            elif fetched.get(peer) != candidate.blob:
                left[peer] = (candidate.blob, candidate.attestation, "not fetched in time")
                continue
            elif await trio.to_thread.run_sync(self.fetcher.author, candidate.blob) != peer:
                reason = "a copy (the blob's envelope names another author)"
            if reason:
                self._refuse(state.round, peer, candidate.blob, reason)
                left[peer] = (candidate.blob, candidate.attestation, reason)
                continue
            updates[peer] = (candidate.blob, candidate.attestation)
            blobs.add(candidate.blob)
        for peer in sorted(passes, key=lambda p: p.encode()):
            heard = passes[peer]
            if peer != self.peer and heard.operator not in operators:
                operators.add(heard.operator)
                passed[peer] = heard.attestation
        # Levels: only a run that asks more than bounded updates reads their commitments
        # (each read is a fetch a proposal waits on).
        leveled = updates if self.config.min_level != Level.BOUNDED else {}
        for peer, (blob, attestation) in sorted(leveled.items()):
            reason = await self._level_refusal(peer, attestation)
            if reason:
                self._refuse(state.round, peer, blob, reason)
                left[peer] = (blob, attestation, reason)
                del updates[peer]
        score = self.config.score
        if score is not None:  # the scored level (training.outer.api point 4)
            for peer, (blob, attestation) in sorted(updates.items()):
                data = await trio.to_thread.run_sync(self.fetcher.load, blob)
                reason = await trio.to_thread.run_sync(score, state, root, peer, data)
                if reason:
                    say(self.label, f"round {state.round}: left out {peer[-6:]}: {reason}")
                    self._refuse(state.round, peer, blob, reason)
                    left[peer] = (blob, attestation, reason)
                    del updates[peer]
        # One blob once per closure, left out or not: a copy of a blob named otherwise
        # shows its key was up, not that it did any work, and is not named (nor counted).
        named = {blob for blob, _ in updates.values()}
        for peer in sorted(left, key=lambda p: p.encode()):
            if left[peer][0] in named:
                del left[peer]
            else:
                named.add(left[peer][0])
        return select_for_closure(updates, left, passed)

    def _refuse(self, round_: int, peer: str, blob: str, reason: str) -> None:
        entry = {"round": round_, "peer": peer, "blob": blob, "reason": reason}
        if entry not in self.refused[-MAX_REFUSED:]:  # a selection made again adds nothing
            self.refused.append(entry)
        del self.refused[:-MAX_REFUSED]

    async def _level_refusal(self, peer: str, attestation: bytes) -> str:
        """Why an update's commitment keeps it out of this run's closures ('' if it does
        not): unavailable, malformed, or offering less than the run's minimum level."""
        fetcher = self.fetcher
        commitment = Attestation.decode(attestation).subjects[2]
        providers = [*fetcher.dialer.addrs(peer), *fetcher.everyone()]
        if not await fetcher.fetch(commitment, providers, fetcher.bound()):
            return "its commitment is unavailable"
        try:
            data = await trio.to_thread.run_sync(fetcher.load, commitment)
            level = decode_commitment(data).level
        except (BadCommitment, OSError) as exc:
            return f"bad commitment: {exc}"
        least = self.config.min_level
        if not level.at_least(least):
            return f"offers verification level {level.value!r}; the run requires {least.value!r}"
        return ""

    async def close(
        self,
        state: OuterState,
        root: str,
        named: tuple[tuple[Included, ...], tuple[LeftOut, ...], tuple[Passed, ...]],
        agg: Aggregate,
        result: str,
    ) -> None:
        """Propose the closure of ``state`` (of root ``root``) naming ``named`` (what
        :meth:`select` chose), whose aggregate ``agg`` has root ``result`` (rules 3 and
        4)."""
        blocks = state_blocks(agg.state)
        blob = await trio.to_thread.run_sync(lambda: blob_id_of(blocks))
        run = self.params.run_id
        included, left, passed = named
        closure = Closure(run, state.round, root, self.peer, included, result, blob, left, passed)
        s = self.signing
        body, attestation = await s.sign(
            lambda: sign_closure(
                s.signer,
                closure,
                kernel_class=s.kernel_class,
                certificate=s.certificate,
                time=int(time.time()),
            )
        )
        try:
            checked = check_closure(
                body,
                attestation,
                run=run,
                trust=self.trust,
                now=time.time(),
                quorum=self.params.needed,
            )
        except Refused as exc:  # our own closure: a bug, but one the run survives
            say(self.label, f"BUG: our own closure is invalid ({exc}); not proposing")
            return
        self.proposed[checked.digest] = (agg, blob, state_size(blocks))
        self.book.add(checked)
        addrs = tuple(self.node.reachable_addrs)
        self.fetcher.learn_closure(checked, addrs)
        full = await self.node.add_bytes(
            encode_message(ClosureAnnouncement(run, body, attestation, ()))
        )
        message = ClosureRefAnnouncement(run, compact_body(body), attestation, full, addrs)
        await self.links.announce("closure", encode_message(message))
        if await self.node.add_blocks(blocks) != blob:
            raise AssertionError("the state blob's ID changed between hashing and storing")

    def taken(self, digest: bytes) -> tuple[Aggregate, str, int] | None:
        """Our closure's aggregate, state blob and its size, once (rule 4)."""
        return self.proposed.pop(digest, None)

    def entered(self, round_: int) -> None:
        """The worker holds a state of ``round_``: our closures of rounds before it lost
        (or were adopted and taken); should one win later, applying it recomputes it."""
        self.proposed = {d: v for d, v in self.proposed.items() if v[0].state.round > round_}
