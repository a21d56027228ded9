"""The verification level of every update a run applied, checked against its spec.

1. Each update's commitment (``training.outer.replay``, named by the update attestation a
   closure carries) says the level its worker offered: ``bounded``, ``scored`` or
   ``replayed`` (``training.outer.spec`` point 3). Workers fetch the commitments of the
   updates they apply and keep them, so a worker's store can answer for the whole run.
2. :func:`check_levels` walks the closures kept in a store (tagged
   ``outer-<run>-closure-<round>``) and reports, per round, each included update's level;
   an update below the spec's minimum, or whose commitment this store lacks or cannot
   parse, is a failure.

Pure reads of the store; no clock, no network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from training.outer.verification import Level

if TYPE_CHECKING:
    from blobstore import Store


@dataclass
class LevelReport:
    minimum: Level
    rounds: dict[int, list[dict[str, str]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rounds) and not self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "minimum": self.minimum,
            "rounds": {str(r): v for r, v in sorted(self.rounds.items())},
            "failures": self.failures,
            "ok": self.ok,
        }


def check_levels(store: Store, run: str, minimum: Level) -> LevelReport:
    """Point 2: each applied update's level in this store, against ``minimum``."""
    from identity import Attestation
    from training.outer.agreement import BadClosure, decode_closure
    from training.outer.messages import BadMessage, ClosureAnnouncement, decode_message
    from training.outer.milestones import tag
    from training.outer.replay import BadCommitment, decode_commitment

    report = LevelReport(minimum)
    prefix = tag(run, "closure") + "-"
    for name, blob in sorted(store.tags().items()):
        if not (name.startswith(prefix) and name[len(prefix) :].isdigit()):
            continue
        round_ = int(name[len(prefix) :])
        try:
            message = decode_message(store.path(blob).read_bytes())
            if not isinstance(message, ClosureAnnouncement):
                raise BadMessage("not a closure")
            closure = decode_closure(message.body)
        except (BadMessage, BadClosure, OSError) as exc:
            report.failures.append(f"round {round_}: closure {blob[:12]} unreadable: {exc}")
            continue
        entries = report.rounds.setdefault(round_, [])
        for item in closure.included:
            commitment = Attestation.decode(item.attestation).subjects[2]
            try:
                level = decode_commitment(store.path(commitment).read_bytes()).level
            except (BadCommitment, OSError, ValueError) as exc:
                entries.append({"peer": item.peer, "update": item.blob, "level": "unknown"})
                report.failures.append(
                    f"round {round_}: update {item.blob[:12]} of {item.peer[-8:]}: its "
                    f"commitment {commitment[:12]} is not here or unreadable ({exc})"
                )
                continue
            entries.append({"peer": item.peer, "update": item.blob, "level": level})
            if not level.at_least(minimum):
                report.failures.append(
                    f"round {round_}: update {item.blob[:12]} of {item.peer[-8:]} offers "
                    f"{level.value!r}; the run requires {minimum.value!r}"
                )
    return report
