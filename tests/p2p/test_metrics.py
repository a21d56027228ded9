"""A node's Prometheus metrics, read over HTTP as Prometheus reads them, and the names
dashboards depend on."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2p.daemon.client import connect
from p2p.metrics import METRIC_NAMES, Metrics

from .conftest import Cluster, random_file, run_blob, wait_until

# What dashboards and alerts are written against (p2p.metrics rule 1). Renaming one breaks
# every operator's dashboard: change this list only with a note in the changelog.
STABLE_NAMES = (
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
# Labels whose values may be a peer or blob ID (unbounded cardinality) are forbidden.
ID_LIKE = re.compile(r"12D3KooW|[0-9a-f]{64}")


def _names(text: str) -> set[str]:
    """Family names as scraped, counters with their _total (as Prometheus stores them)."""
    out = set()
    for family in text_string_to_metric_families(text):
        out.add(family.name + "_total" if family.type == "counter" else family.name)
    return out


def _value(text: str, sample: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {sample}{labels} in the metrics")


def test_metric_names_stay_stable() -> None:
    """Guards dashboards against a silent rename: the declared names are the stable list,
    and each one follows the conventions (prefix, _total, _seconds, _bytes)."""
    assert METRIC_NAMES == STABLE_NAMES
    for name in METRIC_NAMES:
        assert name.startswith("blobnet_"), name
    declared = _names(Metrics().render().decode())
    assert declared <= set(METRIC_NAMES), declared - set(METRIC_NAMES)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_bad_chunk_is_counted_and_its_sender_named(cluster: Cluster, tmp_path: Path) -> None:
    """A fetch from a provider whose chunk fails its hash counts one verification failure
    on the fetching daemon's /metrics and status names that peer; a good fetch then moves
    the byte counters on both sides. Every declared metric is exposed, and no label
    carries a peer or blob ID."""
    blob = random_file(tmp_path / "w.bin", 1 << 20, seed=11)
    blob_id = cluster.put_here("a", blob)
    cluster.put_here("liar", blob)
    source = cluster.serve("a")
    liar = cluster.hostile("liar", "flip")
    fetcher = cluster.serve("b", "--metrics", "127.0.0.1:0")
    assert wait_until(lambda: "/metrics" in fetcher.log_path.read_text(), 10)
    url = re.findall(r"http://\S+/metrics", fetcher.log_path.read_text())[0]

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return str(answer.read().decode())

    failed = run_blob(
        cluster.store("b"), cluster.key("b"), "get", blob_id, "--peer", liar.addr, "--json",
        check=False,
    )  # fmt: skip
    assert failed.returncode == 6, failed.stderr
    text = scrape()
    assert _value(text, "blobnet_chunks_failed_verification_total") == 1
    status = connect(cluster.store("b"))
    assert status is not None
    assert status.status()["bad_chunks_by_peer"] == {liar.peer_id: 1}

    got = cluster.get("b", blob_id, "--peer", source.addr)
    assert got["via"] == "daemon"
    # The exposition is cached for a second (p2p.daemon.scrape rule 3): the next scrape
    # after that shows the fetch.
    assert wait_until(lambda: _value(scrape(), "blobnet_fetches_total", outcome="ok") == 1, 10)
    text = scrape()
    assert _value(text, "blobnet_bytes_received_total", protocol="blob") >= 1 << 20
    assert _value(text, "blobnet_fetches_total", outcome="ok") == 1
    assert _value(text, "blobnet_store_blobs") == 1
    assert _value(text, "blobnet_build_info") == 1
    assert _names(text) == set(METRIC_NAMES)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert not any(ID_LIKE.search(v) for v in s.labels.values()), s
    served = connect(cluster.store("a"))
    assert served is not None
    assert _value(served.metrics(), "blobnet_bytes_sent_total", protocol="blob") >= 1 << 20


def test_the_shipped_dashboard_reads_only_metrics_we_expose() -> None:
    """Guards the Grafana dashboard in ops/ against a metric renamed under it: every
    blobnet_ name its queries use is one the node exposes."""
    import json

    dashboard = json.loads((Path(__file__).parents[2] / "ops" / "grafana-blobnet.json").read_text())
    used = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"blobnet_[a-z_]+", target["expr"])
    }
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)
