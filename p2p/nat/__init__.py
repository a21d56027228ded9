"""Reaching peers behind NAT: circuit relay v2 with admission (``relay``), hole punching
with fetches over a relayed path until a direct one is up (``punch``), the punch's dial
(``holepunch``) and its SYNs (``syn``).

Import order: ``syn`` (sans-IO schedule and trace, and the SYN thread) < ``holepunch``
(the DCUtR dial and the listener's claim) < ``relay`` < ``punch``.
"""
