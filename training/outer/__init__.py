"""The decentralised DiLoCo / SparseLoCo outer loop (DESIGN section 8).

Users start at ``training.outer.api`` (``OuterLoop``, ``open_outer_loop``) and
:func:`save_state` (a model's whole state, for ``blob outer init --state``).

Modules, from the bottom up (the layers contract in pyproject.toml holds them to it):

- the sans-IO cores: ``codec`` (SparseLoCo's top-k, 2-bit codec and error feedback),
  ``module_state`` (a model's whole ``state_dict`` by role: trainable, buffers, fixed,
  tied) and ``verification`` (the verification levels, weakest first); ``loop`` (outer
  optimiser, states, inner steps); ``aggregate`` (bounded, robust aggregation),
  ``messages`` (announcements, the update ledger), ``announce`` (when to
  re-send), ``observe`` (what ``blob status`` and the metrics show), ``memory`` (the
  allocator's bound), ``inner`` (a worker's inner state as bytes), ``simconfig`` (the
  simulation's settings); ``params`` (what every worker is given), ``spec`` (the signed run
  spec), ``state_blob`` (the global state as one canonical blob), ``agreement`` (closures,
  proposer rotation, fork choice, readiness);
- the evidence and the run's makings: ``trainer`` (a worker's torch side), ``replay``
  (sampled replay and verdicts), ``milestones`` (the per-round evidence and
  ``verify_run``), ``runs`` (``outer init`` and ``export``, what a spec'd worker builds,
  retention);
- the worker: ``worker`` (a room: the Worker, which closes and agrees on rounds, and the
  parts it owns);
- above it: ``launch`` (running a worker; ``blob outer run``'s local launcher),
  ``simulate`` (the in-process simulation), ``levels`` (checking a run's updates against
  its spec's level); ``api`` (a room: the library around the user's model and loop),
  ``churn`` (workers that leave and join); ``cli`` (``blob outer``).
"""

from typing import Any

__all__ = ["save_state"]


def __getattr__(name: str) -> Any:
    # Imported on first use: ``blob --help`` finds this package's command group and must not
    # load numpy for it (tests/p2p/test_cli_imports.py).
    if name == "save_state":
        from training.outer.module_state import save_state

        return save_state
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
