"""A worker's disk over a run is bounded by the rounds it keeps (training.outer.runs point 4):
the state blobs and its own inner-state blobs of rounds older than ``keep_states`` are
deleted as the run goes on, while everything ``blob outer verify`` needs stays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from training.outer.runs import Retention

# Two rounds more than are kept: without retention the store would hold two states and two
# inner states too many.
ROUNDS = 4
KEEP = 2
SHAPES = (("lin.bias", (8,)), ("lin.weight", (8, 8)))


class Line(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _spec(tmp: Path, plan: Any) -> str:
    from safetensors.torch import save_file

    from blobstore import Store
    from identity import SoftwareSigner, load_key_file
    from training.outer.runs import init_run

    torch.manual_seed(0)
    source = tmp / "initial.safetensors"
    save_file({n: p.detach().contiguous() for n, p in Line().named_parameters()}, str(source))
    w0 = plan.workers[0]
    spec_id, _ = init_run(
        Store.open(w0.store),
        SoftwareSigner(load_key_file(w0.key)),
        source,
        run_id="keep",
        authorities=[plan.authority],
        options={
            "workers": 1,
            "inner_steps": 1,
            "rounds": ROUNDS,
            "chunk": 64,
            "k": 8,
            "deadline": 2.0,
            # One worker: it proposes at once, and after the last round it waits
            # 2 * proposer_timeout + 2 s for a better closure nobody else can send.
            "proposer_timeout": 0.1,
        },
    )
    return spec_id


def _kinds(store: Any) -> dict[str, int]:
    """How many of the run's state blobs and inner-state blobs the store holds (the
    launcher's own S_0, of another model, is not the run's)."""
    from training.outer.state_blob import BadStateBlob, decode_state

    counts = {"state": 0, "inner": 0}
    for blob in store.blob_ids():
        data = store.path(blob).read_bytes()
        try:
            decode_state(data, expected=dict(SHAPES))
            counts["state"] += 1
            continue
        except BadStateBlob:
            pass
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception:  # not msgpack at all: another kind of blob
            continue
        if isinstance(obj, dict) and set(obj) == {"v", "opt", "ef"}:
            counts["inner"] += 1
    return counts


@pytest.mark.timeout(120)
def test_old_state_and_inner_blobs_go_and_the_run_still_verifies(tmp_path: Path) -> None:
    """Guards against a store that grows by a state blob and an inner-state blob per round
    (untagged, left for ``blob gc``): after 4 rounds keeping 2, it holds the start state
    and the last 2 rounds' states, the last 2 inner states, and verifies from the start."""
    from blobstore import Store
    from identity import TrustStore, parse_public_key
    from p2p import BlockingNode
    from training.outer.api import OuterLoop
    from training.outer.launch import prepare_run
    from training.outer.milestones import verify_run
    from training.outer.params import RunParams

    plan = prepare_run(tmp_path / "run", RunParams("keep", workers=1, rounds=1, inner_steps=1))
    spec = _spec(tmp_path, plan)
    w0 = plan.workers[0]
    model = Line()
    x = torch.ones(4, 8)
    with (
        BlockingNode(
            w0.store, key_path=w0.key, listen=["/ip4/127.0.0.1/tcp/0"], dht=False, pubsub=True
        ) as node,
        OuterLoop(node, spec=spec, model=model, certificate=w0.cert, keep_states=KEEP) as loop,
    ):
        loop.join()
        for _ in range(10 * ROUNDS):  # bounded: ROUNDS rounds of one step
            model.zero_grad()
            model(x).square().mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            loop.step()
            if loop.finished:
                break
        result = loop.result
    assert result is not None and result["final_round"] == ROUNDS
    store = Store.open(w0.store)
    kinds = _kinds(store)
    assert kinds["state"] <= KEEP + 1, kinds  # the start (S_0) and the last KEEP rounds'
    assert kinds["inner"] <= KEEP, kinds
    tip = result["rounds"][-1]["state_blob"]
    assert store.has(tip)
    trust = TrustStore(frozenset({parse_public_key(plan.authority)}))
    report = verify_run(store, "keep", trust)
    assert report.ok, report.failures
    assert report.checked_rounds == list(range(ROUNDS))


def test_retention_names_what_fell_out_of_the_kept_rounds() -> None:
    keep = Retention(2)
    assert keep.state(0, "s-0", "a") == []
    assert keep.state(1, "s-1", "b") == []
    assert keep.state(2, "s-2", "c") == [("s-0", "a")]
    # Another closure of round 2 won: its state replaces the tag's blob, which goes.
    assert keep.state(2, "s-2", "d") == [("", "c")]
    assert keep.inner(0, "i0") == [] and keep.inner(1, "i1") == []
    assert keep.inner(5, "i5") == ["i0", "i1"]
    with pytest.raises(ValueError, match="at least one"):
        Retention(0)
