"""bench/outer.py --grid: both methods tuned on grids of the same size and budget,
each on its own second axis, with both axes named in the table and the JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_outer", REPO / "bench" / "outer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench() -> Any:
    return _bench()


def _fake_runs(bench: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace the simulation with a made-up loss per grid point; records each config."""
    seen: list[Any] = []

    def fake(config: Any) -> dict[str, Any]:
        seen.append(config)
        if config.mode == "sparseloco" and config.outer_lr == 3.0 and config.ef_decay == 1.0:
            return {"loss": float("inf"), "diverged_at": 4, "x": None, "curve": []}
        loss = 1.0 + abs(config.outer_lr - 1.0) + config.outer_momentum
        if config.mode == "sparseloco":
            loss = 1.0 + abs(config.outer_lr - 2.0) / 10 + (config.ef_decay - 0.9)
        return {
            "loss": loss,
            "x": 157.0 if config.mode == "sparseloco" else 1.0,
            "bytes": 3157,
            "curve": [5.0, loss],
            "seconds": 0.0,
        }

    monkeypatch.setattr(bench, "_grid_run", fake)
    return seen


def test_each_method_gets_its_own_axis_and_the_same_budget(
    bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _fake_runs(bench, monkeypatch)
    assert (
        bench.main(["--grid", "--rounds", "7", "--inner-steps", "3", "--out", str(tmp_path)]) == 0
    )
    dense = [c for c in seen if c.mode == "diloco"]
    sparse = [c for c in seen if c.mode == "sparseloco"]
    assert len(dense) == len(sparse) == 8  # equal budget: 8 runs each
    # Same data and steps for every run.
    assert {(c.workers, c.rounds, c.inner_steps, c.seed, c.k) for c in seen} == {(4, 7, 3, 0, 80)}
    # Dense: lr x Nesterov momentum, plain averaging (lr 1, mu 0) included, no decay tuned.
    assert {(c.outer_lr, c.outer_momentum) for c in dense} >= {(1.0, 0.0), (0.7, 0.9)}
    assert {c.ef_decay for c in dense} == {1.0}
    # SparseLoCo: lr x error-feedback decay, no outer momentum.
    assert {(c.outer_lr, c.ef_decay) for c in sparse} == {
        (lr, d) for lr in (0.7, 1.0, 2.0, 3.0) for d in (1.0, 0.9)
    }
    assert {c.outer_momentum for c in sparse} == {0.0}

    out = capsys.readouterr().out
    assert "Nesterov momentum (0.0, 0.9)" in out
    assert "error-feedback decay (1.0, 0.9)" in out
    assert "best dense DiLoCo 1.0000 (lr 1.0, mu 0.0)" in out
    assert "best SparseLoCo 1.0000 (lr 2.0, decay 0.9)" in out
    assert "diverged" in out
    figures = json.loads(next(tmp_path.glob("outer-grid-*.json")).read_text())
    assert figures["grid"]["second_axis"] == {
        "diloco": {"name": "outer_momentum", "values": [0.0, 0.9]},
        "sparseloco": {"name": "ef_decay", "values": [1.0, 0.9]},
    }
    assert figures["grid"]["points_per_method"] == 8
    best = figures["best"][0]["best"]
    assert best["sparseloco"] == {"loss": 1.0, "lr": 2.0, "ef_decay": 0.9, "axis": "ef_decay"}
    assert best["diloco"]["outer_momentum"] == 0.0
    assert len(figures["runs"]) == 16


def test_the_first_grid_is_still_reachable(
    bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _fake_runs(bench, monkeypatch)
    argv = ["--grid", "--second-axis", "momentum", "--rounds", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    sparse = [c for c in seen if c.mode == "sparseloco"]
    assert {(c.outer_lr, c.outer_momentum) for c in sparse} == {
        (lr, mu) for lr in (0.7, 1.0, 2.0, 3.0) for mu in (0.0, 0.9)
    }
    assert {c.ef_decay for c in sparse} == {1.0}
    assert capsys.readouterr().out.count("Nesterov momentum (0.0, 0.9)") == 2


def test_the_study_runs_every_point_at_every_seed_once_and_reports_medians(
    bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--study: the seeds' median decides the tuned dense point, each point's gap is the
    median of its per-seed gaps, and a rerun skips what the JSON already holds (a study
    stopped by its time bound resumes instead of starting over)."""
    seen = _fake_runs(bench, monkeypatch)
    points = "diloco:lr=1,mu=0;diloco:lr=0.7,mu=0.9;sparseloco:lr=2,decay=0.9,k=64"
    argv = ["--study", points, "--seeds", "0,1,2", "--rounds", "4", "--inner-steps", "3"]
    out = tmp_path / "study.json"
    argv += ["--study-out", str(out), "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert len(seen) == 9
    assert {(c.mode, c.seed) for c in seen} == {
        (m, s) for m in ("diloco", "sparseloco") for s in (0, 1, 2)
    } and {c.k for c in seen if c.mode == "sparseloco"} == {64}
    assert bench.main(argv) == 0
    assert len(seen) == 9  # nothing rerun
    table = capsys.readouterr().out
    # The fake gives dense lr 1 / mu 0 loss 1.0 and the sparse point 1.0: both gaps 0.
    assert "diloco lr 1.0, mu 0.0 (tuned dense) | s0 1.0000, s1 1.0000, s2 1.0000" in table
    assert "| sparseloco decay 0.9, k 64, lr 2.0, mu 0.0 |" in table
    assert "+0.00%, +0.00% | 157x |" in table
    assert len(json.loads(out.read_text())["runs"]) == 9


def test_a_study_of_the_small_model_is_its_own_setting(
    bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model-size small reaches the simulation, does not count the tiny model's runs in
    the same JSON as done, and gets its own rows and tuned dense point in the table (rows
    written before the flag existed are the tiny model's)."""
    seen = _fake_runs(bench, monkeypatch)
    out = tmp_path / "study.json"
    common = ["--study", "diloco:lr=1,mu=0;sparseloco:lr=2,decay=0.9", "--seeds", "0"]
    common += ["--rounds", "2", "--inner-steps", "3", "--study-out", str(out)]
    common += ["--out", str(tmp_path)]
    assert bench.main(common) == 0
    rows = json.loads(out.read_text())["runs"]
    for row in rows:
        del row["model_size"]  # as written before the flag
    out.write_text(json.dumps({"runs": rows}))
    assert bench.main([*common, "--model-size", "small"]) == 0
    assert [c.model_size for c in seen] == ["tiny", "tiny", "small", "small"]
    table = capsys.readouterr().out.split("| setting |")[-1]
    for model in ("tiny", "small"):
        assert table.count(f"| {model}, 4 workers x 3 steps x 2 rounds |") == 2
        assert f"| {model}, 4 workers x 3 steps x 2 rounds | diloco lr 1.0, mu 0.0 (tuned" in table
