"""Mutable names over immutable blobs (``NAMES.md``): signed records (``record``), their
cache (``cache``), the names protocol (``protocol``) and the service that publishes and
resolves them over the DHT and peers (``service``).
"""
