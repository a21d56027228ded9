"""One worker of a decentralised outer-loop run: the trio shell around the sans-IO cores.

Theory of operation
-------------------
The decisions are made elsewhere, as pure functions of what the worker has heard:
which update announcements count (``training.outer.messages.Ledger``), which closure is
the tip and what to do about it (``training.outer.agreement``), how the named updates
become the next state (``training.outer.aggregate``) and when to re-send an announcement
(``training.outer.announce``). This package moves bytes between them and the node:

1. Tasks: one reads the run's gossipsub topic into the ledger and the closure book; one
   re-publishes announcements with back-off; one dials every admitted peer it has heard
   of and is not connected to, for the whole run, with back-off
   (``training.outer.announce.PeerDialer``), so the TCP connections form a mesh whoever
   bootstrapped to whom, and a worker back from a pause finds the living peers even if
   its bootstrap peers are dead; one asks its bootstrap peers who else holds the run's spec
   (or initial state) and dials whom they name, the rendezvous that puts workers given
   only a peer they share (a ``blob serve`` node) on one topic (``links`` rule 7); one
   samples the sockets' byte counts and notices a pause
   (the monotonic clock jumped): it keeps its live connections (the closures published
   meanwhile arrive over them) and dials every missing peer at once; only a state fetch
   that fails drops every connection to dial afresh; fetches run as tasks of the
   round; the driver (``_drive``) does everything that changes the worker's state, so
   nothing else ever sees a half-changed state. The hello (presence, for the start
   barrier) stays announced until a round closes and is re-sent at once whenever a worker
   is heard of for the first time: one that subscribed after it went out would otherwise
   wait at the barrier for the first update announcement. The start barrier waits for the
   run's K workers at most the start timeout, then goes on with those present if they
   hold the run's quorum (``training.outer.agreement`` rule 7), else stops (exit code
   ``NO_QUORUM``) having closed nothing. A joiner says hello once it has joined: the
   others count a late update (one that comes after its round's closure, as a joiner's
   first ones do: it aggregates no round ahead) toward the next round's wait only from a
   worker they hold present.
2. The driver, in a loop: (a) if it holds no update for its current state and round,
   trains one (torch in a thread; messages keep flowing), unless the state changed
   meanwhile, then puts, attests and announces it (a trainer that returns None for the
   round gets a pass announced instead: present, no update; the round's closure names it
   and it applies that closure like any other); (b) asks ``next_step``: Apply (fetch the
   tip's named updates it lacks, aggregate, or take the aggregate made ahead of the
   closure, ``aggregator`` rule 2; check the result root, offer the state to a trainer
   that takes it ahead, then store the state blob and check its ID), CatchUp (fetch the
   tip's state blob, check round and root, adopt), or Stay; (c) on Stay, proposes a
   closure when its slot comes (rule 2 of ``outer_agreement``): updates of all K workers
   fetched (a pass counts as one), or the deadline after its own announcement passed,
   plus its position in the round's rank order times the proposer timeout. At its slot
   it proposes only if its closure would name the run's quorum of operators (its own
   update or pass, each update and pass heard: included, left out with a reason, passed);
   below it, it says whom it waits for and waits, at most the start timeout, then stops
   (``NoQuorum``); once the quorum is back, the updates heard since get a deadline to be
   fetched before it proposes. A closure may include no update (every one scored worse, say): the
   state then carries over. The proposer offers its state as soon as it is aggregated
   and names the state blob by its hashed ID, storing it after the closure is out.
3. After the last round it waits until the tip has not changed for a settle time (a better
   closure of the last round may still arrive, and rule 3 applies to it like any other),
   announces its final root, and waits (bounded by ``fetcher.fetch_bound``), serving
   blobs, for the final roots of every worker whose update it ever applied and is still
   connected to
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
   out of every closure it proposes. A proposer waits (bounded by ``Replays.wait_bound``)
   for the verdicts on the previous round's sample before proposing, so a confirmed cheat
   is left out of the next closure it makes.
5. Disk: the state blobs of the last ``keep_states`` rounds (``WorkerConfig``) stay tagged
   ``outer/<run>/state/<round>``, its own inner-state blobs of those rounds stay; older
   ones are untagged and deleted, and a replayer deletes an inner state it fetched once
   replayed (``training.outer.runs`` point 4).
   Each applied closure is kept as a blob (tagged), with its milestone and a collection
   of the update blobs it names (``training.outer.milestones`` rule 2), so ``blob gc``
   leaves ``blob outer verify`` what it needs until ``blob outer forget``.
6. Never alone: a worker stopped past the others' last round and linger (the fetch bound)
   wakes to find them gone. Closing the remaining rounds alone (at once if it had heard
   none of their closures, else once their blobs were dropped as unavailable, rule 4 of
   outer_agreement) and exiting 0 on a rival root, "agreed" because it heard no final
   root to compare, would be a silent fork. So a worker that trained with others
   proposes, and fetches the blobs a closure names, only while connected to an admitted
   peer; with none for the fetch bound after a pause of its own (the others most likely
   went on or ended without it), or for its start timeout when its peers vanished while it
   ran (one restarting with ``--resume`` takes longer than a fetch to come back, and the
   quorum keeps it from closing rounds meanwhile), it stops with an error (a closure it
   heard whose blobs nobody left can serve does not cost it ``UNAVAILABLE_TRIES`` fetch
   bounds first). A SIGSTOPped peer's TCP
   connections stay up, so the others do not stop while it is paused. The price: the
   last survivor of a run whose other workers all died stops too instead of finishing
   alone (it cannot tell them from a run that went on without it).
7. Resume (``training.outer.trainer``'s resume points): a CLI worker keeps, each round it
   trains, its inner state after the round, tagged; ``--resume`` loads it, seeds the book
   with the last closure its store kept, and catches up from the tip as a joiner does.
8. Signing: everything the worker attests (updates, closures, verdicts, milestones,
   catch-ups, its final root) goes through the signer it is given, the machine's
   (``identity.machine_signer``): on a TPM-bound key each carries the AK's co-signature.
   In a run that requires hardware it refuses, before it starts, a signer that is not
   TPM-backed, and takes from others only TPM co-signed updates, closures and verdicts
   (``training.outer.messages`` rule 7). A round it caught up over, not recomputing it,
   it keeps with a signed catch-up record instead of a milestone
   (``training.outer.milestones`` rule 5).

Where the code is
-----------------
The :class:`Worker` (``driver``) owns the round's state and the parts, each an object
with its own state and rules, built in its constructor; none knows the Worker. In import
order:

- ``signals`` (the log line, the driver's wake-up, the run's task starter), ``records``
  (a round's record, the worker's own update), ``signing`` (one signature at a time),
  ``faults`` (what a test injects);
- ``fetcher`` (fetches and reads; the fetch bound), ``links`` (the topic in and out, dials,
  pauses, never alone, traffic: points 1 and 6);
- ``closures`` (closures heard into the book), ``replays`` (point 4), ``aggregator``
  (aggregates, one ahead of the closure), ``keeper`` (the rounds adopted, in the result
  and the store: point 5), ``proposer`` (the worker's updates and closures: point 2);
- ``driver`` (the Worker: the driver, start, join and finish).
"""
