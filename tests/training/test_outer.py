"""DiLoCo outer math: Nesterov step, order-independent averaging, state roots, rounds."""

from __future__ import annotations

import numpy as np
import pytest

from training.outer.codec import CodecError, CodecParams, ErrorFeedback
from training.outer.loop import (
    OuterConfig,
    OuterError,
    OuterState,
    apply_round,
    average_updates,
    decode_update,
    initial_state,
    make_update,
    outer_step,
    pseudo_gradient,
    state_root,
    synthetic_tokens,
    tensor_set_digest,
)


def _state(**params: list[float]) -> OuterState:
    return initial_state({n: np.array(v, np.float32) for n, v in params.items()})


def test_nesterov_step_matches_hand_computation() -> None:
    state = _state(w=[1.0, -2.0])
    grad = {"w": np.array([0.5, 0.25], np.float32)}
    config = OuterConfig(lr=0.7, momentum=0.9)
    one = outer_step(state, grad, config)
    # m = 0.5; p = 1 - 0.7 * (0.5 + 0.9 * 0.5) = 0.335
    assert one.round == 1
    np.testing.assert_allclose(one.momentum["w"], [0.5, 0.25], rtol=1e-6)
    np.testing.assert_allclose(one.params["w"], [0.335, -2.0 - 0.7 * 0.475], rtol=1e-6)
    two = outer_step(one, grad, config)
    # m = 0.9 * 0.5 + 0.5 = 0.95; p = 0.335 - 0.7 * (0.5 + 0.9 * 0.95) = -0.6135
    np.testing.assert_allclose(two.momentum["w"], [0.95, 0.475], rtol=1e-6)
    np.testing.assert_allclose(two.params["w"], [-0.6135, -2.3325 - 0.7 * 0.6775], rtol=1e-6)
    plain = outer_step(one, grad, OuterConfig(lr=0.7, momentum=0.9, nesterov=False))
    np.testing.assert_allclose(
        plain.params["w"], [0.335 - 0.7 * 0.95, -2.3325 - 0.7 * 0.475], rtol=1e-6
    )


@pytest.mark.parametrize("spare", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("nesterov", [True, False])
def test_blocked_step_has_the_bits_of_the_formula(
    nesterov: bool, threads: int, spare: bool
) -> None:
    """The step runs block by block with in-place operations, on one thread or several;
    every element still gets the float32 result of the formula as written, blocks ending
    mid-tensor included, and the state it starts from is left as it was; and so with the
    new momentum written over a spare gradient's arrays (each block kept first)."""
    rng = np.random.default_rng(3)
    shapes = {"w": (123, 77), "b": (5,)}
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    momentum = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    grad = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    before = {n: (params[n].copy(), momentum[n].copy()) for n in shapes}
    config = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    given = {n: g.copy() for n, g in grad.items()}  # written over when spare
    got = outer_step(
        OuterState(4, params, momentum),
        given,
        config,
        threads=threads,
        grad_is_spare=spare,
        block=1000,  # blocks that end mid-tensor
    )
    for n in shapes:  # a spare gradient's arrays become the momentum
        assert (got.momentum[n] is given[n]) == spare
    lr, mu = np.float32(0.7), np.float32(0.9)
    for n in shapes:
        buf = mu * momentum[n] + grad[n]
        step = grad[n] + mu * buf if nesterov else buf
        assert got.momentum[n].tobytes() == buf.tobytes()
        assert got.params[n].tobytes() == (params[n] - lr * step).tobytes()
        assert params[n].tobytes() == before[n][0].tobytes()
        assert momentum[n].tobytes() == before[n][1].tobytes()


def test_nesterov_step_agrees_with_torch_sgd() -> None:
    import torch

    rng = np.random.default_rng(0)
    start = rng.standard_normal(50).astype(np.float32)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(4)]
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    state = initial_state({"p": start})
    for g in grads:
        param.grad = torch.from_numpy(g.copy())
        sgd.step()
        state = outer_step(state, {"p": g}, OuterConfig())
    np.testing.assert_allclose(state.params["p"], param.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_average_is_independent_of_arrival_order() -> None:
    """Float32 addition is not associative: the sum must follow peer-ID order, not arrival."""
    values = {"peer-c": 1e8, "peer-a": 1.0, "peer-b": -1e8, "peer-d": 3.0}
    shapes = {"w": (1,)}
    orders = [["peer-a", "peer-b", "peer-c", "peer-d"], ["peer-d", "peer-c", "peer-b", "peer-a"]]
    results = [
        average_updates({p: {"w": np.array([values[p]], np.float32)} for p in order}, shapes)
        for order in orders
    ]
    assert results[0]["w"].tobytes() == results[1]["w"].tobytes()
    # Ascending peer IDs: ((1 + -1e8) + 1e8) + 3 = 3 in float32 (the 1 is lost), / 4.
    assert float(results[0]["w"][0]) == 0.75


def test_average_rejects_mismatched_updates() -> None:
    with pytest.raises(OuterError, match="lacks"):
        average_updates({"p": {"w": np.zeros(2, np.float32)}}, {"w": (3,)})
    with pytest.raises(OuterError, match="does not have"):
        average_updates(
            {"p": {"w": np.zeros(3, np.float32), "x": np.zeros(1, np.float32)}}, {"w": (3,)}
        )
    with pytest.raises(OuterError, match="no updates"):
        average_updates({}, {"w": (3,)})


def test_state_root_changes_with_one_bit() -> None:
    state = _state(a=[1.0, 2.0], b=[3.0])
    root = state_root(state)
    assert len(root) == 64
    assert root == state_root(_state(b=[3.0], a=[1.0, 2.0]))
    flipped = state.params["a"].copy()
    flipped.view(np.uint32)[1] ^= 1
    assert state_root(OuterState(0, {**state.params, "a": flipped}, state.momentum)) != root
    bumped = state.momentum["b"].copy()
    bumped.view(np.uint32)[0] ^= 1 << 31
    assert state_root(OuterState(0, state.params, {**state.momentum, "b": bumped})) != root
    assert state_root(OuterState(1, state.params, state.momentum)) != root
    # Same bytes under another name or shape are another state.
    assert tensor_set_digest({"a": np.zeros((2, 3), np.float32)}) != tensor_set_digest(
        {"a": np.zeros((3, 2), np.float32)}
    )
    assert tensor_set_digest({"a": np.zeros(2, np.float32)}) != tensor_set_digest(
        {"b": np.zeros(2, np.float32)}
    )


def test_the_tensor_set_digest_is_pinned() -> None:
    """State roots name rounds in signed closures and milestones: the digest's bytes are
    a format. Pinned for tensors big-endian, not contiguous, empty, and large enough to
    be hashed on several threads (read in place, not copied)."""
    named = {
        "x": np.arange(10, dtype=np.float32),
        "y": np.ones((3, 4), np.float64).T,
        "z": np.arange(5, dtype=">i4"),
        "e": np.zeros((0, 3), np.float32),
        "big": np.arange(3 << 20, dtype=np.float32) * np.float32(0.5),
    }
    assert (
        tensor_set_digest(named).hex()
        == "832f83e048e8e43b3559ba3b73b016a68649a93a3a750fe3794cef631d011735"
    )


def test_round_with_dense_and_sparse_updates() -> None:
    rng = np.random.default_rng(1)
    start = {"w": rng.standard_normal((8, 64)).astype(np.float32)}
    state = initial_state(start)
    ends = {f"peer-{i}": {"w": start["w"] - np.float32(0.01) * i} for i in range(1, 4)}
    dense = {p: decode_update(make_update(state.params, e), state) for p, e in ends.items()}
    np.testing.assert_allclose(dense["peer-2"]["w"], 0.02, rtol=1e-4)
    new = apply_round(state, dense, OuterConfig(lr=1.0, momentum=0.0))
    # Plain averaging with lr 1 lands on the mean end point.
    np.testing.assert_allclose(new.params["w"], start["w"] - 0.02, atol=1e-6)
    assert new.round == 1
    params = CodecParams(chunk=64, k=4)
    sparse = {
        p: decode_update(make_update(state.params, e, ErrorFeedback(params)), state)
        for p, e in ends.items()
    }
    assert all(np.count_nonzero(u["w"]) == 8 * 4 for u in sparse.values())
    assert state_root(apply_round(state, sparse)) == state_root(
        apply_round(state, dict(reversed(sparse.items())))
    )


def test_round_without_updates_keeps_the_state() -> None:
    state = _state(w=[1.0])
    after = apply_round(state, {})
    assert after.round == 1
    assert after.params["w"].tobytes() == state.params["w"].tobytes()


def test_pseudo_gradient_and_update_checks() -> None:
    state = _state(w=[1.0, 1.0])
    grad = pseudo_gradient(state.params, {"w": np.array([0.5, 2.0], np.float32)})
    assert grad["w"].tolist() == [0.5, -1.0]
    with pytest.raises(OuterError, match="different"):
        pseudo_gradient(state.params, {"v": np.zeros(2, np.float32)})
    with pytest.raises(OuterError, match="shape"):
        pseudo_gradient(state.params, {"w": np.zeros(3, np.float32)})
    other = initial_state({"w": np.ones((2, 1), np.float32)})
    with pytest.raises(CodecError, match="do not match"):
        decode_update(make_update(other.params, other.params), state)
    bigger = _state(w=[1.0, 1.0, 1.0])
    with pytest.raises(CodecError, match="more than 2 values"):
        decode_update(make_update(bigger.params, bigger.params), state)


def test_synthetic_corpus_is_deterministic_and_structured() -> None:
    from training.records import BOS_ID, VOCAB_SIZE, decode_tokens

    a = synthetic_tokens(3, 4, 64)
    assert a.shape == (4, 64)
    assert np.array_equal(a, synthetic_tokens(3, 4, 64))
    assert not np.array_equal(a, synthetic_tokens(4, 4, 64))
    assert int(a.max()) < VOCAB_SIZE
    assert a[0, 0] == BOS_ID
    text = decode_tokens(a.reshape(-1).tolist())
    assert text.count(b".") >= 3
