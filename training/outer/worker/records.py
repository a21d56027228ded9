"""What a worker records: each round it adopted (:class:`RoundRecord`, the result file's
``rounds``) and its own update of the current round (:class:`Own`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    """What a worker did for one round (the result file's ``rounds``)."""

    round: int
    start_root: str
    root: str
    state_blob: str
    closure: str  # the closure's digest, hex
    closure_blob: str
    proposer: str
    how: str  # "proposed", "applied" or "caught up"
    included: list[dict[str, str]] = field(default_factory=list)
    excluded: list[dict[str, str]] = field(default_factory=list)
    # Updates the closure left out (peer, blob, the proposer's reason) and the workers it
    # names as passed: present, each counted toward the quorum, nothing of theirs applied.
    left: list[dict[str, str]] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    mean_loss: float = float("nan")
    update_bytes: int = 0
    state_bytes: int = 0
    seconds: float = 0.0
    # Payload bytes this worker's TCP sockets sent / received since the previous record
    # (p2p.transport.meter): announcements, closures, attestations and blobs alike.
    wire_sent: int = 0
    wire_received: int = 0
    milestone_blob: str = ""
    pubsub_sent: int = 0  # announcement payloads published (own messages, once each)
    pubsub_received: int = 0  # announcement payloads delivered to this worker
    named: list[dict[str, str]] = field(default_factory=list)  # caught-up rounds only
    ahead: bool = False  # applied from the aggregate computed ahead (aggregator rule 2)
    # Where the round's communication went: seconds from this worker's update handed over
    # by its trainer to "announced", "ready" (the updates a closure waits for are in),
    # "proposing" (its own closure begun) or "closure" (another's checked), and "applied"
    # (the next state offered to the trainer). Rounds this worker sent an update in only.
    phases: dict[str, float] = field(default_factory=dict)
    # An overlapped round (training.outer.trainer rule 5): the inner step at which this
    # worker's own update of the round moved by the delayed outer step (H: after its last
    # step); None for an update trained from the round's state, or none.
    moved_at: int | None = None


@dataclass
class Own:
    """This worker's update for one (round, root), or its pass (``blob`` "", no losses)."""

    round: int
    root: str
    blob: str
    attestation: bytes
    losses: list[float]
    size: int
    announced_at: float
    moved_at: int | None = None  # RoundRecord.moved_at
