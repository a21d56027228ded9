"""The closures a worker hears, into its book (``agreement.ClosureBook``).

1. A closure counts only as its proposer's own copy, checked (the run's quorum
   included, outer_agreement rule 7; and, in a run that requires hardware, TPM co-signed:
   messages rule 7) before it enters the book; refused ones are listed, at most
   ``MAX_REFUSED``.
2. A compact closure (outer_agreement rule 5) is expanded from the update and pass
   attestations held (at most ``MAX_ATTESTATIONS``, for the rounds a closure may still
   name), else its full blob is fetched (at most ``MAX_CLOSURE_FETCHES`` at once) and
   must match it.
3. A closure whose result this worker could not recompute is no tip
   (:meth:`Closures.mark_bad`), and listed with its reason.
4. A closure whose blobs could not be fetched in time (the network's fault, or its
   proposer's) stays the tip for ``UNAVAILABLE_TRIES`` fetch bounds, so this worker does
   not propose a rival closure and fork; only then is it no tip (rule 4 of
   outer_agreement).
"""

from __future__ import annotations

import time
from typing import Any

import trio

from identity import TrustStore
from training.outer.agreement import (
    BadClosure,
    CheckedClosure,
    ClosureBook,
    check_closure,
    compact_body,
    expand_body,
)
from training.outer.messages import (
    BadMessage,
    ClosureAnnouncement,
    ClosureHeard,
    ClosureRefHeard,
    Refused,
    decode_message,
)
from training.outer.milestones import closure_hardware
from training.outer.worker.fetcher import BlobFetcher
from training.outer.worker.signals import Changes, Tasks, say

# Update attestations kept for expanding compact closures: two rounds of the largest run's
# workers, with room for the re-announcements of a round that changed root.
MAX_ATTESTATIONS = 1024
# Full closures fetched at once (for compact ones we could not expand): a handful of
# siblings per round (outer_agreement.MAX_CLOSURES_PER_ROUND) is all a run has.
MAX_CLOSURE_FETCHES = 16
# Fetch bounds a closure's blobs may fail before the closure is dropped (rule 4): long
# enough to outlast a worker's own pause or a peer's restart.
UNAVAILABLE_TRIES = 4
# Refused closures heard that the result file lists (a peer may send any number).
MAX_REFUSED = 64


class Closures:
    """Closures heard, checked into ``book`` (see the module's rules)."""

    def __init__(
        self,
        run: str,
        trust: TrustStore,
        book: ClosureBook,
        fetcher: BlobFetcher,
        changes: Changes,
        tasks: Tasks,
        *,
        quorum: int,
        require_hardware: bool,
        label: str,
    ) -> None:
        """``quorum``: the run's (outer_agreement rule 7), which every closure must meet."""
        self.run = run
        self.quorum = quorum
        self.trust = trust
        self.book = book
        self.fetcher = fetcher
        self.changes = changes
        self.tasks = tasks
        self.require_hardware = require_hardware
        self.label = label
        # (peer, blob) -> (round, its update attestation), for expanding compact closures.
        self.attestations: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.fetching: set[str] = set()  # full closure blobs being fetched
        self.refused: list[dict[str, Any]] = []  # closures refused or marked bad, and why
        self.unavailable: dict[bytes, int] = {}  # closure digest -> failed fetch bounds

    def hear(self, event: ClosureHeard, now: float) -> None:
        """A closure heard (rule 1); ``now``: the wall clock its certificates are checked
        at."""
        try:
            checked = check_closure(
                event.body,
                event.attestation,
                run=self.run,
                trust=self.trust,
                now=now,
                quorum=self.quorum,
            )
            if self.require_hardware:
                closure_hardware(checked)  # messages rule 7
        except Refused as refused:
            if len(self.refused) < MAX_REFUSED:
                self.refused.append({"peer": event.peer, "reason": refused.reason})
                say(self.label, f"refused a closure from {event.peer}: {refused}")
            return
        if checked.closure.proposer != event.peer:
            return  # relayed under another sender's name: the proposer's own copy counts
        self.fetcher.dialer.learn(event.peer, event.addrs, trio.current_time())
        if self.book.add(checked):
            self.fetcher.learn_closure(checked, event.addrs)

    def keep_attestation(self, round_: int, peer: str, blob: str, attestation: bytes) -> None:
        """Update and pass attestations heard, by (peer, blob; a pass's blob is ""):
        compact closures name them by digest (rule 2). Kept for the rounds a closure may
        still name."""
        if len(self.attestations) >= MAX_ATTESTATIONS:
            for key in [k for k, (r, _) in self.attestations.items() if r < round_ - 1]:
                del self.attestations[key]
        if len(self.attestations) < MAX_ATTESTATIONS:
            self.attestations[(peer, blob)] = (round_, attestation)

    def _attestation_of(self, peer: str, blob: str) -> bytes | None:
        held = self.attestations.get((peer, blob))
        return None if held is None else held[1]

    def hear_compact(self, event: ClosureRefHeard, now: float) -> None:
        """A compact closure: expand it from the attestations we hold, or fetch it whole."""
        msg = event.message
        if msg.run != self.run:
            return
        try:
            full = expand_body(msg.compact, self._attestation_of)
        except BadClosure as exc:
            if len(self.refused) < MAX_REFUSED:
                self.refused.append({"peer": event.peer, "reason": str(exc)})
            return
        if full is not None:
            self.hear(ClosureHeard(event.peer, full, msg.attestation, msg.addrs), now)
        elif (
            msg.full not in self.fetching
            and len(self.fetching) < MAX_CLOSURE_FETCHES
            and self.tasks.running
        ):
            self.fetching.add(msg.full)
            self.tasks.start(self._fetch, event)

    async def _fetch(self, event: ClosureRefHeard) -> None:
        msg = event.message
        fetcher = self.fetcher
        try:
            providers = [*msg.addrs, *fetcher.everyone()]
            if not await fetcher.fetch(msg.full, providers, fetcher.bound()):
                return
            data = await trio.to_thread.run_sync(fetcher.load, msg.full)
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
            closure = ClosureHeard(event.peer, full.body, full.attestation, msg.addrs)
            self.hear(closure, time.time())
            self.changes.set()
        finally:
            self.fetching.discard(msg.full)

    def mark_bad(self, checked: CheckedClosure, reason: str) -> None:
        """Rule 3: ``checked`` is no tip, for ``reason``."""
        self.book.mark_bad(checked.digest, reason)
        self.refused.append(
            {"peer": checked.closure.proposer, "round": checked.closure.round, "reason": reason}
        )
        say(self.label, f"closure {checked.digest.hex()[:12]} is no tip: {reason}")

    def unavailable_once(self, checked: CheckedClosure) -> None:
        """Rule 4: ``checked``'s blobs could not be fetched within one fetch bound."""
        tries = self.unavailable.get(checked.digest, 0) + 1
        self.unavailable[checked.digest] = tries
        if tries >= UNAVAILABLE_TRIES:
            self.mark_bad(checked, f"blobs unavailable after {tries} tries")
        else:
            say(self.label, f"closure {checked.digest.hex()[:12]}: blobs unavailable, retrying")
