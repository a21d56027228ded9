"""A worker's resume checkpoint (training.outer.api.resume): what it keeps, that a restart
takes back exactly that, and what it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from blobstore import Store
from tests.training.stranger import StrangerNet, images, loss_fn
from training.outer.api.resume import (
    ResumeRefused,
    check_optimizer,
    checkpoint_path,
    load_optimizer,
    read_checkpoint,
    write_checkpoint,
)

PEER = "12D3KooWTestPeer"


def _trained() -> tuple[StrangerNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = StrangerNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    x, y = images(1, 64)
    for _ in range(3):
        loss_fn(model, (x, y)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _residual(model: torch.nn.Module, scale: float) -> dict[str, np.ndarray]:
    return {
        n: np.full(tuple(p.shape), scale, np.float32)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def test_a_restart_takes_back_the_residual_and_the_optimizer_it_left(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    model, opt = _trained()
    shapes = {n: tuple(v.shape) for n, v in _residual(model, 0).items()}
    write_checkpoint(
        store, run="r", peer=PEER, round_=1, residual=_residual(model, 0.5), optimizer=opt
    )
    path = write_checkpoint(
        store, run="r", peer=PEER, round_=2, residual=_residual(model, 0.25), optimizer=opt
    )
    # One checkpoint, the newest, in the worker's files inside its store; no temp left.
    assert path == checkpoint_path(store, "r") and path.parent.parent == store.root
    assert list(path.parent.iterdir()) == [path] and not list(store.tmp_dir.iterdir())
    saved = read_checkpoint(store, run="r", peer=PEER, shapes=shapes)
    assert saved is not None and saved.round == 2
    assert all(
        np.array_equal(v, np.full(v.shape, 0.25, np.float32)) for v in saved.residual.values()
    )
    assert saved.optimizer is not None
    fresh = StrangerNet()
    restarted = torch.optim.AdamW(fresh.parameters(), lr=1e-3, betas=(0.9, 0.95))
    load_optimizer(restarted, saved.optimizer, "r")
    want, got = opt.state_dict(), restarted.state_dict()
    assert (
        want["param_groups"] == [{**g, "betas": tuple(g["betas"])} for g in got["param_groups"]]
        or want["param_groups"] == got["param_groups"]
    )
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, got["state"][index][key]), (index, key)


def test_a_checkpoint_of_another_worker_run_or_model_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "store")
    model, opt = _trained()
    shapes = {n: tuple(v.shape) for n, v in _residual(model, 0).items()}
    assert read_checkpoint(store, run="r", peer=PEER, shapes=shapes) is None
    write_checkpoint(
        store, run="r", peer=PEER, round_=1, residual=_residual(model, 1), optimizer=opt
    )
    with pytest.raises(ResumeRefused, match="not this worker's") as exc:
        read_checkpoint(store, run="r", peer="12D3KooWOther", shapes=shapes)
    assert "\n" not in str(exc.value)
    narrower = {n: (1, *s) for n, s in shapes.items()}
    with pytest.raises(ResumeRefused, match="does not fit this model"):
        read_checkpoint(store, run="r", peer=PEER, shapes=narrower)
    saved = read_checkpoint(store, run="r", peer=PEER, shapes=shapes)
    assert saved is not None and saved.optimizer is not None
    sgd = torch.optim.SGD(StrangerNet().parameters(), lr=0.1)
    with pytest.raises(ResumeRefused, match="does not fit this inner optimizer"):
        load_optimizer(sgd, saved.optimizer, "r")


def test_an_optimizer_whose_state_a_checkpoint_cannot_keep_is_refused_before_any_round() -> None:
    model = StrangerNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    check_optimizer(opt)
    opt.param_groups[0]["schedule"] = object()  # something JSON cannot hold
    with pytest.raises(ResumeRefused, match="holds a object"):
        check_optimizer(opt)
