"""`serve --metrics`: the exposition served from the node's own event loop (p2p.daemon.scrape),
with a read deadline, a connection cap and a one-second cache; a warning beyond loopback;
a taken port ends serve before its ready line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.daemon import scrape
from p2p.metrics import Metrics
from tests.blob_cli import blob_here

from .conftest import Cluster, blob_cmd, wait_until


class CountedMetrics(Metrics):
    """A node's metrics that count how often they are rendered."""

    def __init__(self) -> None:
        super().__init__()
        self.rendered = 0

    def render(self) -> bytes:
        self.rendered += 1
        return super().render()


def test_the_exposition_is_rendered_at_most_once_a_second() -> None:
    """Guards against a scrape flood costing a render each (527 scrapes a second took 76%
    of a core and doubled a get's time): every scrape within EXPOSITION_TTL of a render
    gets its bytes."""
    metrics = CountedMetrics()

    async def main() -> None:
        exposition = scrape.Exposition(metrics)
        first = await exposition.text()
        for _ in range(500):
            assert await exposition.text() == first
            await trio.sleep(scrape.EXPOSITION_TTL / 1000)
        assert metrics.rendered == 1
        await trio.sleep(scrape.EXPOSITION_TTL / 2)
        await exposition.text()
        assert metrics.rendered == 2

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _counts(pid: int) -> tuple[int, int]:
    """The process's threads and open descriptors."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def _ask(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_metrics_slowloris_holds_no_thread_and_its_sockets_go(cluster: Cluster) -> None:
    """Guards against prometheus-client's server: a thread and a descriptor per half-sent
    request, forever (1,500 of each after 65 s). 300 connections that send `GET /metr`
    and stall hold no thread, at most MAX_PENDING descriptors, and none after
    READ_TIMEOUT, while they stay open; a scrape in the middle of them is answered."""
    node = cluster.serve("a", "--metrics", "127.0.0.1:0")
    assert wait_until(lambda: "/metrics" in node.log_path.read_text(), 10)
    url = re.findall(r"http://\S+/metrics", node.log_path.read_text())[0]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    threads, fds = _counts(node.pid)

    stalled = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET /metr")
            stalled.append(sock)
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert b"blobnet_build_info" in answer.read()
        during_threads, during_fds = _counts(node.pid)
        assert during_threads <= threads + 1, (threads, during_threads)
        assert during_fds <= fds + scrape.MAX_PENDING + 2, (fds, during_fds)
        assert wait_until(lambda: _counts(node.pid)[1] <= fds + 1, scrape.READ_TIMEOUT + 5)
    finally:
        for sock in stalled:
            sock.close()
    head = _ask(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
    assert _ask(port, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert _ask(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 405")
    assert _ask(port, b"\x16\x03\x01garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
    huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (scrape.MAX_HEAD_BYTES + 1) + b"\r\n\r\n"
    assert _ask(port, huge).startswith(b"HTTP/1.1 400")


def test_metrics_beyond_loopback_are_said_with_a_warning(tmp_path: Path) -> None:
    """Guards against `--metrics 0.0.0.0:PORT` being taken silently, where the API's own
    non-loopback address is refused or warned about."""
    store = str(tmp_path / "store")
    wide = blob_here(["--store", store, "serve", "--metrics", "0.0.0.0:9464", "--print-config"])
    assert "warning: metrics are served on 0.0.0.0, beyond this machine" in wide.stderr
    local = blob_here(["--store", store, "serve", "--metrics", ":9464", "--print-config"])
    assert "warning" not in local.stderr


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_taken_metrics_port_ends_serve_before_its_ready_line(cluster: Cluster) -> None:
    """Guards against serve saying it ran (its ready line, or the summary of a serve that
    never served) before the error that the metrics port is taken."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with taken:
        port = taken.getsockname()[1]
        args = ["serve", "--json", "--no-dht", "--listen", "/ip4/127.0.0.1/tcp/0"]
        done = subprocess.run(
            blob_cmd(cluster.store("a"), cluster.key("a"), *args, "--metrics", f"127.0.0.1:{port}"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if "created a new machine key" not in line]
    assert lines == [
        f"blob: error: could not serve metrics on 127.0.0.1:{port}: Address already in use"
    ], done.stderr
