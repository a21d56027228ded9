"""What a worker keeps of the rounds it adopted (points 5, 7 and 8 of
:mod:`training.outer.worker`).

1. The result file's rounds: one :class:`RoundRecord` a round; adopting a round of another
   chain (a catch-up to a better sibling) drops the records of the dead branch.
2. In the store, each adopted round's closure as a tagged blob, with a signed milestone
   when recomputed (``training.outer.milestones`` rule 2), a signed catch-up record when
   caught up over (rule 5), or, for a joiner's first state, the ``start`` tag; and its
   state blob tagged ``outer/<run>/state/<round>``.
3. State blobs older than ``keep_states`` rounds are untagged and deleted
   (``training.outer.runs.Retention``).
4. The closures of the last two rounds: a milestone names the workers the previous
   round's closure named and its own does not.
5. Where the worker keeps one, its resume point after each round it trained
   (``training.outer.trainer`` rule 1): the inner state and the record tagged, the record
   before deleted, the inner state before untagged.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio

from blobstore import StoreError
from training.outer.aggregate import Aggregate
from training.outer.agreement import CheckedClosure
from training.outer.loop import OuterState
from training.outer.milestones import (
    RunTerms,
    catch_up_for,
    keep_catch_up,
    keep_round,
    milestone_for,
    sign_catch_up,
    sign_milestone,
    tag,
)
from training.outer.params import RunParams
from training.outer.runs import Retention, drop_blob
from training.outer.trainer import ResumePoint, resume_tags
from training.outer.worker.records import RoundRecord
from training.outer.worker.signing import Signing

if TYPE_CHECKING:
    from p2p.node.node import Node


class Keeper:
    """The rounds a worker adopted, in its result and its store (see the module's rules)."""

    def __init__(
        self, params: RunParams, node: Node, signing: Signing, retention: Retention
    ) -> None:
        self.params = params
        self.node = node
        self.signing = signing
        self.retention = retention
        self.records: dict[int, RoundRecord] = {}
        self.adopted: dict[int, CheckedClosure] = {}  # round -> closure, the last two (rule 4)

    def terms(self) -> RunTerms:
        """What this run's milestones sign of its parameters (outer_milestones rule 1)."""
        p = self.params
        outer = p.outer_config()
        return RunTerms(p.rounds, p.replay_rate, outer.lr, outer.momentum, p.needed)

    def record(self, record: RoundRecord) -> None:
        """Rule 1."""
        previous = self.records.get(record.round - 1)
        stale = previous is not None and previous.root != record.start_root
        for old in [r for r in self.records if r >= record.round or stale]:
            del self.records[old]  # a dead branch (we caught up to another chain)
        self.records[record.round] = record

    async def keep(
        self,
        state: OuterState,
        checked: CheckedClosure,
        agg: Aggregate | None,
        record: RoundRecord,
        *,
        caught_up_from: int | None,
    ) -> None:
        """Rules 2 to 4 for the round ``checked`` closed, whose result is ``state``
        (stored as ``record.state_blob``; ``record.closure_blob`` is the closure's blob):
        with ``agg`` it was recomputed here; without, caught up over from state round
        ``caught_up_from`` (None: a joiner's first state)."""
        c = checked.closure
        store = self.node.store
        closure_blob = record.closure_blob
        s = self.signing
        parent = self.adopted.get(c.round - 1)  # absent_workers checks it is the parent
        if agg is not None:
            milestone = await s.sign(
                lambda: sign_milestone(
                    s.signer,
                    milestone_for(checked, agg, self.terms(), parent),
                    kernel_class=s.kernel_class,
                    certificate=s.certificate,
                    time=int(time.time()),
                )
            )
            record.milestone_blob = await self.node.add_bytes(milestone)
            await trio.to_thread.run_sync(
                lambda: keep_round(
                    store, checked, closure_blob=closure_blob, milestone_blob=record.milestone_blob
                )
            )
        elif caught_up_from is not None:
            # Not recomputed: a signed catch-up record says so (outer_milestones rule 5).
            since = caught_up_from
            catch_up = await s.sign(
                lambda: sign_catch_up(
                    s.signer,
                    catch_up_for(checked, since),
                    kernel_class=s.kernel_class,
                    certificate=s.certificate,
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
            start = tag(self.params.run_id, "start")
            await trio.to_thread.run_sync(store.tag, start, record.state_blob)
        name = tag(self.params.run_id, "state", state.round)
        await trio.to_thread.run_sync(store.tag, name, record.state_blob)
        await trio.to_thread.run_sync(
            store.tag, tag(self.params.run_id, "closure", c.round), closure_blob
        )
        for old_tag, old_blob in self.retention.state(state.round, name, record.state_blob):
            try:
                if old_tag:
                    await trio.to_thread.run_sync(store.untag, old_tag)
            except StoreError:
                pass
            await trio.to_thread.run_sync(drop_blob, store, old_blob)

    def adopt(self, checked: CheckedClosure) -> None:
        """Rule 4: ``checked`` is the closure of the round adopted last."""
        r = checked.closure.round
        self.adopted = {k: x for k, x in self.adopted.items() if r - 2 < k < r}
        self.adopted[r] = checked

    async def keep_resume(self, round_: int, inner: bytes, sampler: bytes, layout: str) -> None:
        """Rule 5: the resume point after this worker trained round ``round_``: its inner
        state after it (``inner``), its sampler's state and its model's layout digest."""
        store = self.node.store
        record_tag, inner_tag = resume_tags(self.params.run_id)
        inner_blob = await self.node.add_bytes(inner)
        point = ResumePoint(
            self.params.run_id, self.node.peer_id, round_, layout, inner_blob, sampler
        )
        blob = await self.node.add_bytes(point.encode())
        before = store.tags().get(record_tag)
        await trio.to_thread.run_sync(store.tag, inner_tag, inner_blob)
        await trio.to_thread.run_sync(store.tag, record_tag, blob)
        if before is not None and before != blob:
            await trio.to_thread.run_sync(drop_blob, store, before)
