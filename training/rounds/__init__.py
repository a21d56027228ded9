"""Deterministic LoRA training rounds (DESIGN section 8).

Modules, in import order: ``recipe``, ``audit`` (the audited kernel set and its auditor)
and ``trainer`` (the loop), ``commitment`` (commitment, round record), ``round`` (input
verification, run, replay, evidence check), ``inputs`` (fetching a round's inputs from
peers), ``gpu_check`` (the one-command check for a machine with a GPU), ``cli``
(``blob train``). The audited kernel sets lie in ``kernels/``.
"""
