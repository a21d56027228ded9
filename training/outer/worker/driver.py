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
   nothing else ever sees a half-changed state. The hello (presence, for the start
   barrier) stays announced until a round closes and is re-sent at once whenever a worker
   is heard of for the first time: one that subscribed after it went out would otherwise
   wait at the barrier for the first update announcement. A joiner says hello once it
   has joined: the others count a late update (one that comes after its round's closure,
   as a joiner's first ones do: it aggregates no round ahead) toward the next round's
   wait only from a worker they hold present.
2. The driver, in a loop: (a) if it holds no update for its current state and round,
   trains one (torch in a thread; messages keep flowing), unless the state changed
   meanwhile, then puts, attests and announces it; (b) asks ``next_step``: Apply (fetch the
   tip's named updates it lacks, aggregate, or take the aggregate made ahead of the
   closure, ``worker_adopt`` point 4; check the result root, offer the state to a trainer
   that takes it ahead, then store the state blob and check its ID), CatchUp (fetch the
   tip's state blob, check round and root, adopt), or Stay; (c) on Stay, proposes a
   closure when its slot comes (rule 2 of ``outer_agreement``): updates of all K workers
   fetched, or the deadline after its own announcement passed, plus its position in the
   round's rank order times the proposer timeout. The proposer offers its state as soon
   as it is aggregated and names the state blob by its hashed ID, storing it after the
   closure is out.
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

Where the code is
-----------------
This module holds :class:`Worker`'s driver (``_drive``, ``_step``, ``_round_loop``) and its
start, join and finish (``run``). The rest is built from one part per job, each a base
class in its own module, from the bottom up: :mod:`training.outer.worker._stack_state` (the
state, signing, ``blob status`` and metrics), :mod:`training.outer.worker._stack_blobs` (fetches),
:mod:`training.outer.worker._stack_links` (announcements out, dials, pauses, never alone: points
1 and 6), :mod:`training.outer.worker._stack_replay` (point 4), :mod:`training.outer.worker._stack_gossip`
(the topic into the ledger and the closure book), :mod:`training.outer.worker._stack_adopt`
(apply, catch up, keep the round: points 2b and 5) and :mod:`training.outer.worker._stack_propose`
(train and propose: points 2a and 2c).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import trio

from identity import sign_attestation
from training.outer.agreement import Apply, CatchUp
from training.outer.loop import OuterState, state_root
from training.outer.messages import STATE_KIND, Hello, StateAnnouncement, encode_message
from training.outer.milestones import tag
from training.outer.params import OuterNetError, write_json
from training.outer.state_blob import BadStateBlob, decode_state
from training.outer.trainer import Trainer
from training.outer.worker._stack_adopt import UNAVAILABLE_TRIES as UNAVAILABLE_TRIES
from training.outer.worker._stack_propose import WorkerPropose
from training.outer.worker._stack_state import RoundRecord as RoundRecord
from training.outer.worker.signals import say

# Before proposing, the worker lets messages already on the wire (buffered while it was
# busy or paused) reach its book, so it does not propose for a round already closed.
GATHER = 0.3


class Worker(WorkerPropose):
    """One worker of a run (see the theory of operation above)."""

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
                and self.config.cheat_from_round is None  # the test cheater never proposes
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
                    self.proposed_for.add(start)  # at most one closure per (round, root)
                    await self._propose()
                continue
            now = trio.current_time()
            await self.changes.wait(slot if slot is not None and slot > now else now + 1.0)

    # --- start, join, finish ---------------------------------------------------------
    async def _barrier(self) -> None:
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
        say(
            self.label,
            f"start timeout: {len(self.ledger.present) + 1} of {self.params.workers} workers "
            f"present (others: {present}); starting without the rest",
        )

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
                    self.start_blob = self.records[max(self.records)].state_blob
                    say(self.label, f"joined at round {self.state.round}")
                    await self.links.announce("hello", encode_message(hello))
                    return
            await self.changes.wait(deadline)
        raise OuterNetError("joining: heard no usable closure from an admitted worker")

    async def _finish(self) -> None:
        """Announce the final root; wait (bounded) for those of the last round's workers."""
        assert self.state is not None
        self.phase = "finishing"
        state = self.state
        blob = self.records[max(self.records)].state_blob if self.records else self.start_blob
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
        said: tuple[str, ...] = ()
        while trio.current_time() < deadline:
            waiting = (ever & set(self.node.connected_peers())) - set(
                self.ledger.roots_heard(state.round)
            )
            # The last round's sample is replayed too (its verdicts complete the milestones).
            verdicts = self.replays.pending(state.round - 1)
            if not waiting and not verdicts:
                break
            what = tuple(self._named(sorted(waiting))) + (("verdicts",) if verdicts else ())
            if what != said:  # say what it waits for when that changes, not every second
                said = what
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
        operators = {
            p: op
            for checked in self.adopted.values()
            for p, op in zip(checked.closure.peers(), checked.operators, strict=True)
        }
        return [f"{operators.get(p, 'worker')} {p[-6:]}" for p in peers]

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
            nursery.start_soon(self.links.receive_loop, sub, self.ledger, self._handle)
            nursery.start_soon(self.links.announce_loop)
            nursery.start_soon(self.links.dial_loop)
            nursery.start_soon(self.links.meter_loop)
            self.tasks.open(nursery)
            make = self.config.make_trainer or Trainer
            trainer = await trio.to_thread.run_sync(make, self.params, self.config.shard)
            kernel_class = self.signing.kernel_class = trainer.kernel_class
            self.ready = getattr(trainer, "ready", None)
            if self.certificate.kernel_class != kernel_class:
                raise OuterNetError(
                    f"this machine's kernel class is {kernel_class}, but its certificate "
                    f"admits {self.certificate.kernel_class}; get a certificate for this one"
                )
            self.shapes = trainer.shapes()
            say(self.label, f"model ready (kernel class {kernel_class})")
            if self.config.join:
                await self._join(hello)
            else:
                await self._begin(hello)
            # Rounds are counted from here: fetching the initial state is not a round's.
            wire_start = self.links.mark()
            assert self.state is not None
            initial_root = self.root
            say(self.label, f"starting at round {self.state.round} (root {self.root[:16]})")
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
            "kernel_class": self.signing.kernel_class,
            "joined_at": self.joined_at,
            "initial_root": initial_root,
            "start_state_blob": self.start_blob,
            "rounds": rounds,
            "final_round": self.state.round,
            "final_root": self.root,
            "final_roots_heard": heard,
            "refused_closures": self.closures.refused,
            "refused_updates": self.refused_updates[:256],
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
