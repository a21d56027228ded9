"""Sampled replay of outer-loop updates: an honest update replays bit for
bit from its commitment, one trained on other rows than it claims does not, and the
sample and the replayer are fixed by the next root alone."""

from __future__ import annotations

import dataclasses

import blake3
import pytest

from identity import Authority, MachineKey, SoftwareSigner, TrustStore
from training.outer.loop import initial_state, model_params, state_root
from training.outer.params import RunParams
from training.outer.replay import (
    MATCH,
    BadCommitment,
    BadVerdict,
    UpdateCommitment,
    Verdict,
    check_verdict,
    decode_commitment,
    inner_digest,
    loss_bits,
    replay,
    replayer_for,
    sampled,
    sign_verdict,
)
from training.outer.trainer import Trainer

PARAMS = RunParams(run_id="replay", workers=3, rounds=2, inner_steps=2)
AUTHOR = "12D3KooWAuthor"


def _root(i: int) -> str:
    return blake3.blake3(f"root {i}".encode()).hexdigest()


def _commit(trainer: Trainer, state_round: int, root: str, trained: object) -> UpdateCommitment:
    from training.outer.trainer import Trained

    assert isinstance(trained, Trained)
    return UpdateCommitment(
        PARAMS.run_id,
        state_round,
        root,
        AUTHOR,
        1,
        PARAMS.inner_steps,
        PARAMS.batch,
        trained.rows.astype("<u4").tobytes(),
        loss_bits(trained.losses),
        PARAMS.chunk,
        PARAMS.k,
        "11" * 32,  # the inner-state blob's ID (the bytes are passed directly here)
        inner_digest(trained.inner_after),
        blake3.blake3(trained.update).hexdigest(),
    )


def test_a_commitment_round_trips_and_only_canonical_bytes_decode() -> None:
    c = UpdateCommitment(
        "run", 3, _root(0), AUTHOR, 2, 2, 4, bytes(32), bytes(8), 4096, 48, "aa" * 32,
        "bb" * 32, "cc" * 32,
    )  # fmt: skip
    data = c.encode()
    assert decode_commitment(data) == c
    with pytest.raises(BadCommitment):
        decode_commitment(data + b"\x00")
    with pytest.raises(ValueError, match="round-trip"):
        dataclasses.replace(c, rows=bytes(31)).encode()  # rows must be steps x batch


def test_the_sample_and_the_replayer_follow_the_next_root() -> None:
    peers = [f"peer-{i}" for i in range(400)]
    assert not any(sampled(_root(1), p, 0.0) for p in peers)
    assert all(sampled(_root(1), p, 1.0) for p in peers)
    quarter = [p for p in peers if sampled(_root(1), p, 0.25)]
    assert 60 < len(quarter) < 140  # about a quarter
    assert quarter != [p for p in peers if sampled(_root(2), p, 0.25)]  # a new draw per root
    operators = {"a": "op-a", "b": "op-b", "b2": "op-b", "c": "op-c"}
    chosen = {replayer_for(_root(i), "b", operators) for i in range(50)}
    assert chosen == {"a", "c"}  # never the author nor its operator's other key
    assert replayer_for(_root(0), "b", {"b": "op-b", "b2": "op-b"}) is None


def test_a_verdict_is_signed_by_an_admitted_worker_over_what_it_says() -> None:
    authority = Authority(SoftwareSigner(MachineKey.generate()))
    key = MachineKey.generate()
    cert = authority.admit(
        key.peer_id, operator="op", kernel_class="cpu-x", not_before=0, not_after=2**40, serial=1
    )
    trust = TrustStore(frozenset({authority.public_key_bytes}))
    verdict = Verdict("run", 0, AUTHOR, "aa" * 32, "bb" * 32, MATCH)
    signed = sign_verdict(
        SoftwareSigner(key), verdict, kernel_class="cpu-x", certificate=cert, time=100
    )
    assert check_verdict(verdict, signed, trust=trust, now=100).signer_peer_id == key.peer_id
    with pytest.raises(BadVerdict):
        check_verdict(
            dataclasses.replace(verdict, outcome="mismatch: x"), signed, trust=trust, now=100
        )


def test_an_honest_update_replays_bit_for_bit_and_a_cheat_does_not() -> None:
    """Two rounds on one trainer (the second starts with AdamW moments and a residual);
    each replays to the same losses, end state and update bytes on a fresh trainer. An
    update trained on other rows than its commitment names is a mismatch, as is an
    update blob that is not what the replay gives."""
    from training.model import make_tiny_llama

    state = initial_state(model_params(make_tiny_llama(PARAMS.model_size, seed=PARAMS.seed)))
    root = state_root(state)
    trainer = Trainer(PARAMS, 1)
    for r in range(2):
        trained = trainer.train(state, root, AUTHOR)
        c = _commit(trainer, r, root, trained)
        assert replay(PARAMS, c, trained.inner_before, state, trained.update) == MATCH
        tampered = trained.update[:-1] + bytes([trained.update[-1] ^ 1])
        outcome = replay(PARAMS, c, trained.inner_before, state, tampered)
        assert outcome == "mismatch: update bytes differ"
        # The next round starts from another state (any will do for the replay).
        state = dataclasses.replace(state, round=state.round + 1)
        root = state_root(state)
    cheated = trainer.train(state, root, AUTHOR, cheat=True)
    c = _commit(trainer, 2, root, cheated)
    outcome = replay(PARAMS, c, cheated.inner_before, state, cheated.update)
    assert outcome == "mismatch: loss of step 0 differs"
