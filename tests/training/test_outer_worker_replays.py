"""A worker's replays (training.outer.worker.replays), built without a worker: the start
states kept only where updates are sampled, a verdict counted only from the assigned
replayer on the update applied, a heard mismatch acted on only once our own replay agrees
(else recorded as a false accusation), and verdicts on a round not applied yet held."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio

from p2p.transport.meter import WireMeter
from tests.training.worker_parts import KC, PARAMS, TRUST, Machine, Node, config, machine
from training.outer.announce import Announcer, PeerDialer
from training.outer.loop import initial_state
from training.outer.messages import VerdictAnnouncement, VerdictHeard
from training.outer.milestones import tag
from training.outer.replay import MATCH, Verdict, sign_verdict
from training.outer.worker.fetcher import BlobFetcher
from training.outer.worker.links import Links
from training.outer.worker.replays import Replays, Sample
from training.outer.worker.signals import Changes, Tasks
from training.outer.worker.signing import Signing

ROOT = "cd" * 32


def replays_of(tmp_path: Path, me: Machine, rate: float = 0.25) -> tuple[Replays, Tasks, Node]:
    node = Node(tmp_path / "store", me.peer)
    cfg = config(tmp_path, dataclasses.replace(PARAMS, replay_rate=rate))
    dialer, changes, tasks = PeerDialer(), Changes(), Tasks()
    n: Any = node
    fetcher = BlobFetcher(n, cfg.params, dialer, "test")
    links = Links(
        n, "topic", Announcer(), dialer, WireMeter(), changes, alone_bound=1.0, label="test"
    )
    signing = Signing(me.signer, me.cert)
    replays = Replays(cfg, n, TRUST, fetcher, links, signing, changes, tasks, label="test")
    return replays, tasks, node


def heard(by: Machine, sample: Sample, outcome: str, signer: Machine | None = None) -> VerdictHeard:
    """``by``'s announcement of a verdict on ``sample`` (signed by ``signer``, default it)."""
    s = signer or by
    verdict = Verdict(
        PARAMS.run_id, sample.round, sample.author, sample.blob, sample.commitment, outcome
    )
    attestation = sign_verdict(
        s.signer, verdict, kernel_class=KC, certificate=s.cert, time=int(time.time())
    )
    message = VerdictAnnouncement(
        verdict.run,
        verdict.round,
        verdict.author,
        verdict.update,
        verdict.commitment,
        verdict.outcome,
        attestation,
    )
    return VerdictHeard(by.peer, message)


@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_start_states_are_kept_for_replay_only_where_updates_are_sampled(
    tmp_path: Path, rate: float
) -> None:
    """A worker keeps the states its last two rounds started from, which replaying a
    sampled update needs, and none in a run that samples none: at 124M parameters those
    are 2 GB it would hold for nothing."""
    replays, _, _ = replays_of(tmp_path, machine(), rate)
    agg: Any = SimpleNamespace(admitted=())
    state = initial_state({"w": np.zeros(3, np.float32)})
    for r in range(3):
        closure = SimpleNamespace(round=r, start_root=f"{r:02x}" * 32, included=[], result_root="")
        checked: Any = SimpleNamespace(closure=closure, operators=[])
        replays.draw_sample(checked, agg, state, time.time())
    assert sorted(replays.starts) == ([1, 2] if rate else [])


def test_a_verdict_counts_only_from_the_assigned_replayer_on_the_update_applied(
    tmp_path: Path,
) -> None:
    me, author, replayer, other = machine(), machine(), machine(), machine()
    replays, _, _ = replays_of(tmp_path, me)
    sample = Sample(2, ROOT, author.peer, "op-a", "b1" * 32, "c1" * 32, replayer.peer)
    replays.awaited[(2, author.peer)] = sample
    now = time.time()
    replays.hear(heard(other, sample, MATCH), 3, now)  # not the assigned replayer
    replays.hear(heard(replayer, sample, MATCH, signer=other), 3, now)  # not its signature
    moved = dataclasses.replace(sample, commitment="c2" * 32)
    replays.hear(heard(replayer, moved, MATCH), 3, now)  # not the commitment applied
    assert replays.verdicts == []
    assert replays.pending(2)
    replays.hear(heard(replayer, sample, MATCH), 3, now)
    replays.hear(heard(replayer, sample, "mismatch: a second word"), 3, now)  # the first counts
    assert [(v["outcome"], v["replayer"]) for v in replays.verdicts] == [(MATCH, replayer.peer)]
    assert not replays.pending(2)
    assert replays.banned == {}


def test_a_heard_mismatch_bans_only_once_our_own_replay_agrees(tmp_path: Path) -> None:
    """The assigned replayer's mismatch is not evidence on its own: this worker replays the
    update itself. Where its replay cannot say mismatch (here: the start state is not held)
    the accusation is recorded as false; where it agrees (here: the commitment is not a
    commitment), the operator is excluded. Either way the verdict is kept as a tagged blob."""
    me, author, replayer = machine(), machine(), machine()
    replays, tasks, node = replays_of(tmp_path, me)
    commitment = node.store.put_bytes(b"not a commitment")
    sample = Sample(2, ROOT, author.peer, "op-a", "b1" * 32, commitment, replayer.peer)
    replays.awaited[(2, author.peer)] = sample

    async def hear_mismatch() -> None:
        async with trio.open_nursery() as nursery:
            tasks.open(nursery)
            replays.hear(heard(replayer, sample, "mismatch: loss of step 0"), 3, time.time())
            assert replays.pending(2)  # our confirmation runs

    trio.run(hear_mismatch)
    assert replays.banned == {}
    assert [a["by"] for a in replays.false_accusations] == [replayer.peer]
    assert not replays.pending(2)
    name = tag(PARAMS.run_id, "verdict", 2) + f"-{author.peer}"
    assert name in node.store.tags()

    state = initial_state({"w": np.zeros(3, np.float32)})
    replays.starts[2] = (ROOT, state)
    replays.verdicts.clear()
    trio.run(hear_mismatch)
    assert list(replays.banned) == ["op-a"]
    assert "failed replay of round 2 (mismatch: " in replays.banned["op-a"]
    assert len(replays.false_accusations) == 1


def test_verdicts_on_the_round_not_applied_yet_are_held_not_counted(tmp_path: Path) -> None:
    """The replayer applied round r and replayed first: its verdict is held until this
    worker applies r and draws the sample; a verdict on a later round is unfounded."""
    me, author, replayer = machine(), machine(), machine()
    replays, _, _ = replays_of(tmp_path, me)
    sample = Sample(3, ROOT, author.peer, "op-a", "b1" * 32, "c1" * 32, replayer.peer)
    replays.hear(heard(replayer, sample, MATCH), 3, time.time())
    later = dataclasses.replace(sample, round=4)
    replays.hear(heard(replayer, later, MATCH), 3, time.time())
    assert [e.verdict.round for e in replays.early_verdicts] == [3]
    assert replays.verdicts == []
