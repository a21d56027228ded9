"""A model's whole state as a run holds it (training.outer.module_state): roles, the state
file, the checks before step 0, and the state's buffers through the update, the aggregate
and the state blob."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.training.stranger import StrangerNet
from training.outer.aggregate import BadUpdate, aggregate, unwrap_update, wrap_update
from training.outer.codec import encode_dense
from training.outer.loop import OuterConfig, OuterState, initial_state, median_buffers, state_root
from training.outer.module_state import (
    ModelMismatch,
    StateError,
    check_layout,
    decode_fixed,
    encode_fixed,
    layout_of,
    load_into,
    read_state_file,
    save_state,
    whole_state,
)
from training.outer.state_blob import BadStateBlob, decode_state, encode_state


def test_every_state_dict_entry_has_one_role() -> None:
    layout = layout_of(StrangerNet())
    assert "bn1.weight" in layout.trainable and "up.weight" in layout.trainable
    assert set(layout.buffers) == {f"bn{i}.running_{s}" for i in (1, 2) for s in ("mean", "var")}
    assert layout.fixed == {
        "bn1.num_batches_tracked": ("I64", ()),
        "bn2.num_batches_tracked": ("I64", ()),
        "proj.weight": ("F32", (16, 32)),
    }
    assert layout.aliases == {"down.weight": "up.weight"}
    assert layout.names() == sorted(StrangerNet().state_dict())


def test_a_state_file_keeps_roles_and_tied_names_and_a_plain_one_takes_patterns(
    tmp_path: Path,
) -> None:
    model = StrangerNet()
    path = tmp_path / "state.safetensors"
    save_state(model, path)
    back = read_state_file(path)
    assert back.layout() == layout_of(model)
    assert np.array_equal(back.trainable["up.weight"], model.up.weight.detach().numpy())
    assert torch.equal(back.fixed["proj.weight"], model.proj.weight)
    # save_file(state_dict()) fails on the tied pair; a state dict without them, saved
    # elsewhere, is read by its dtypes unless patterns say more.
    plain = {k: v for k, v in model.state_dict().items() if k != "down.weight"}
    save_file({k: v.contiguous() for k, v in plain.items()}, str(tmp_path / "plain.safetensors"))
    guessed = read_state_file(tmp_path / "plain.safetensors")
    assert "bn1.running_mean" in guessed.trainable and "proj.weight" in guessed.trainable
    assert set(guessed.fixed) == {"bn1.num_batches_tracked", "bn2.num_batches_tracked"}
    told = read_state_file(
        tmp_path / "plain.safetensors", buffers=["*.running_*"], frozen=["proj.*"]
    )
    assert set(told.buffers) == set(layout_of(model).buffers)
    assert "proj.weight" in told.fixed
    with pytest.raises(StateError, match="matches no tensor"):
        read_state_file(tmp_path / "plain.safetensors", buffers=["bn9.*"])
    with pytest.raises(StateError, match="names its tensors' roles itself"):
        read_state_file(path, frozen=["proj.*"])


def test_a_model_of_another_layout_is_refused_in_one_line_saying_what_differs() -> None:
    want = layout_of(StrangerNet())
    check_layout(want, layout_of(StrangerNet()), run="r")
    narrower = StrangerNet(width=4)
    with pytest.raises(ModelMismatch, match=r"parameter 'block.bias' has shape \(16,\)") as exc:
        check_layout(want, layout_of(narrower), run="r")
    assert "\n" not in str(exc.value)
    unfrozen = StrangerNet()
    unfrozen.proj.weight.requires_grad_(True)
    with pytest.raises(ModelMismatch, match=r"'proj\.weight' is a parameter in the model and a"):
        check_layout(want, layout_of(unfrozen), run="r")
    untied = StrangerNet()
    untied.down.weight = torch.nn.Parameter(untied.up.weight.detach().clone())
    with pytest.raises(ModelMismatch, match=r"'down\.weight'"):
        check_layout(want, layout_of(untied), run="r")


def test_fixed_tensors_load_into_a_model_made_with_another_seed() -> None:
    torch.manual_seed(1)
    maker = StrangerNet()
    torch.manual_seed(2)
    joiner = StrangerNet()
    assert not torch.equal(maker.proj.weight, joiner.proj.weight)
    fixed = whole_state(maker).fixed
    blob = encode_fixed(fixed)
    back = decode_fixed(blob, layout_of(maker).fixed)
    load_into(joiner, {}, back)
    assert torch.equal(maker.proj.weight, joiner.proj.weight)
    with pytest.raises(StateError, match="do not match its spec"):
        decode_fixed(blob, {**layout_of(maker).fixed, "extra": ("F32", (1,))})


SIZE = 4096


def _state(buffers: dict[str, np.ndarray]) -> OuterState:
    params = {"w": np.linspace(-1, 1, SIZE, dtype=np.float32)}
    return initial_state(params, buffers)


def _update(state: OuterState, peer: str, scale: float, buffers: dict[str, np.ndarray]) -> bytes:
    """An honest-looking update: a shared direction plus the peer's own noise."""
    common = np.random.default_rng(0).normal(size=SIZE)
    own = np.random.default_rng(int(scale * 1000)).normal(size=SIZE)
    grad = {"w": (0.001 * scale * (common + own)).astype(np.float32)}
    return wrap_update(
        encode_dense(grad),
        round_=state.round,
        start_root=state_root(state),
        author=peer,
        buffers=buffers,
    )


def test_the_next_state_holds_the_median_of_the_admitted_updates_buffers() -> None:
    """One liar among three moves no buffer value outside what the honest two sent."""
    state = _state({"bn.mean": np.zeros(4, np.float32), "bn.var": np.ones(4, np.float32)})
    honest = [
        np.array([0.1, 0.2, 0.3, 0.4], np.float32),
        np.array([0.2, 0.1, 0.5, 0.3], np.float32),
    ]
    lie = np.full(4, 1e6, np.float32)
    sent = {
        "peer-a": {"bn.mean": honest[0], "bn.var": np.ones(4, np.float32)},
        "peer-b": {"bn.mean": honest[1], "bn.var": np.full(4, 2.0, np.float32)},
        "peer-c": {"bn.mean": lie, "bn.var": lie},
    }
    blobs = {p: _update(state, p, 1.0 + i / 10, b) for i, (p, b) in enumerate(sent.items())}
    agg = aggregate(state, [(p, p) for p in blobs], blobs.__getitem__, OuterConfig())
    assert len(agg.admitted) == 3
    mean = agg.state.buffers["bn.mean"]
    assert np.all(mean >= np.minimum(*honest)) and np.all(mean <= np.maximum(*honest))
    assert np.array_equal(agg.state.buffers["bn.var"], np.full(4, 2.0, np.float32))
    # Two updates: half of each (no overflow at the float32 limit either).
    big = np.full(4, 3e38, np.float32)
    assert np.array_equal(median_buffers([{"b": big}, {"b": big}], {"b": (4,)})["b"], big)


def test_an_update_without_the_states_buffers_or_with_bad_ones_is_excluded() -> None:
    state = _state({"bn.mean": np.zeros(4, np.float32)})
    good = {"bn.mean": np.zeros(4, np.float32)}
    blobs = {
        "peer-a": _update(state, "peer-a", 1.0, good),
        "peer-b": _update(state, "peer-b", 1.1, good),
        "peer-c": _update(state, "peer-c", 1.2, {}),  # no buffers: a version-1 envelope
        "peer-d": _update(state, "peer-d", 1.3, {"bn.mean": np.zeros(5, np.float32)}),
    }
    agg = aggregate(state, [(p, p) for p in blobs], blobs.__getitem__, OuterConfig())
    assert [p for p, _, _ in agg.admitted] == ["peer-a", "peer-b"]
    assert {e.peer: e.reason for e in agg.excluded} == {"peer-c": "buffers", "peer-d": "buffers"}
    blob = blobs["peer-a"]
    for cut in (len(blob) - 1, len(blob) - 17):
        with pytest.raises(BadUpdate, match="buffers"):
            unwrap_update(blob[:cut]).decoded_buffers({"bn.mean": (4,)})
    with pytest.raises(ValueError, match="NaN"):
        _update(state, "peer-e", 1.0, {"bn.mean": np.full(4, np.nan, np.float32)})


def test_a_state_with_buffers_is_a_version_2_blob_and_its_root_covers_them() -> None:
    plain = _state({})
    assert encode_state(plain)[4] == 1  # a state without buffers keeps its version-1 bytes
    state = _state({"bn.var": np.ones(3, np.float32)})
    data = encode_state(state)
    assert data[4] == 2
    back = decode_state(data, expected={"w": (SIZE,)}, buffers={"bn.var": (3,)})
    assert np.array_equal(back.buffers["bn.var"], state.buffers["bn.var"])
    assert state_root(back) == state_root(state) != state_root(plain)
    moved = _state({"bn.var": np.full(3, 2.0, np.float32)})
    assert state_root(moved) != state_root(state)
    with pytest.raises(BadStateBlob, match="buffers do not match"):
        decode_state(data, buffers={"bn.var": (4,)})
    for cut in range(len(data) - 20, len(data)):
        with pytest.raises(BadStateBlob):
            decode_state(data[:cut])
    with pytest.raises(BadStateBlob):
        decode_state(data + b"\x00")


def test_a_state_streamed_as_safetensors_reads_back_through_the_library(tmp_path: Path) -> None:
    """write_safetensors writes each tensor from its own memory; safetensors reads it."""
    import os

    from safetensors import safe_open

    from training.outer.module_state import write_safetensors

    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),  # 0-d
        "d": torch.zeros(0, 4),  # empty
    }
    path = tmp_path / "x.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_safetensors(fd, tensors, {"k": "v"})
    finally:
        os.close(fd)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        got = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    assert np.array_equal(got["a"].numpy(), tensors["a"])
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], tensors["b"])
    assert got["c"].shape == () and int(got["c"]) == 7
    assert got["d"].shape == (0, 4)
