"""A tiny outer-loop run with workers behind NAT (issue 20 item 5), on the WAN testbed.

Three ``blob outer worker`` processes: hub is public and holds S_0; home and cafe each
sit behind a NAT (``nat``: "eim" or "symmetric") and are given ``--relay`` to a public
``blob relay`` that admits the run's authority. All start at once; home and cafe
bootstrap to hub and learn each other from the announcements (circuit addresses), so
they reach each other through the relay and, if DCUtR manages, by hole punching.

:func:`run_outer_nat` returns what the test (tests/wan/test_outer_nat.py) and the bench
(``bench/outer_net.py --nat-runs``) judge: exit codes, results and address files, the
relay's own byte counter (printed when it stops), each host's sent bytes over the run,
and the home-cafe TCP flows home's NAT router saw answered (conntrack ASSURED: punched
connections). Every process is stopped and every namespace removed, also on failure.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.wan import Host, Testbed
from bench.wan.blobnodes import _readline
from bench.wan.measure import REPO_ROOT, python_env
from bench.wan.testbed import stop_processes
from identity.keyfile import create_key_file
from training.outer.launch import prepare_run, worker_argv, worker_env
from training.outer.params import RunParams

RELAY_PORT = 4001
HUB_PORT = 4002
WORKERS = ("hub", "home", "cafe")  # worker slot i runs on WORKERS[i]
NATED = ("home", "cafe")
# Start-up of the relay (imports, key, listen) on a loaded 2-vCPU machine.
READY_TIMEOUT = 90.0
# The whole run: three torch imports, a 5 s relay dial-back and a reservation each for
# home and cafe, the start barrier, two rounds (a failing punch waits out its timeout)
# and the final-root linger. A bound against a hang, not a speed claim.
RUN_TIMEOUT = 140.0


class OuterNatFailed(AssertionError):
    """A process of the run did not start or finish within its bound."""


@dataclass
class OuterNatRun:
    exits: dict[str, int]
    logs: dict[str, str]
    results: dict[str, dict[str, Any]]  # of the workers that exited 0
    addrs: dict[str, list[str]]  # what each worker's address file handed out
    peers: dict[str, str]
    relay_addr: str
    hub_addr: str
    relay_exit: int
    relayed_bytes: int
    sent: dict[str, int]  # bytes each host sent while the workers ran
    direct_flows: int
    seconds: float
    params: dict[str, Any] = field(default_factory=dict)


def _sent(tb: Testbed) -> dict[str, int]:
    return {name: int(h["sent_bytes"]) for name, h in tb.stats()["hosts"].items()}


def direct_flows(tb: Testbed, a: str, b: str) -> int:
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
        raise OuterNatFailed(f"relay: no ready line: {proc.stderr.read()[-1500:]}")
    addr: str = json.loads(line)["addrs"][0]
    return proc, addr


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    give_up = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_processes(procs)
            raise OuterNatFailed("a worker did not finish within the run's bound") from None
    return [proc.returncode for proc in procs]


def outer_nat_params(k: int = 4096) -> RunParams:
    """Two rounds of one inner step; ``k`` = chunk by default: dense updates (about
    47 KB), so one that crossed the relay would show in its counter."""
    return RunParams(
        run_id="outer-nat",
        workers=len(WORKERS),
        rounds=2,
        inner_steps=1,
        k=k,
        deadline=20.0,  # ends a round early only if a worker's update never comes
        proposer_timeout=2.0,
        replay_rate=0.0,
    )


def run_outer_nat(
    workdir: Path,
    *,
    nat: str = "eim",
    delay_ms: float = 20.0,
    params: RunParams | None = None,
    worker_extra: tuple[str, ...] = (),
) -> OuterNatRun:
    """One run (see the module docstring); ``worker_extra``: more options for the NATed
    workers (``--via-relay``)."""
    params = outer_nat_params() if params is None else params
    hosts = {
        "relay": Host(delay_ms=delay_ms),
        "hub": Host(delay_ms=delay_ms),
        **{h: Host(delay_ms=delay_ms, nat=nat) for h in NATED},
    }
    plan = prepare_run(workdir / "run", params)
    procs: list[subprocess.Popen[Any]] = []
    t0 = time.monotonic()
    with Testbed(hosts) as tb:
        try:
            relay, relay_addr = _start_relay(tb, workdir, plan.authority, procs)
            hub_addr = f"/ip4/{tb.addr('hub')}/tcp/{HUB_PORT}/p2p/{plan.workers[0].peer_id}"
            before = _sent(tb)
            workers: list[subprocess.Popen[bytes]] = []
            for i, host in enumerate(WORKERS):
                if host == "hub":
                    extra = ["--listen", f"/ip4/{tb.addr('hub')}/tcp/{HUB_PORT}"]
                    boot: list[str] = []
                else:
                    extra = ["--relay", relay_addr, *worker_extra]
                    boot = [hub_addr]
                argv = worker_argv(plan, i, bootstrap=boot, extra=extra)
                # To a file: a pipe nobody reads while the run goes on could fill and stall it.
                with open(workdir / f"{host}.log", "wb") as log:
                    proc = tb.popen(
                        host, argv, stdout=log, stderr=subprocess.STDOUT, env=worker_env(),
                        cwd=REPO_ROOT,
                    )  # fmt: skip
                procs.append(proc)
                workers.append(proc)
            exits = dict(zip(WORKERS, _wait_all(workers, RUN_TIMEOUT), strict=True))
            seconds = time.monotonic() - t0
            after = _sent(tb)
            flows = direct_flows(tb, "home", "cafe")
            relay.send_signal(signal.SIGTERM)
            try:
                out, _ = relay.communicate(timeout=READY_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise OuterNatFailed("the relay did not stop on SIGTERM") from None
            lines = out.strip().splitlines()
            stats: dict[str, Any] = json.loads(lines[-1]) if lines else {}
        finally:
            stop_processes(procs)
    results, addrs = {}, {}
    for host, w in zip(WORKERS, plan.workers, strict=True):
        if exits[host] == 0 and w.result.exists():
            results[host] = json.loads(w.result.read_text())
        if w.addr_file.exists():
            addrs[host] = json.loads(w.addr_file.read_text())["addrs"]
    return OuterNatRun(
        exits=exits,
        logs={h: (workdir / f"{h}.log").read_text(errors="replace") for h in WORKERS},
        results=results,
        addrs=addrs,
        peers={h: w.peer_id for h, w in zip(WORKERS, plan.workers, strict=True)},
        relay_addr=relay_addr,
        hub_addr=hub_addr,
        relay_exit=relay.returncode,
        relayed_bytes=int(stats.get("relayed_bytes", -1)),
        sent={h: after[h] - before[h] for h in after},
        direct_flows=flows,
        seconds=seconds,
        params=dict(params.__dict__),
    )
