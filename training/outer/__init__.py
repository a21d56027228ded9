"""The decentralised DiLoCo / SparseLoCo outer loop (DESIGN section 9).

Modules, in import order:

- the sans-IO parts: ``codec`` (SparseLoCo's top-k, 2-bit codec and error feedback),
  ``loop`` (outer optimiser, states, the in-process simulation), ``aggregate`` (bounded,
  robust aggregation), ``state_blob``, ``messages`` (announcements, the update ledger),
  ``agreement`` (closures, proposer rotation, fork choice), ``replay`` (sampled replay
  and verdicts), ``milestones`` (the per-round evidence and ``verify_run``);
- the worker: ``params`` (what every worker is given), ``trainer`` (its torch side),
  ``announce`` (gossip and dialling of peers), ``worker`` (the trio shell that closes
  and agrees on rounds), ``launch`` (running a worker; ``blob outer run``'s local
  launcher), ``churn`` (workers that leave and join), ``cli`` (``blob outer``).
"""
