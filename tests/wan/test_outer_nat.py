"""Issue 20 item 5: the outer loop's workers behind NAT take part through the same path as
``blob serve --relay``.

The story: a run of three ``blob outer worker`` processes on testbed hosts. hub is
public and holds S_0; home and cafe each sit behind an endpoint-independent NAT and are
given ``--relay`` to a public ``blob relay`` (admitting the run's authority). Each NATed
worker finds that the relay cannot dial it back, reserves a slot, and names only its
circuit address in its address file and announcements; home and cafe learn each other
from those announcements and reach each other by hole punching. All three exit 0 on one
final root, both NATed workers' updates are in the closures everyone applied, and the
relay's own byte counter (printed when it stops) and its host's sent bytes show it
carried signalling only: the update and state blobs went over direct connections.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.wan import Host, Testbed
from bench.wan.blobnodes import _readline
from bench.wan.measure import REPO_ROOT, python_env
from bench.wan.testbed import stop_processes
from identity.keyfile import create_key_file
from training.outer_net import RunParams, prepare_run, worker_argv, worker_env

pytestmark = [pytest.mark.usefixtures("nat_capable"), pytest.mark.slow, pytest.mark.timeout(170)]

RELAY_PORT = 4001
HUB_PORT = 4002
# What the relay may carry besides blobs: per circuit about 3 KB of Noise, yamux, identify
# and DCUtR (tests/wan/test_nat_cli_fetch.py); here a few circuits (home and cafe dial each
# other through it, again after a failed punch) and the announcements gossiped over them
# before a punch: about 19 KB measured. One update blob (k = chunk: about 47 KB) is
# larger than this bound on its own (asserted below), a state blob twenty times larger.
SIGNALLING_BYTES = 40 * 1024
# Start-up of the relay (imports, key, listen) on a loaded 2-vCPU machine.
READY_TIMEOUT = 90.0
# The whole run: three torch imports, a 5 s relay dial-back and a reservation each for
# home and cafe, the start barrier, two rounds and the final-root linger. A bound against
# a hang, not a speed claim.
RUN_TIMEOUT = 140.0

HOSTS = {
    "relay": Host(delay_ms=20.0),
    "hub": Host(delay_ms=20.0),
    "home": Host(delay_ms=20.0, nat="eim"),
    "cafe": Host(delay_ms=20.0, nat="eim"),
}
WORKERS = ("hub", "home", "cafe")  # worker slot i runs on WORKERS[i]


def _sent(tb: Testbed) -> dict[str, int]:
    return {name: int(h["sent_bytes"]) for name, h in tb.stats()["hosts"].items()}


def _direct_flows(tb: Testbed, a: str, b: str) -> int:
    """TCP flows between NATed hosts a and b that a's router tracked as answered
    (conntrack ASSURED): connections hole-punched between them, not through the relay."""
    router = tb.router_netns(a)
    assert router is not None
    table = subprocess.run(
        ["ip", "netns", "exec", router, "cat", "/proc/net/nf_conntrack"],
        capture_output=True, text=True, timeout=10, check=False,
    )  # fmt: skip
    peer = f"dst={tb.public_addr(b)} "
    return sum(peer in line and "ASSURED" in line for line in table.stdout.splitlines())


def _start_relay(
    tb: Testbed, root: Path, authority: str, procs: list[subprocess.Popen[Any]]
) -> tuple[subprocess.Popen[str], str]:
    d = root / "relay"
    d.mkdir()
    create_key_file(d / "machine.key")
    argv = [sys.executable, "-m", "p2p.cli", "--store", str(d / "store")]
    argv += ["--key", str(d / "machine.key"), "relay", "--json", "--authority", authority]
    argv += ["--listen", f"/ip4/{tb.addr('relay')}/tcp/{RELAY_PORT}"]
    proc: subprocess.Popen[str] = tb.popen(
        "relay", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=python_env(), cwd=REPO_ROOT,
    )  # fmt: skip
    procs.append(proc)
    line = _readline(proc, READY_TIMEOUT)
    if not line:
        stop_processes([proc])
        assert proc.stderr is not None
        raise AssertionError(f"relay: no ready line: {proc.stderr.read()[-1500:]}")
    addr: str = json.loads(line)["addrs"][0]
    return proc, addr


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    give_up = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_processes(procs)
            raise AssertionError("a worker did not finish within the run's bound") from None
    return [proc.returncode for proc in procs]


def test_natted_workers_take_part_over_punched_connections(tmp_path: Path) -> None:
    params = RunParams(
        run_id="outer-nat",
        workers=len(WORKERS),
        rounds=2,
        k=4096,  # dense updates (about 47 KB): one crossing the relay shows in its counter
        inner_steps=1,
        deadline=20.0,  # ends a round early only if a worker's update never comes
        proposer_timeout=2.0,
        replay_rate=0.0,
    )
    plan = prepare_run(tmp_path / "run", params)
    procs: list[subprocess.Popen[Any]] = []
    with Testbed(HOSTS) as tb:
        try:
            relay, relay_addr = _start_relay(tb, tmp_path, plan.authority, procs)
            hub_addr = f"/ip4/{tb.addr('hub')}/tcp/{HUB_PORT}/p2p/{plan.workers[0].peer_id}"
            sent = _sent(tb)
            workers: list[subprocess.Popen[bytes]] = []
            for i, host in enumerate(WORKERS):
                if host == "hub":
                    extra = ["--listen", f"/ip4/{tb.addr('hub')}/tcp/{HUB_PORT}"]
                    boot: list[str] = []
                else:
                    extra = ["--relay", relay_addr]
                    boot = [hub_addr]
                argv = worker_argv(plan, i, bootstrap=boot, extra=extra)
                # To a file: a pipe nobody reads while the run goes on could fill and stall it.
                with open(tmp_path / f"{host}.log", "wb") as log:
                    proc = tb.popen(
                        host, argv, stdout=log, stderr=subprocess.STDOUT, env=worker_env(),
                        cwd=REPO_ROOT,
                    )  # fmt: skip
                procs.append(proc)
                workers.append(proc)
            exits = _wait_all(workers, RUN_TIMEOUT)
            after = _sent(tb)
            direct = _direct_flows(tb, "home", "cafe")
            for host, code in zip(WORKERS, exits, strict=True):
                log_text = (tmp_path / f"{host}.log").read_text(errors="replace")
                assert code == 0, (host, log_text[-3000:])
                assert "Traceback" not in log_text, (host, log_text[-3000:])
            results = [json.loads(w.result.read_text()) for w in plan.workers]
            addrs = {
                h: json.loads(w.addr_file.read_text())
                for h, w in zip(WORKERS, plan.workers, strict=True)
            }

            # Behind NAT each worker handed out its circuit address only; hub its own.
            for i, host in enumerate(WORKERS):
                peer = plan.workers[i].peer_id
                if host == "hub":
                    assert addrs[host]["addrs"] == [hub_addr], addrs
                else:
                    assert addrs[host]["addrs"] == [f"{relay_addr}/p2p-circuit/p2p/{peer}"]

            # One final root, no fork, and both NATed workers' updates were applied.
            assert len({r["final_root"] for r in results}) == 1, results
            assert all(r["agreed"] and r["final_round"] == params.rounds for r in results)
            last = [r["rounds"][-1] for r in results]
            assert len({rec["closure"] for rec in last}) == 1
            included = {x["peer"] for r in results for rec in r["rounds"] for x in rec["included"]}
            for i, host in enumerate(WORKERS):
                assert plan.workers[i].peer_id in included, (host, included)
            update_bytes = min(rec["update_bytes"] for r in results for rec in r["rounds"])
            assert update_bytes > SIGNALLING_BYTES  # so a relayed update would show

            # The relay carried signalling only: its own counter, and its host's bytes.
            relay.send_signal(signal.SIGTERM)
            out, err = relay.communicate(timeout=READY_TIMEOUT)
            assert relay.returncode == 0, err
            stats: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
            # Whether home and cafe punched is DCUtR's luck with simultaneous TCP opens (the
            # issue's ~70%; without it cafe fetches home's update from hub): said, not asserted.
            print(
                f"relay carried {stats['relayed_bytes']} B (its host sent "
                f"{after['relay'] - sent['relay']} B); update blobs >= {update_bytes} B; "
                f"home-cafe direct TCP flows seen by home's NAT: {direct}"
            )
            assert stats["relayed_bytes"] < SIGNALLING_BYTES, stats
            assert after["relay"] - sent["relay"] < 3 * SIGNALLING_BYTES  # with packet headers
            # ... while the NATed hosts did send their updates (over direct connections).
            for host in ("home", "cafe"):
                assert after[host] - sent[host] > update_bytes
        finally:
            stop_processes(procs)
