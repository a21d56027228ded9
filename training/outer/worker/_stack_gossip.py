"""Hearing the run's topic: announcements into the ledger, closures into the book.

1. An update heard for the current round is fetched at once (a task of the round).
2. A closure counts only as its proposer's own copy, checked (and, in a run that
   requires hardware, TPM co-signed: messages rule 7) before it enters the book; refused
   ones are listed, at most 64.
3. A compact closure (outer_agreement rule 5) is expanded from the update attestations
   held (at most ``MAX_ATTESTATIONS``, for the rounds a closure may still name), else its
   full blob is fetched (at most ``MAX_CLOSURE_FETCHES`` at once) and must match it.
"""

from __future__ import annotations

import time

import trio

from training.outer.agreement import BadClosure, check_closure, compact_body, expand_body
from training.outer.messages import (
    BadMessage,
    Candidate,
    ClosureAnnouncement,
    ClosureHeard,
    ClosureRefHeard,
    Event,
    Refused,
    Rejection,
    StateHeard,
    VerdictHeard,
    decode_message,
)
from training.outer.milestones import closure_hardware
from training.outer.worker._stack_state import WorkerState
from training.outer.worker.signals import say

# Update attestations kept for expanding compact closures: two rounds of the largest run's
# workers, with room for the re-announcements of a round that changed root.
MAX_ATTESTATIONS = 1024
# Full closures fetched at once (for compact ones we could not expand): a handful of
# siblings per round (outer_agreement.MAX_CLOSURES_PER_ROUND) is all a run has.
MAX_CLOSURE_FETCHES = 16


class WorkerGossip(WorkerState):
    """The run's topic into the ledger and the book (see :mod:`training.outer.worker._stack_gossip`)."""

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
                say(
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
                self.replays.hear(event, self.state.round if self.state else None, time.time())
        if events:
            self.changes.set()

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
                say(self.label, f"refused a closure from {event.peer}: {refused}")
            return
        if checked.closure.proposer != event.peer:
            return  # relayed under another sender's name: the proposer's own copy counts
        self.dialer.learn(event.peer, event.addrs, trio.current_time())
        if self.book.add(checked):
            self.fetcher.learn_closure(checked, event.addrs)

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
            and self.tasks.running
        ):
            self.closure_fetches.add(msg.full)
            self.tasks.start(self._fetch_closure, event)

    async def _fetch_closure(self, event: ClosureRefHeard) -> None:
        msg = event.message
        try:
            providers = [*msg.addrs, *self.fetcher.everyone()]
            if not await self.fetcher.fetch(msg.full, providers, self.fetcher.bound()):
                return
            data = await trio.to_thread.run_sync(self.fetcher.load, msg.full)
            try:
                full = decode_message(data)
                same = isinstance(full, ClosureAnnouncement) and (
                    full.attestation == msg.attestation and compact_body(full.body) == msg.compact
                )
            except (BadMessage, BadClosure):
                same = False
            if not same or not isinstance(full, ClosureAnnouncement):
                say(self.label, f"closure blob {msg.full[:12]} is not the announced closure")
                return
            self._hear_closure(ClosureHeard(event.peer, full.body, full.attestation, msg.addrs))
            self.changes.set()
        finally:
            self.closure_fetches.discard(msg.full)
