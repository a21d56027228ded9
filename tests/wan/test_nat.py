"""NAT hosts on the testbed (what the NAT tests stand on): a host behind an endpoint-independent NAT
keeps one public port for one socket whatever it talks to, so two such hosts can open a
TCP connection to each other by simultaneous open (hole punching); a symmetric NAT gives
every connection a fresh port, so the same attempt fails; nobody can connect in to a
NATed host unasked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.wan import Host, Testbed
from bench.wan.measure import observed_from, probe_argv, punch, python_env

pytestmark = [pytest.mark.usefixtures("nat_capable"), pytest.mark.slow, pytest.mark.timeout(60)]

LOCAL_PORT = 40000


def _hosts(kind: str) -> dict[str, Host]:
    return {
        "home": Host(delay_ms=2.0, nat=kind),
        "cafe": Host(delay_ms=2.0, nat=kind),
        "pub1": Host(delay_ms=2.0),
        "pub2": Host(delay_ms=2.0),
    }


def test_endpoint_independent_nat_keeps_one_mapping_and_lets_a_punch_through() -> None:
    with Testbed(_hosts("eim")) as tb:
        assert tb.addr("home") != tb.public_addr("home")
        seen = {observed_from(tb, "home", pub, local_port=LOCAL_PORT) for pub in ("pub1", "pub2")}
        assert seen == {f"{tb.public_addr('home')}:{LOCAL_PORT}"}
        assert punch(tb, "home", "cafe") == (True, True)


def test_symmetric_nat_maps_each_connection_anew_and_a_punch_fails() -> None:
    with Testbed(_hosts("symmetric")) as tb:
        seen = [observed_from(tb, "home", pub, local_port=LOCAL_PORT) for pub in ("pub1", "pub2")]
        assert {s.split(":")[0] for s in seen} == {tb.public_addr("home")}
        assert seen[0] != seen[1]  # two destinations, two public ports
        assert punch(tb, "home", "cafe", timeout=2.0) == (False, False)


def _listen(tb: Testbed, host: str) -> None:
    server = tb.popen(
        host,
        probe_argv("echo-server", "--port", str(LOCAL_PORT)),
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    assert server.stdout is not None
    assert "ready" in server.stdout.readline()


def _connect(tb: Testbed, src: str, addr: str) -> str:
    """ "connected", "refused" (something answered with a reset) or "timeout"."""
    script = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({addr!r}, {LOCAL_PORT}), timeout=1.5)\n"
        "except ConnectionRefusedError:\n"
        "    sys.exit(8)\n"
        "except TimeoutError:\n"
        "    sys.exit(7)\n"
    )
    done = tb.run(src, [sys.executable, "-c", script], timeout=30)
    return {0: "connected", 7: "timeout", 8: "refused"}[done.returncode]


def test_nobody_connects_in_to_a_natted_host_unasked() -> None:
    """The router drops an unsolicited SYN without a word, as home routers do: a reset
    instead would abort the far side of a hole punch whose SYN arrived first."""
    with Testbed(_hosts("eim")) as tb:
        _listen(tb, "home")
        _listen(tb, "pub2")
        assert _connect(tb, "pub1", tb.public_addr("pub2")) == "connected"  # the path works
        assert _connect(tb, "pub1", tb.public_addr("home")) == "timeout"
