"""The outer loop's workers behind NAT take part through the same path as
``blob serve --relay``.

The story (``bench.wan.outer_nat``): a run of three ``blob outer worker`` processes on
testbed hosts, 80 ms RTT between any two. hub is public and holds S_0; home and cafe
each sit behind an endpoint-independent NAT and are given ``--relay`` to a public
``blob relay`` (admitting the run's authority). Each NATed worker finds that the relay
cannot dial it back, reserves a slot, and names only its circuit address in its address
file and announcements; home and cafe learn each other from those announcements and
reach each other through the relay, then by hole punching. All three exit 0 on one final
root, both NATed workers' updates are in the closures, and the relay's own byte counter
(printed when it stops) and its host's sent bytes show it carried signalling only: the
update blobs went over direct connections.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.wan.outer_nat import NATED, WORKERS, run_outer_nat

pytestmark = [pytest.mark.usefixtures("nat_capable"), pytest.mark.slow, pytest.mark.timeout(170)]

# What the relay may carry besides blobs: per circuit about 3 KB of Noise, yamux, identify
# and DCUtR (tests/wan/test_nat_cli_fetch.py); here a few circuits (home and cafe dial each
# other through it) and the hellos and announcements gossiped over them before the punch:
# 27-43 KB measured over six runs, never under LEAST_SIGNALLING_BYTES. One update blob (k
# = chunk: about 47 KB) on top of the least signalling is past this bound (asserted
# below), a state blob twenty times larger.
SIGNALLING_BYTES = 64 * 1024
LEAST_SIGNALLING_BYTES = 20 * 1024


def test_natted_workers_take_part_over_punched_connections(tmp_path: Path) -> None:
    run = run_outer_nat(tmp_path, nat="eim")

    for host in WORKERS:
        assert run.exits[host] == 0, (host, run.logs[host][-3000:])
        assert "Traceback" not in run.logs[host], (host, run.logs[host][-3000:])
    # Behind NAT each worker handed out its circuit address only; hub its own.
    assert run.addrs["hub"] == [run.hub_addr]
    for host in NATED:
        assert run.addrs[host] == [f"{run.relay_addr}/p2p-circuit/p2p/{run.peers[host]}"]

    # One final root, no fork, and every worker's update (the NATed ones too) applied.
    results = [run.results[h] for h in WORKERS]
    assert len({r["final_root"] for r in results}) == 1, results
    assert all(r["agreed"] and r["final_round"] == run.params["rounds"] for r in results)
    assert len({r["rounds"][-1]["closure"] for r in results}) == 1
    included = {x["peer"] for r in results for rec in r["rounds"] for x in rec["included"]}
    for host in WORKERS:
        assert run.peers[host] in included, (host, included)
    update_bytes = min(rec["update_bytes"] for r in results for rec in r["rounds"])
    assert update_bytes + LEAST_SIGNALLING_BYTES > SIGNALLING_BYTES  # one relayed would show

    # The relay carried signalling only: its own counter, and its host's bytes (packet
    # headers included), while the NATed hosts did send their updates.
    print(
        f"run {run.seconds:.1f} s; relay carried {run.relayed_bytes} B (its host sent "
        f"{run.sent['relay']} B); update blobs >= {update_bytes} B; home-cafe direct TCP "
        f"flows seen by home's NAT: {run.direct_flows}"
    )
    assert run.relay_exit == 0
    assert LEAST_SIGNALLING_BYTES <= run.relayed_bytes < SIGNALLING_BYTES, run.relayed_bytes
    assert run.sent["relay"] < 3 * SIGNALLING_BYTES
    for host in NATED:
        assert run.sent[host] > update_bytes
