"""A node's Prometheus metrics: one registry per node, owned by the node, never global.

Rules
1. Every name starts with ``blobnet_``; counters end in ``_total``, sizes in ``_bytes``,
   durations in ``_seconds`` (Prometheus' naming conventions, as kubo and Dragonfly use).
   ``METRIC_NAMES`` lists them all and a test keeps that list stable: dashboards and
   alerts are written against these names.
2. Labels have bounded cardinality: each label's values are a closed set named here
   (``PROTOCOLS``, ``FETCH_OUTCOMES``, ...). Peer IDs and blob IDs are never labels (one
   series per peer or blob grows without bound); they belong in ``blob status`` and logs.
3. Counters are incremented where the event happens (a fetch ends, a chunk fails its
   hash); values that already live in an object (the server's bytes sent, the store's
   size, connections) are read when scraped, by a collector the daemon adds
   (``p2p.daemon.collect``), so nothing is counted twice.
4. The outer training loop's metrics are declared here so their names are stable; the
   loop sets them through the same registry.
"""

from __future__ import annotations

import collections
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# prometheus-client adds a `<name>_created` timestamp series beside every counter and
# histogram; in the text format it reads as one more gauge per metric, which doubles the
# series an operator scrapes for nothing Prometheus uses. (A process-wide switch: blobnet
# is the only user of the library in its processes.)
disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "blobnet_"
# The closed label sets (rule 2).
PROTOCOLS = ("blob", "names", "relay")
FETCH_OUTCOMES = ("ok", "not_found", "failed", "cancelled")
CONNECTION_KINDS = ("direct", "relayed", "lane")
REFUSAL_REASONS = ("busy", "tentative_declined", "unadmitted")
EXCLUSION_REASONS = ("bounds", "replay", "late", "score", "invalid")
REPLAY_VERDICTS = ("agree", "disagree", "error")
# Fetch durations from a warm local fetch (tens of ms) to a large blob across continents.
FETCH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
FETCH_BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 41, 4))  # 64 KiB .. 1 TiB

# Every metric name as Prometheus shows it (counters with their _total), rule 1.
METRIC_NAMES = (
    "blobnet_build_info",
    "blobnet_bytes_sent_total",
    "blobnet_bytes_received_total",
    "blobnet_chunks_failed_verification_total",
    "blobnet_fetches_total",
    "blobnet_fetch_duration_seconds",
    "blobnet_fetch_size_bytes",
    "blobnet_connections",
    "blobnet_holepunch_attempts_total",
    "blobnet_holepunch_successes_total",
    "blobnet_relay_bytes_total",
    "blobnet_server_refusals_total",
    "blobnet_store_bytes",
    "blobnet_store_blobs",
    "blobnet_transfers_in_flight",
    "blobnet_dht_peers",
    "blobnet_outer_round",
    "blobnet_outer_compute_seconds",
    "blobnet_outer_communication_seconds",
    "blobnet_outer_updates_included_total",
    "blobnet_outer_updates_excluded_total",
    "blobnet_outer_replay_verdicts_total",
)


def package_version() -> str:
    try:
        return version("blobnet")
    except PackageNotFoundError:  # run from a source tree without an install
        return "unknown"


class Metrics:
    """The metrics of one node (rule 3: those counted where they happen)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ended: collections.Counter[str] = collections.Counter()  # fetches, by outcome
        r = self.registry
        self.build_info = Gauge(
            "blobnet_build_info", "Always 1; the version as a label.", ["version"], registry=r
        )
        self.build_info.labels(version=package_version()).set(1)
        self.bytes_received = Counter(
            "blobnet_bytes_received",
            "Payload bytes received, by protocol (blob: verified chunk bytes fetched).",
            ["protocol"],
            registry=r,
        )
        self.fetches = Counter(
            "blobnet_fetches", "Blob fetches that ended, by outcome.", ["outcome"], registry=r
        )
        self.fetch_seconds = Histogram(
            "blobnet_fetch_duration_seconds",
            "Wall time of fetches that ended.",
            ["outcome"],
            buckets=FETCH_SECONDS_BUCKETS,
            registry=r,
        )
        self.fetch_bytes = Histogram(
            "blobnet_fetch_size_bytes",
            "Size of blobs fetched successfully.",
            buckets=FETCH_BYTES_BUCKETS,
            registry=r,
        )
        for protocol in PROTOCOLS:
            self.bytes_received.labels(protocol=protocol)
        for outcome in FETCH_OUTCOMES:
            self.fetches.labels(outcome=outcome)
            self.fetch_seconds.labels(outcome=outcome)
        # The outer loop's (rule 4).
        self.outer_round = Gauge("blobnet_outer_round", "Current outer round.", registry=r)
        self.outer_compute = Histogram(
            "blobnet_outer_compute_seconds", "Inner-step compute time per round.", registry=r
        )
        self.outer_comm = Histogram(
            "blobnet_outer_communication_seconds",
            "Time per round spent publishing and fetching updates.",
            registry=r,
        )
        self.outer_included = Counter(
            "blobnet_outer_updates_included", "Updates included in a round.", registry=r
        )
        self.outer_excluded = Counter(
            "blobnet_outer_updates_excluded",
            "Updates excluded from a round, by reason.",
            ["reason"],
            registry=r,
        )
        self.replay_verdicts = Counter(
            "blobnet_outer_replay_verdicts", "Replays of others' updates, by verdict.",
            ["verdict"], registry=r,
        )  # fmt: skip
        for reason in EXCLUSION_REASONS:
            self.outer_excluded.labels(reason=reason)
        for verdict in REPLAY_VERDICTS:
            self.replay_verdicts.labels(verdict=verdict)

    def fetch_ended(self, outcome: str, seconds: float, size: int | None = None) -> None:
        """One fetch ended (``outcome`` one of ``FETCH_OUTCOMES``)."""
        if outcome not in FETCH_OUTCOMES:
            raise ValueError(f"unknown fetch outcome {outcome!r}")  # our bug: rule 2
        self.ended[outcome] += 1
        self.fetches.labels(outcome=outcome).inc()
        self.fetch_seconds.labels(outcome=outcome).observe(seconds)
        if size is not None and outcome == "ok":
            self.fetch_bytes.observe(size)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything registered."""
        return bytes(generate_latest(self.registry))
