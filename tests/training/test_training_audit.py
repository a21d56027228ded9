"""The op auditor refuses off-device tensors and ops outside the audited kernel set."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from training import determinism  # noqa: E402
from training.errors import AuditViolation, DeviceUnavailable, NoKernelSet  # noqa: E402
from training.rounds import audit  # noqa: E402


@pytest.fixture(scope="module")
def allowed() -> frozenset[str]:
    determinism.enter("cpu", threads=1)
    return audit.load_kernel_set("cpu")


def test_kernel_set_holds_step0_and_steady_state_ops(allowed: frozenset[str]) -> None:
    # step 0 only: AdamW state init; every step: matmul, loss, optimizer update
    for op in ("aten::zeros_like.default", "aten::mm.default", "aten::addcdiv_.default"):
        assert op in allowed
    assert not any(op.startswith("aten::_foreach") or "fused" in op for op in allowed)
    # nested in an audited kernel (mm's), seen by the dispatcher regime (audit point 5a)
    assert "aten::resolve_conj.default" in allowed


def test_allowed_ops_on_device_pass_and_are_counted(allowed: frozenset[str]) -> None:
    auditor = audit.make_auditor("cpu", allowed)
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with auditor:
        out = torch.mm(a, b)
    assert torch.equal(out, a @ b)
    assert auditor.calls == 1


def test_refuses_tensor_on_another_device(allowed: frozenset[str]) -> None:
    off = torch.ones(4, device="meta")
    with (
        pytest.raises(AuditViolation, match=r"aten::mul\.Tensor .* on meta"),
        audit.make_auditor("cpu", allowed),
    ):
        off * 2
    with pytest.raises(AuditViolation, match="on meta"), audit.make_auditor("cpu", allowed):
        torch.zeros(2, device="meta")  # a factory op: caught by its device argument


def test_cuda_round_refuses_cpu_tensors(allowed: frozenset[str]) -> None:
    a = torch.randn(2, 2)
    with (
        pytest.raises(AuditViolation, match=r"aten::mm\.default .* on cpu"),
        audit.make_auditor("cuda", allowed),
    ):
        torch.mm(a, a)


def test_refuses_op_outside_the_set(allowed: frozenset[str]) -> None:
    x = torch.randn(5)
    refused = r"op aten::cumprod\.default is not in the audited"
    with pytest.raises(AuditViolation, match=refused), audit.make_auditor("cpu", allowed):
        torch.cumprod(x, 0)
    without_mm = allowed - {"aten::mm.default"}
    a = torch.randn(2, 2)
    with (
        pytest.raises(AuditViolation, match=r"aten::mm\.default"),
        audit.make_auditor("cpu", without_mm),
    ):
        torch.mm(a, a)


def test_missing_kernel_set_names_the_build_command() -> None:
    with pytest.raises(NoKernelSet, match=r"python -m training\.audit --build tpu"):
        audit.load_kernel_set("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_no_cuda_and_no_explicit_cpu_refuses() -> None:
    with pytest.raises(DeviceUnavailable, match="--device cpu"):
        determinism.resolve_device(None)
    with pytest.raises(DeviceUnavailable, match="--device cpu"):
        determinism.resolve_device("cuda")
    assert determinism.resolve_device("cpu") == "cpu"
