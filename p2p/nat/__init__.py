"""Reaching peers behind NAT: circuit relay v2 with admission (``relay``) and hole punching
with fetches over a relayed path until a direct one is up (``punch``).
"""
