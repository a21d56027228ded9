"""The local API under bench/api_fuzz.py's attacks, on a real `blob serve` process: the Unix
socket and the TCP port get connections that leave, half requests, garbage, oversize and
30,000-deep lines, slow senders, 1,000 connections at once, tokenless slot holders; the
daemon answers each as API.md says and its owner's status throughout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from p2p.daemon import api
from p2p.daemon.client import connect

from .conftest import Cluster, wait_until

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import api_fuzz  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_daemon_answers_its_owner_through_every_attack(cluster: Cluster) -> None:
    """Guards against a daemon that a connection leaving ends (the `_send` of an error to
    a client gone raised out of the listener), against one shared client budget that
    tokenless TCP connections filled (the owner's socket answered `busy`), and against
    answers API.md does not promise: deep JSON was `internal`, a malformed tokenless TCP
    request `bad_request`. The daemon's descriptors come back once the attacks end."""
    node = cluster.serve("a", "--api-listen", "127.0.0.1:0", "-v")
    store = cluster.store("a")
    daemon = connect(store)
    assert daemon is not None
    host, port = str(daemon.status()["api_tcp"]).rsplit(":", 1)
    baseline = open_fds(node.pid)

    target = api_fuzz.Target(api.socket_path(store), (host, int(port)))
    report = trio.run(api_fuzz.run_fuzz, target, 5.0)
    print(report.summary())

    assert node.proc.poll() is None, "the daemon died"
    assert report.owner_failures == []
    assert len(report.owner) >= 5
    answers = report.answers
    for attack in ("deep", "garbage", "oversize"):
        assert set(answers[f"{attack}/socket"]) == {"bad_request"}, answers
        assert set(answers[f"{attack}/tcp"]) == {"unauthorized"}, answers
    assert set(answers["tokenless/tcp"]) == {"unauthorized"}, answers
    # A slow sender is answered at 2 s while it still sends: it finds itself cut off.
    assert set(answers["slow/socket"]) <= {"bad_request", "cut_off"}, answers
    assert set(answers["slow/tcp"]) <= {"unauthorized", "cut_off"}, answers
    assert answers["many/socket"] == {"opened_1000+": 1}, answers
    assert answers["holders/tcp"]["held"] >= api_fuzz.HOLDERS, answers
    # Every connection ended as a rule says, none by a daemon bug (its handler's catch-all).
    assert "local API connection failed" not in node.log_path.read_text()
    assert wait_until(lambda: open_fds(node.pid) <= baseline + 2, 10), open_fds(node.pid)
    again = connect(store)
    assert again is not None and again.status()["peer_id"] == node.peer_id
