"""The testbed itself, on real namespaces: the RTT a TCP echo sees is the configured one,
a shaped link carries its rate and no more, configured loss drops about that share of
datagrams, and no namespace outlives the testbed (normal exit, exception, SIGTERM, or an
owner that died without cleaning up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from bench.wan import PREFIX, THREE_CONTINENTS, Host, Testbed, list_namespaces, sweep
from bench.wan.measure import PROBE_PORT, python_env, tcp_rate, tcp_rtts_ms, udp_delivered

pytestmark = [pytest.mark.usefixtures("wan_capable"), pytest.mark.timeout(60)]

MiB = 1 << 20


@pytest.mark.slow
def test_tcp_round_trips_match_the_three_continent_rtts() -> None:
    with Testbed(THREE_CONTINENTS) as tb:
        for a, b, rtt in (("eu", "asia", 200.0), ("eu", "us", 80.0)):
            assert tb.rtt_ms(a, b) == pytest.approx(rtt)
            # The least of a few: scheduling on a busy machine only ever adds delay, and
            # the forwarder sleeps in whole milliseconds.
            measured = min(tcp_rtts_ms(tb, a, b, count=5))
            assert rtt - 1.0 <= measured <= rtt + 10.0, (a, b, measured)


@pytest.mark.slow
def test_a_shaped_link_carries_its_rate_and_no_more() -> None:
    """100 Mbit/s at 4 ms RTT: one stock connection fills it (BDP 50 KB) and never goes
    past it. What this machine can forward at all is measured in the same run, the other
    way over a 1 Gbit/s link: a loaded machine that cannot carry 100 Mbit/s then lowers
    the floor, never the ceiling."""
    hosts = {
        "a": Host(delay_ms=1.0, up_mbit=100, down_mbit=1000),
        "b": Host(delay_ms=1.0, up_mbit=1000, down_mbit=1000),
    }
    with Testbed(hosts) as tb:
        got = tcp_rate(tb, "a", "b", 16 * MiB)
        stats = tb.stats()["hosts"]
        fast = tcp_rate(tb, "b", "a", 16 * MiB, port=PROBE_PORT + 10)
    line_rate = 100e6 / 8
    floor = 0.80 * min(line_rate, fast["rate_bytes_per_s"])
    assert floor <= got["rate_bytes_per_s"] <= 1.02 * line_rate, (got, fast)
    assert stats["a"]["sent_bytes"] >= 16 * MiB


@pytest.mark.slow
def test_configured_loss_drops_about_that_share_of_datagrams() -> None:
    count = 2000
    with Testbed({"a": Host(delay_ms=1.0), "b": Host(delay_ms=1.0)}, loss=0.05, seed=3) as tb:
        delivered = udp_delivered(tb, "a", "b", count=count)
        lost = tb.stats()["hosts"]["a"]["lost"]
    assert lost == count - delivered  # every missing datagram is one the emulator dropped
    assert 0.03 * count <= lost <= 0.07 * count  # 5% expected, sd ~0.5%


def test_namespaces_are_gone_after_the_block_even_after_an_exception() -> None:
    with Testbed({"a": Host(), "b": Host()}) as tb:
        names = [tb.netns("a"), tb.netns("b")]
        assert set(names) <= set(list_namespaces())
    assert not set(names) & set(list_namespaces())

    class Boom(Exception):
        pass

    seen: list[tuple[str, subprocess.Popen[bytes]]] = []

    def fail_inside() -> None:
        with Testbed({"a": Host()}) as tb:
            seen.append((tb.netns("a"), tb.popen("a", ["sleep", "60"])))
            raise Boom

    with pytest.raises(Boom):
        fail_inside()
    [(name, proc)] = seen
    assert name not in list_namespaces()
    assert proc.poll() is not None  # its processes went with it


def test_sigterm_tears_the_testbed_down() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from bench.wan import Host, Testbed
        with Testbed({"a": Host(), "b": Host()}) as tb:
            print(tb.netns("a"), tb.netns("b"), flush=True)
            time.sleep(60)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=python_env()
    ) as proc:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        assert len(names) == 2 and set(names) <= set(list_namespaces())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert not set(names) & set(list_namespaces())


def test_a_second_interrupt_or_a_failing_step_mid_teardown_still_removes_everything() -> None:
    """Ctrl-C pressed again (or pytest-timeout's alarm) while the testbed closes, and a
    teardown step that fails: the interrupt waits for the teardown's end, the other
    steps still run, and no namespace is left."""
    tb = Testbed({"a": Host(), "b": Host()})
    tb.start()
    names = [tb.netns("a"), tb.netns("b")]
    assert tb._control is not None
    close_control = tb._control.close

    class InterruptedClose:
        def close(self) -> None:
            close_control()
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError("closing the control socket failed")

    tb._control = InterruptedClose()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        tb.close()
    assert not set(names) & set(list_namespaces())


def test_sweep_removes_leftovers_of_dead_owners_only() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{PREFIX}{dead.pid}-0-x"
    subprocess.run(["ip", "netns", "add", leftover], check=True, timeout=10)
    try:
        with Testbed({"a": Host()}) as tb:  # its start sweeps; its own names survive
            assert leftover not in list_namespaces()
            assert tb.netns("a") in list_namespaces()
            assert tb.netns("a") not in sweep()
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True, timeout=10)
