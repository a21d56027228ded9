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


# --- overlapped rounds (training.outer.trainer rules 4 to 7) ----------------------------

OVERLAPPED = RunParams(run_id="replay", workers=3, rounds=3, inner_steps=3, batch=2, overlap=1)


def test_a_plain_commitment_keeps_its_bytes_and_an_overlapped_one_names_its_origin() -> None:
    """Version 1 (no origin) is byte for byte what it was before overlapped rounds (its
    digest, as the code before them encoded it); version 2 adds ``from`` and ``moved`` and
    round-trips; neither decodes with the other's keys, nor a boundary past the last step."""
    import msgpack

    c = UpdateCommitment(
        "run", 3, _root(0), AUTHOR, 2, 2, 4, bytes(32), bytes(8), 4096, 48, "aa" * 32,
        "bb" * 32, "cc" * 32,
    )  # fmt: skip
    data = c.encode()
    assert blake3.blake3(data).hexdigest() == (
        "9f7a9fb48485a4bacd26d29d2957117e7e08f6a0f9cdd2c8051a6b1b139a63fb"
    )
    overlapped = dataclasses.replace(c, origin="dd" * 32, moved=2)
    moved = overlapped.encode()
    assert decode_commitment(moved) == overlapped and overlapped.overlapped
    fields = msgpack.unpackb(moved)
    assert (fields["v"], fields["from"], fields["moved"]) == (2, "dd" * 32, 2)
    for bad, why in (
        ({**fields, "moved": 3}, "moved must be a step boundary"),
        ({k: v for k, v in fields.items() if k != "from"}, "lacks the field 'from'"),
        ({**fields, "v": 1}, "not in canonical form"),
        ({**msgpack.unpackb(data), "v": 2}, "lacks the field"),
        ({**fields, "v": 3}, "unknown version"),
    ):
        with pytest.raises(BadCommitment, match=why):
            decode_commitment(msgpack.packb(dict(sorted(bad.items()))))


class _Gate:
    """The causal-LM loss with dropout on the logits (so the steps draw from torch's
    generator, and a replay must seed it as its author did), holding each call in
    ``holds`` until the test lets it go on (so a state can be offered, or a round dropped,
    while a round trained ahead is at a known step)."""

    def __init__(self, *holds: int) -> None:
        import threading

        self.calls = 0
        self.reached = {h: threading.Event() for h in holds}
        self.go = {h: threading.Event() for h in holds}

    def __call__(self, model: object, batch: object) -> object:
        if self.calls in self.reached:
            self.reached[self.calls].set()
            assert self.go[self.calls].wait(60)
        self.calls += 1
        import torch

        logits = model(input_ids=batch).logits[:, :-1]  # type: ignore[operator]
        dropped = torch.nn.functional.dropout(logits, 0.1, training=True)
        return torch.nn.functional.cross_entropy(
            dropped.reshape(-1, dropped.shape[-1]),
            batch[:, 1:].reshape(-1),  # type: ignore[index]
        )


def _overlapped(trained: object, state_round: int, root: str, moved: int) -> UpdateCommitment:
    c = _commit(Trainer(OVERLAPPED, 1), state_round, root, trained)
    return dataclasses.replace(
        c, steps=OVERLAPPED.inner_steps, batch=OVERLAPPED.batch, origin="22" * 32, moved=moved
    )


def test_an_overlapped_update_replays_bit_for_bit_from_the_state_its_steps_began() -> None:
    """Round 0 is plain; round 1 is trained ahead from E_0 and moves to S_1 at the boundary
    after the step it was offered in; a replay from E_0, the inner state and that boundary
    gives the same losses, end state and update bytes. Another boundary, another E_0 or no
    origin at all (a plain replay from S_1) does not. A state the trainer was not offered
    (one caught up to) is trained plain, and replays so."""
    import numpy as np

    from training.model import make_tiny_llama
    from training.outer.inner import decode_origin, encode_origin

    def make(params: RunParams, shard: int) -> Trainer:
        return Trainer(params, shard, step_fn=_Gate())

    h = OVERLAPPED.inner_steps
    model = make_tiny_llama(OVERLAPPED.model_size, seed=OVERLAPPED.seed)
    s0 = initial_state(model_params(model))
    gate = _Gate(h + 1, 2 * h + 1)  # round 1's step 1, round 2's step 1
    trainer = Trainer(OVERLAPPED, 1, step_fn=gate)
    plain = trainer.train(s0, state_root(s0), AUTHOR)
    assert (plain.origin, plain.moved_at) == (b"", None)
    s1 = dataclasses.replace(s0, round=1, params={n: v + 1e-3 for n, v in s0.params.items()})
    r1 = state_root(s1)
    assert gate.reached[h + 1].wait(60)
    trainer.ready(s1, r1)
    gate.go[h + 1].set()
    ahead = trainer.train(s1, r1, AUTHOR)
    # Round 2 is trained ahead now; its thread holds the torch generator's lock until its
    # steps end, so the replays below run after them (and after its step 0, for the drop).
    assert gate.reached[2 * h + 1].wait(60)
    gate.go[2 * h + 1].set()
    assert ahead.moved_at == 2 and ahead.origin
    assert ahead.inner_before == plain.inner_after
    c = _overlapped(ahead, 1, r1, moved=2)
    assert replay(OVERLAPPED, c, ahead.inner_before, s1, ahead.update, make, ahead.origin) == MATCH
    other = dataclasses.replace(c, moved=1)
    outcome = replay(OVERLAPPED, other, ahead.inner_before, s1, ahead.update, make, ahead.origin)
    assert outcome == "mismatch: loss of step 1 differs"
    e0, buffers = decode_origin(ahead.origin, trainer.shapes(), {})
    name = "model.layers.0.mlp.up_proj.weight"
    e0[name] = e0[name] + np.float32(1e-2)
    forged = encode_origin(e0, buffers)
    outcome = replay(OVERLAPPED, c, ahead.inner_before, s1, ahead.update, make, forged)
    assert outcome == "mismatch: loss of step 0 differs"
    outcome = replay(OVERLAPPED, c, ahead.inner_before, s1, ahead.update, make, b"\x80")
    assert outcome.startswith("mismatch: ") and "origin state" in outcome
    unmoved = dataclasses.replace(c, origin="", moved=0)
    outcome = replay(OVERLAPPED, unmoved, ahead.inner_before, s1, ahead.update, make)
    assert outcome.startswith("mismatch: ")
    # The run's spec does not overlap: an overlapped commitment is refused untrained.
    blocking = dataclasses.replace(OVERLAPPED, overlap=0)
    outcome = replay(blocking, c, ahead.inner_before, s1, ahead.update, make, ahead.origin)
    assert outcome == "mismatch: commitment is overlapped in a run that does not overlap rounds"
    # Round 2 from a state never offered (a catch-up), once round 2's step 0 ran ahead:
    # the round ahead is dropped, and the plain round starts from the inner state it began
    # with (the moments of its step 0 discarded).
    s2 = dataclasses.replace(s1, round=2)
    caught = trainer.train(s2, state_root(s2), AUTHOR)
    assert (caught.origin, caught.moved_at) == (b"", None)
    assert caught.inner_before == ahead.inner_after
    c2 = dataclasses.replace(_overlapped(caught, 2, state_root(s2), 0), origin="", moved=0)
    assert replay(OVERLAPPED, c2, caught.inner_before, s2, caught.update, make) == MATCH
    assert trainer.ahead is None  # the last round: nothing is trained ahead of it
