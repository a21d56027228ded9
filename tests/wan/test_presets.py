"""The three-continent preset meets all three RTTs with per-host delays alone, and a
triangle that per-host delays cannot meet is refused rather than silently bent; the
per-pair extra delay is how to get one. No namespaces needed."""

from __future__ import annotations

import itertools

import pytest

from bench.wan import THREE_CONTINENTS, Host, Testbed, three_continents


def test_three_continents_gives_the_issue_rtts_at_a_gigabit() -> None:
    tb = Testbed(THREE_CONTINENTS)  # not started: only its arithmetic
    assert tb.rtt_ms("eu", "us") == pytest.approx(80.0)
    assert tb.rtt_ms("us", "asia") == pytest.approx(150.0)
    assert tb.rtt_ms("eu", "asia") == pytest.approx(200.0)
    assert {h.up_mbit for h in THREE_CONTINENTS.values()} == {1000.0}
    assert {h.down_mbit for h in THREE_CONTINENTS.values()} == {1000.0}


def test_other_triangles_solve_exactly_or_are_refused() -> None:
    hosts = three_continents(rtt_eu_us=30.0, rtt_us_asia=100.0, rtt_eu_asia=110.0)
    tb = Testbed(hosts)
    for (a, b), rtt in zip(
        itertools.combinations(["eu", "us", "asia"], 2), (30.0, 110.0, 100.0), strict=True
    ):
        assert tb.rtt_ms(a, b) == pytest.approx(rtt)
    with pytest.raises(ValueError, match="per-pair"):
        three_continents(rtt_eu_us=10.0, rtt_us_asia=10.0, rtt_eu_asia=200.0)


def test_per_pair_extra_delay_adds_to_the_rtt_both_ways_given() -> None:
    hosts = {"a": Host(delay_ms=10.0), "b": Host(delay_ms=10.0)}
    tb = Testbed(hosts, extra_delay_ms={("a", "b"): 5.0, ("b", "a"): 5.0})
    assert tb.rtt_ms("a", "b") == pytest.approx(50.0)


def test_bad_host_settings_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="host name"):
        Testbed({"Bad-Name": Host()})
    with pytest.raises(ValueError, match="nat"):
        Host(nat="full-cone")
