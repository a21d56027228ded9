"""The dispatcher regime (training.rounds.audit, point 5): CPU rounds run audited ops without
Python and still refuse, on any step and at any depth, what the audited set lacks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from training import determinism  # noqa: E402
from training.errors import AuditViolation  # noqa: E402
from training.model import make_tiny_llama  # noqa: E402
from training.records import Records, make_records  # noqa: E402
from training.rounds import audit, trainer  # noqa: E402
from training.rounds.recipe import Recipe  # noqa: E402

RECIPE = Recipe(steps=4, batch_size=2, seq_len=16)


@pytest.fixture(scope="module")
def allowed() -> frozenset[str]:
    determinism.enter("cpu", threads=1)
    return audit.load_kernel_set("cpu")


@pytest.fixture(scope="module")
def records() -> Records:
    return trainer.decode(make_records([bytes(range(256)) * 2], seq_len=RECIPE.seq_len))


@pytest.fixture(autouse=True)
def no_accelerator() -> Iterator[None]:
    if audit.accelerator_present():
        pytest.skip("the dispatcher regime is for machines without an accelerator")
    yield
    # Every test leaves the dispatcher's tables as it found them.
    assert not audit._installed


def session() -> trainer.Session:
    return trainer.prepare(make_tiny_llama("tiny", seed=0), RECIPE, 0, "cpu")


def test_cpu_rounds_get_the_dispatcher_regime_and_others_the_python_one(
    allowed: frozenset[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert audit.make_round_auditor("cpu", allowed).regime == "dispatcher"
    assert audit.make_round_auditor("cuda", allowed).regime == "python"
    monkeypatch.setattr(audit, "accelerator_present", lambda: True)
    assert audit.make_round_auditor("cpu", allowed).regime == "python"


def test_both_regimes_train_the_same_bits_and_few_ops_reach_python(
    allowed: frozenset[str], records: Records
) -> None:
    """The regimes differ in where the allow-list is looked up, not in what runs."""
    plain = trainer.run_steps(session(), records)
    python = audit.make_auditor("cpu", allowed)
    assert trainer.run_steps(session(), records, auditor=python) == plain
    dispatcher = audit.make_round_auditor("cpu", allowed)
    assert trainer.run_steps(session(), records, auditor=dispatcher) == plain
    # Where the time goes (bench/round.py has the timings): every op crosses into Python
    # in one regime, a few (autograd's detach of saved tensors) in the other.
    assert python.calls > 300 * RECIPE.steps
    assert dispatcher.calls < python.calls / 10


def test_a_non_audited_op_first_run_at_a_later_step_is_refused(
    allowed: frozenset[str], records: Records
) -> None:
    """Regression guard for any audit that checks only the first step(s) and trusts later
    ones to take the same path: here steps 0 and 1 are clean and step 2's forward runs
    an op outside the set (as data-dependent model code could)."""
    s = session()
    forwards = 0

    def late_op(module: Any, args: Any, output: Any) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == 3:
            output.logits.cumprod(-1)

    s.model.register_forward_hook(late_op)
    done: list[int] = []
    auditor = audit.make_round_auditor("cpu", allowed)
    with pytest.raises(AuditViolation, match=r"op aten::cumprod\.default is not in the audited"):
        trainer.run_steps(s, records, auditor=auditor, on_step=lambda step, _: done.append(step))
    assert done == [0, 1]


@pytest.mark.parametrize(
    "op",
    ["aten::silu.default", "aten::silu_backward.default", "aten::addcdiv_.default"],
    ids=["forward", "backward", "optimizer"],
)
def test_every_part_of_a_step_is_checked(
    allowed: frozenset[str], records: Records, op: str
) -> None:
    """Forward, the autograd engine's backward and AdamW's update: an op of each, taken
    out of the set, refuses the round at step 0."""
    auditor = audit.make_round_auditor("cpu", allowed - {op})
    with pytest.raises(AuditViolation, match=rf"op {op} is not in the audited"):
        trainer.run_steps(session(), records, auditor=auditor)


def test_an_op_nested_in_an_audited_kernel_is_checked_too(allowed: frozenset[str]) -> None:
    """``mm``'s kernel calls ``resolve_conj``: the python regime sees only ``mm``; the
    dispatcher regime runs ``mm`` without Python and sees what it calls."""
    without = allowed - {"aten::resolve_conj.default"}
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    python = audit.make_auditor("cpu", without)
    with python:
        torch.mm(a, b)
    auditor = audit.make_round_auditor("cpu", without)
    with (
        auditor.installed(),
        pytest.raises(AuditViolation, match=r"aten::resolve_conj\.default is not in"),
        auditor,
    ):
        torch.mm(a, b)


@pytest.mark.parametrize(
    ("make", "op"),
    [
        (lambda x, m: x.to("meta"), "_to_copy"),
        (lambda x, m: torch.zeros(2, device="meta"), "zeros"),
        (lambda x, m: torch.ones_like(x, device="meta"), "empty_strided"),
        (lambda x, m: torch.tensor([1.0], device="meta"), "empty"),
        (lambda x, m: m * 2, "mul"),
    ],
    ids=["copy", "factory", "factory-like", "tensor-literal", "made-before"],
)
def test_nothing_is_made_or_computed_on_meta(allowed: frozenset[str], make: Any, op: str) -> None:
    """Without an accelerator meta is the only other device: its kernels are refusals.
    (The python regime does not see the literal's allocation at all.)"""
    x, m = torch.randn(3), torch.ones(3, device="meta")
    auditor = audit.make_round_auditor("cpu", allowed)
    with (
        auditor.installed(),
        pytest.raises(AuditViolation, match=rf"op aten::{op}\S* has a tensor or device on meta"),
        auditor,
    ):
        make(x, m)


def test_the_tables_are_restored_after_a_refused_round(
    allowed: frozenset[str], records: Records
) -> None:
    s = session()
    s.model.register_forward_hook(lambda _m, _a, output: output.logits.cumprod(-1))
    with pytest.raises(AuditViolation):
        trainer.run_steps(s, records, auditor=audit.make_round_auditor("cpu", allowed))
    # mm reaches Python again, and meta computes again.
    a = torch.ones(2, 2)
    python = audit.make_auditor("cpu", allowed)
    with python:
        torch.mm(a, a)
    assert python.calls == 1
    assert (torch.ones(2, device="meta") * 2).device.type == "meta"


def test_one_fallthrough_set_at_a_time(allowed: frozenset[str]) -> None:
    auditor = audit.make_round_auditor("cpu", allowed)
    other = audit.make_round_auditor("cpu", allowed - {"aten::mm.default"})
    with (
        auditor.installed(),
        auditor.installed(),  # the same set nests
        pytest.raises(RuntimeError, match="another fallthrough set"),
        other.installed(),
    ):
        pass
    assert not audit._installed


@pytest.mark.parametrize("regime", ["python", "dispatcher"])
@pytest.mark.parametrize("how", ["attribute", "buffer"])
def test_a_model_holding_a_meta_tensor_is_refused_before_step_0(
    allowed: frozenset[str], records: Records, regime: str, how: str
) -> None:
    """A CPU kernel reads a meta tensor next to CPU ones and returns CPU garbage (``mm``
    does), which no result check sees: a model holding one is refused up front."""
    s = session()
    mlp = s.model.get_submodule("base_model.model.model.layers.0.mlp")
    if how == "attribute":
        mlp.scale = torch.ones(1, device="meta")
    else:
        mlp.register_buffer("scale", torch.ones(1, device="meta"))
    auditor = (
        audit.make_auditor("cpu", allowed)
        if regime == "python"
        else audit.make_round_auditor("cpu", allowed)
    )
    done: list[int] = []
    with pytest.raises(AuditViolation, match=r"model tensor .*layers\.0\.mlp\.scale is on meta"):
        trainer.run_steps(s, records, auditor=auditor, on_step=lambda step, _: done.append(step))
    assert done == []
