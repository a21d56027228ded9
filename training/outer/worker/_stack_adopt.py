"""Adopting a state (points 2b, 5 and 7 of :mod:`training.outer.worker`): applying a
closure (fetch its updates, aggregate, check the result root and state blob), catching up
from its state blob, and keeping the round adopted.

1. A closure whose result differs from what this worker computes, or whose state blob is
   not its result, is no tip (``ClosureBook.mark_bad``).
2. A closure whose blobs cannot be fetched stays the tip for ``UNAVAILABLE_TRIES`` fetch
   bounds (so this worker proposes no rival closure), then is dropped.
3. An adopted round is kept: its closure as a tagged blob, with a signed milestone when
   recomputed, a signed catch-up record when caught up over, or, for a joiner's first
   state, the ``start`` tag; state blobs older than ``keep_states`` rounds are dropped.
4. Ahead of the closure: once this worker's update is out, every worker's update is
   fetched and another worker ranks first to propose, it aggregates those updates while
   the proposer does the same (the aggregate is a pure function of the state and the
   named blobs), so a closure naming exactly them is applied without aggregating again.
   One such aggregate a round, and a second state is never made while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import trio

from blobstore import StoreError
from identity import Attestation
from training.outer.aggregate import Aggregate, aggregate, rooted
from training.outer.agreement import CheckedClosure, proposer_order
from training.outer.loop import OuterState, state_root
from training.outer.messages import ClosureAnnouncement, encode_message
from training.outer.milestones import (
    RunTerms,
    absent_workers,
    catch_up_for,
    keep_catch_up,
    keep_round,
    milestone_for,
    sign_catch_up,
    sign_milestone,
    tag,
)
from training.outer.runs import drop_blob
from training.outer.state_blob import BadStateBlob, decode_state, state_blocks, state_size
from training.outer.worker._stack_state import RoundRecord, WorkerState, _Ahead
from training.outer.worker.fetcher import FETCH_STALL
from training.outer.worker.signals import names, say

# Fetch bounds a closure's blobs may fail before the closure is dropped (rule 4 of
# outer_agreement): long enough to outlast a worker's own pause or a peer's restart.
UNAVAILABLE_TRIES = 4


class WorkerAdopt(WorkerState):
    """Applying a closure, catching up, keeping the round (see
    :mod:`training.outer.worker._stack_adopt`)."""

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
            milestone = await self.signing.sign(
                lambda: sign_milestone(
                    self.signing.signer,
                    milestone_for(checked, agg, self._terms(), parent),
                    kernel_class=self.signing.kernel_class,
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
            catch_up = await self.signing.sign(
                lambda: sign_catch_up(
                    self.signing.signer,
                    catch_up_for(checked, since),
                    kernel_class=self.signing.kernel_class,
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
        self.adopted = {r: x for r, x in self.adopted.items() if c.round - 2 < r < c.round}
        self.adopted[c.round] = checked

    def _terms(self) -> RunTerms:
        """What this run's milestones sign of its parameters (outer_milestones rule 1)."""
        outer = self.params.outer_config()
        return RunTerms(self.params.rounds, self.params.replay_rate, outer.lr, outer.momentum)

    def _enter(self, state: OuterState, root: str) -> None:
        """Make ``state`` current: a new round of updates, fetches and announcements."""
        self.previous = {}
        if self.state is not None and state.round == self.state.round + 1:
            sent = {peer: c.blob for peer, c in self.candidates.items()}
            own = self.own
            if own is not None and (own.round, own.root) == (self.state.round, self.root):
                sent[self.peer] = own.blob
            self.previous = self._distinct(sent)
        self.state = state
        self.root = root
        self.candidates = {}
        self.fetched = {}
        self.round_started = trio.current_time()
        self.metrics.outer_round.set(state.round)
        self.announcer.drop("update")
        if self.records:  # a round closed: every worker is past the start barrier
            self.announcer.drop("hello")
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
        if self.config.min_level != "bounded":
            for x in c.included:
                commitment = Attestation.decode(x.attestation).subjects[2]
                await self.fetcher.fetch(
                    commitment, self.fetcher.providers(checked, [x.peer]), FETCH_STALL
                )
        agg, root, ahead = await self._aggregated(entries)
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

    async def _aggregated(self, entries: Sequence[tuple[str, str]]) -> tuple[Aggregate, str, bool]:
        """The aggregate of ``entries`` on the current state, its root, and whether it was
        computed ahead (point 4: used if it is of exactly these; else computed now, after
        any still running, so one extra state at a time)."""
        state, root = self.state, self.root
        assert state is not None
        ahead = self.ahead
        if ahead is not None:
            await ahead.done.wait()
            result, ahead.result = ahead.result, None  # taken once; the round's mark stays
            named = tuple(sorted(entries, key=lambda e: e[0].encode()))
            if result is not None and (ahead.round, ahead.root, ahead.entries) == (
                state.round,
                root,
                named,
            ):
                return (*result, True)
            del result
        agg, result_root = await self._aggregate(state, root, entries)
        return agg, result_root, False

    async def _aggregate(
        self, state: OuterState, root: str, entries: Sequence[tuple[str, str]]
    ) -> tuple[Aggregate, str]:
        """The aggregate of ``entries`` on ``state`` (of root ``root``) and its root, in a
        thread."""
        config = self.params.outer_config()
        return await trio.to_thread.run_sync(
            lambda: rooted(aggregate(state, entries, self.fetcher.load, config, start_root=root))
        )

    def _speculate(self) -> None:
        """Point 4: start this round's aggregate ahead of its closure, when it is due."""
        state, root, own = self.state, self.root, self.own
        if state is None or own is None or not self.tasks.running:
            return
        if (own.round, own.root) != (state.round, root):
            return
        last = self.ahead  # one a round, and one extra state at a time
        if last is not None and (
            (last.round, last.root) == (state.round, root) or not last.done.is_set()
        ):
            return
        nameable = self._nameable()
        if len(nameable) < self._expected():
            return
        if proposer_order(root, [*self.candidates, self.peer])[0] == self.peer:
            return  # we propose first, and _propose aggregates
        self.ahead = ahead = _Ahead(state.round, root, tuple(nameable.items()), trio.Event())
        self.tasks.start(self._aggregate_ahead, ahead, state)

    async def _aggregate_ahead(self, ahead: _Ahead, state: OuterState) -> None:
        try:
            ahead.result = await self._aggregate(state, ahead.root, ahead.entries)
        except OSError:  # a blob gone: the apply, should it come, fetches and says so
            ahead.result = None
        finally:
            if (self.state_round(), self.root) != (ahead.round, ahead.root):
                ahead.result = None  # the state moved on meanwhile: for nobody
            ahead.done.set()

    async def _catch_up(self, checked: CheckedClosure) -> None:
        c = checked.closure
        providers = self.fetcher.providers(checked, [c.proposer])
        if not await self._fetch_named(checked, c.state_blob, providers):
            self._unavailable(checked)
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

    def _unavailable(self, checked: CheckedClosure) -> None:
        """A closure whose blobs could not be fetched in time: the network's fault, or its
        proposer's. It stays the tip (so this worker does not propose a rival closure and
        fork) for ``UNAVAILABLE_TRIES`` fetch bounds; only then is it dropped."""
        tries = self.unavailable.get(checked.digest, 0) + 1
        self.unavailable[checked.digest] = tries
        if tries >= UNAVAILABLE_TRIES:
            self.closures.mark_bad(checked, f"blobs unavailable after {tries} tries")
        else:
            say(self.label, f"closure {checked.digest.hex()[:12]}: blobs unavailable, retrying")
