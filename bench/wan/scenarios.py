"""Whole scenarios on the testbed that a bench row and a test both need.

:func:`fan_out` is issue 21's: one seeder on a slow uplink, N workers on fast links,
every ``blob get`` started at once and given only the seeder's address (as a ticket
gives it). It reports how long the fan-out took and how many bytes left the seeder's
uplink, so a test can fail when the seeder served every copy itself.

Start-up skew. On a loaded machine the N processes' start-up (imports above all) ends
seconds apart, and a fetcher that is up early has the seeder to itself: what it took
before the others arrived says nothing about swarming. So every ``blob get`` starts at a
barrier (``bench.wan.blobnodes.Barrier``): it imports what it needs, says it is ready,
and waits; once all are ready (or ``GATE_TIMEOUT`` passed) they go together, within a
few milliseconds, and the fan-out's time runs from that moment.

This used to be a throttle: the seeder's uplink held at 2 Mbit/s until every fetcher
held the manifest. With a 50 ms drop-tail queue that is one 9000-byte packet, and once
the first fetcher (its seeder's only one, so free of the swarm's opening caps: p2p.blob.swarm
rule 6) had requests out, the later fetchers' handshakes and manifests were lost behind
them, again and again, for seconds: gets failed that no real 100 Mbit/s uplink fails.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from bench.wan.blobnodes import Barrier, BlobNode, GetResult, Getting, write_random_file
from bench.wan.testbed import Host, Testbed

SEEDER_MBIT = 100.0
# Longest wait for every fetcher to be up: a loaded CI machine starts a Python process in
# several seconds; past this the gate opens anyway (a fetcher that failed early shows up
# as a failure, not as a hang).
GATE_TIMEOUT = 60.0
GATE_POLL_S = 0.02


def fan_out_hosts(workers: int, *, seeder_mbit: float = SEEDER_MBIT) -> dict[str, Host]:
    """A seeder (``seed``: ``seeder_mbit`` up, 1 Gbit/s down) and workers ``w0``..: 1 Gbit/s,
    one-way delays spread over 20-40 ms."""
    hosts = {"seed": Host(delay_ms=20.0, up_mbit=seeder_mbit, down_mbit=1000.0)}
    for k in range(workers):
        hosts[f"w{k}"] = Host(delay_ms=20.0 + 20.0 * k / max(1, workers - 1))
    return hosts


@dataclass
class FanOut:
    size: int
    seeder_mbit: float
    total_s: float  # the seeder's uplink opened (all gets up) -> the last one exited
    # ... -> the last one held the whole blob (its report's done_at: before it lingered
    # to serve fellows, p2p.blob.swarm rule 5); None if a get did not say
    all_hold_s: float | None
    span_s: float | None  # first verified chunk anywhere -> the last exit (no start-up)
    seeder_uplink_bytes: int  # what left the seeder's uplink, retransmissions included
    results: list[GetResult]

    @property
    def one_transfer_s(self) -> float:
        """One copy at the seeder's uplink rate: the fan-out's yardstick."""
        return self.size / (self.seeder_mbit * 1e6 / 8)

    @property
    def failures(self) -> int:
        return sum(1 for r in self.results if r.returncode != 0)


def fan_out(
    work: Path,
    workers: int,
    size: int,
    *,
    seeder_mbit: float = SEEDER_MBIT,
    timeout: float = 600.0,
    extra_get_args: tuple[str, ...] = (),
    gate: bool = True,
    default_listen: bool = False,
) -> FanOut:
    """Run one fan-out in ``work`` (a fresh testbed; the blob is made and put here).
    ``gate``: start every fetcher at a barrier and let them go together (above).
    ``default_listen``: each ``blob get`` is told no ``--listen`` (a user's command line)."""
    data = work / "fanout.bin"
    write_random_file(data, size, seed=21)
    seeder = BlobNode(work / "seeder", "seed")
    blob_id = seeder.put(data)
    nodes = [BlobNode(work / f"w{k}", f"w{k}") for k in range(workers)]
    try:
        barrier = None
        if gate:
            (work / "barrier").mkdir()
            barrier = Barrier(work / "barrier", work / "barrier" / "go", GATE_TIMEOUT)
        with Testbed(fan_out_hosts(workers, seeder_mbit=seeder_mbit)) as tb:
            served = seeder.serve(tb)
            started = time.monotonic()
            started_wall = time.time()
            gettings = [
                n.start_get(
                    tb,
                    blob_id,
                    [served.addr],
                    *extra_get_args,
                    barrier=barrier,
                    default_listen=default_listen,
                )
                for n in nodes
            ]
            if barrier is not None:
                _wait_all_ready(barrier, nodes, gettings)
                barrier.go.touch()
                started = time.monotonic()
                started_wall = time.time()
            results = [g.wait(timeout) for g in gettings]
            total = time.monotonic() - started
            firsts = [g.first_chunk for g in gettings if g.first_chunk is not None]
            ends = [g.started + r.wall_s for g, r in zip(gettings, results, strict=True)]
            uplink = int(tb.stats()["hosts"]["seed"]["uplink_bytes"])
            seeder.stop()
    finally:
        for node in [seeder, *nodes]:
            shutil.rmtree(node.root, ignore_errors=True)
    span = max(ends) - min(firsts) if firsts else None
    done = [float(d) for r in results if (d := r.report.get("done_at")) is not None]
    all_hold = max(done) - started_wall if len(done) == len(results) else None
    return FanOut(size, seeder_mbit, total, all_hold, span, uplink, results)


def _wait_all_ready(barrier: Barrier, nodes: list[BlobNode], gettings: list[Getting]) -> None:
    """Until every ``blob get`` waits at the barrier or has ended, or GATE_TIMEOUT passed
    (then each goes by itself)."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while time.monotonic() < deadline:
        if all(
            g.proc.poll() is not None or barrier.ready(n)
            for n, g in zip(nodes, gettings, strict=True)
        ):
            return
        time.sleep(GATE_POLL_S)
