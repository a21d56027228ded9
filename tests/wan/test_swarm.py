"""Swarming on the emulated WAN: one seeder with a 100 Mbit/s uplink, three `blob get`
processes started at once, each told only the seeder's address (as a ticket tells it) and
nothing else a user would not type: each listens on every interface, as `blob get` does by
default with a remote peer, so what identify tells the seeder about it must name its real
addresses for the seeder's `peers` answers to list it. Peer exchange, chunks in flight
shown to fellows (1.3.0 `status`) and the swarm partition let them fetch from each other,
so the seeder's uplink carries much less than the three copies it carried before (3.0x the
blob and more, retransmissions included; so it did with that wildcard listen too).

The three start fetching together, after their imports (bench.wan.scenarios: start-up
skew). Without that gate this test failed about 2 runs in 7 on a loaded machine: a
fetcher that started seconds before the others took most of the blob from the seeder
alone, and the seeder sent 2.5x the blob and more."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.wan.scenarios import fan_out

pytestmark = [pytest.mark.slow, pytest.mark.timeout(110)]

MiB = 1 << 20
SIZE = 32 * MiB  # 2.7 s at the seeder's uplink: long enough for fellows to find each other
WORKERS = 3
# Without peer exchange the seeder sends every copy, WORKERS times the blob; with it
# 1.23-2.27x here (18 runs on 2026-12-02, median 1.42: the first fetcher to reach the
# seeder takes most of the blob from it, a few chunks go twice while fellows learn of each
# other, and the endgame duplicates the last ones). The margin is for a loaded CI machine;
# a seeder that serves every copy sends 3.0x and more.
MAX_SEEDER_SHARE = 2.5


def test_three_fetchers_given_only_the_seeder_spare_its_uplink(
    wan_capable: None, tmp_path: Path
) -> None:
    result = fan_out(tmp_path, WORKERS, SIZE, timeout=60.0, default_listen=True)
    assert result.failures == 0, [r.stderr[-300:] for r in result.results if r.returncode]
    share = result.seeder_uplink_bytes / SIZE
    assert share < MAX_SEEDER_SHARE, (
        f"the seeder sent {share:.2f}x the blob to {WORKERS} fetchers: they did not "
        "fetch from each other"
    )
    # Each report names the peers it fetched from: the seeder, and fellows when it swarmed.
    sources = [sum(1 for s in r.report["peers"].values() if s["bytes"]) for r in result.results]
    assert max(sources) > 1, f"every fetcher took bytes from one peer only ({sources})"
