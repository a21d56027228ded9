"""The decentralised DiLoCo / SparseLoCo outer loop (DESIGN section 9).

Modules, in import order (the layers contract in pyproject.toml holds them to it):

- the sans-IO parts: ``codec`` (SparseLoCo's top-k, 2-bit codec and error feedback),
  ``loop`` (outer optimiser, states, inner steps), ``aggregate`` (bounded, robust
  aggregation), ``inner`` (a worker's inner state as bytes), ``state_blob``, ``messages``
  (announcements, the update ledger), ``agreement`` (closures, proposer rotation, fork
  choice), ``replay`` (sampled replay and verdicts), ``milestones`` (the per-round
  evidence and ``verify_run``);
- the worker: ``params`` (what every worker is given), ``trainer`` (its torch side),
  ``announce`` (gossip and dialling of peers), ``worker`` (a room: the Worker, which
  closes and agrees on rounds, and the parts it owns), ``launch`` (running a worker;
  ``blob outer run``'s local launcher), ``simulate`` (the in-process simulation),
  ``churn`` (workers that leave and join), ``cli`` (``blob outer``).
"""
