"""A `blob serve`'s local API against what an outsider or a careless owner does: a second
serve on its store, a listener at its limit of clients, FIFOs named in puts, a put's client
leaving halfway, and paths the API must not read for its caller. Real `blob serve`
processes on 127.0.0.1 over real stores; the clients are real `blob` processes or raw
sockets speaking API.md."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import pytest

from blobstore import Store
from p2p.daemon import api
from p2p.daemon.client import DaemonClient, DaemonRefused, Endpoint, connect
from p2p.daemon.paths import check_caller, peer_uid

from .conftest import Cluster, blob_cmd, random_file, run_blob, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_second_serve_is_refused_and_the_first_survives_clients_that_leave(
    cluster: Cluster,
) -> None:
    """Guards against the daemon ending when anything connected to its socket and left
    (its error reply to a client gone raised out of the listener, 3 of 3 times), and a
    second serve on the store running on without an API: it is refused in one line,
    naming the first, and the first goes on."""
    first = cluster.serve("a")
    sock = api.socket_path(cluster.store("a"))
    for _ in range(20):
        leaving = socket.socket(socket.AF_UNIX)
        leaving.connect(str(sock))
        leaving.close()
    half = socket.socket(socket.AF_UNIX)
    half.connect(str(sock))
    half.sendall(b'{"api": 1, "op": "sta')
    half.close()

    second = run_blob(
        cluster.store("a"), cluster.key("a"), "serve", "--no-dht", "--listen",
        "/ip4/127.0.0.1/tcp/0", timeout=60, check=False,
    )  # fmt: skip
    assert second.returncode == 5, second.stderr
    assert second.stdout == ""
    assert second.stderr.strip().splitlines() == [
        f"blob: error: another daemon (pid {first.pid}) already serves the store "
        f"{cluster.store('a')}; stop it first, or give this one a --store of its own"
    ]
    assert first.proc.poll() is None
    daemon = connect(cluster.store("a"))
    assert daemon is not None and daemon.status()["peer_id"] == first.peer_id


class SilentPeers:
    """A TCP listener that accepts and never speaks: every dial to it waits for the node's
    handshake timeout. ``addrs``: multiaddrs naming it with made-up peer IDs."""

    def __init__(self, count: int) -> None:
        from identity import MachineKey

        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1024)
        port = self.listener.getsockname()[1]
        self.addrs = [
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{MachineKey.generate().peer_id}" for _ in range(count)
        ]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


@contextmanager
def slots_held(store: Path, peer_id: str, count: int) -> Iterator[None]:
    """``count`` requests that each hold one of the socket's client slots for a minute: a
    `resolve` whose peers never answer (the daemon dials each for its handshake timeout).
    They end when the block does (their clients leave: rule 4 cancels them)."""
    silent = SilentPeers(4)
    request = api.Request(
        "resolve",
        {"ref": f"{peer_id}/nothing", "wait_s": 1.0, "dht": False, "peers": silent.addrs},
    ).encode()
    holders = []
    try:
        for _ in range(count):
            holder = socket.socket(socket.AF_UNIX)
            holder.connect(str(api.socket_path(store)))
            holder.sendall(request)
            holders.append(holder)
        yield
    finally:
        for holder in holders:
            holder.close()
        silent.close()


def test_a_daemon_at_its_limit_sends_commands_to_their_own_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Guards against `busy` ending a command: with every client slot of the socket held,
    `blob get` (the light path and the full one) fetched nothing and exited 1 ("the daemon
    serves 64 clients at once"); it now runs on a node of its own, as without a daemon.
    `blob status` has no node of its own: it asks again for 2 s, then says the daemon is
    busy (exit 5), never that no node serves the store."""
    from p2p.daemon.server import MAX_CLIENTS

    blob_id = cluster.put_here("a", random_file(tmp_path / "w.bin", 256 * 1024, seed=21))
    source = cluster.serve("a")
    daemon = cluster.serve("b")
    store, key = cluster.store("b"), cluster.key("b")
    with slots_held(store, daemon.peer_id, MAX_CLIENTS):
        probe = DaemonClient(api.socket_path(store))

        def full() -> bool:
            try:
                probe.request("hello")
            except DaemonRefused as exc:
                return exc.code == "busy"
            return False

        assert wait_until(full, 20)
        got = cluster.get("b", blob_id, "--peer", source.addr)
        assert "via" not in got and got["peers"][source.peer_id]["bytes"] == 256 * 1024, got
        status = run_blob(store, key, "status", check=False)
        assert status.returncode == 5, status.stderr
        assert "busy" in status.stderr and "no node" not in status.stderr
        assert len(status.stderr.strip().splitlines()) == 1, status.stderr
    assert wait_until(lambda: not full(), 20)
    assert json.loads(run_blob(store, key, "status", "--json").stdout)["peer_id"] == daemon.peer_id


def test_fifos_named_in_puts_are_refused_before_any_read(cluster: Cluster, tmp_path: Path) -> None:
    """Guards against 42 puts of FIFOs without a writer (their clients then gone) holding
    every thread the daemon and its blob server shared, so that it answered no status and
    served no peer until each FIFO saw EOF. Each is refused at once (the store's refusal,
    exit 5), and the daemon goes on serving."""
    blob_id = cluster.put_here("b", random_file(tmp_path / "w.bin", 128 * 1024, seed=22))
    daemon = cluster.serve("b")
    fifos = []
    for i in range(42):
        fifo = tmp_path / f"fifo-{i}"
        os.mkfifo(fifo)
        fifos.append(fifo)
    client = DaemonClient(api.socket_path(cluster.store("b")))

    def put(path: Path) -> str:
        try:
            client.request("put", path=str(path))
        except DaemonRefused as exc:
            return f"{exc.code} {exc.exit_code} {exc}"
        return "stored"

    with ThreadPoolExecutor(max_workers=42) as pool:
        futures = [pool.submit(put, fifo) for fifo in fifos]
        done, pending = wait(futures, timeout=20)
        try:
            assert not pending, f"{len(pending)} puts of FIFOs still wait"
        finally:
            for fifo in fifos:  # a writer ends any read still waiting, so the pool can close
                with open(os.open(fifo, os.O_RDWR | os.O_NONBLOCK), "wb"):
                    pass
    for future in done:
        assert future.result().startswith("StoreError 5 "), future.result()
        assert "not a regular file" in future.result()
    assert client.status()["peer_id"] == daemon.peer_id
    got = cluster.get("c", blob_id, "--peer", daemon.addr)
    assert got["peers"][daemon.peer_id]["bytes"] == 128 * 1024


def test_a_put_whose_client_is_interrupted_stores_nothing(cluster: Cluster, tmp_path: Path) -> None:
    """Guards against Ctrl-C of `blob put big.bin --tag t` through the daemon printing
    `Interrupted.` while the daemon went on to store, tag and provide the blob: the
    daemon's put stops reading when its client leaves, and nothing is stored or tagged."""
    big = tmp_path / "big.bin"
    with big.open("wb") as f:  # sparse: reads at memory speed, hashes and copies for real
        f.truncate(2 << 30)
    cluster.serve("b")
    store_root = cluster.store("b")
    tmp = Store.open(store_root).tmp_dir

    def copying() -> bool:
        return any(p.stat().st_size > 0 for p in tmp.iterdir())

    put = subprocess.Popen(
        blob_cmd(store_root, cluster.key("b"), "put", str(big), "--tag", "t"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_until(copying, 60), "the daemon's put never began copying"
        put.send_signal(signal.SIGINT)
        _out, err = put.communicate(timeout=30)
    finally:
        put.kill()
    assert put.returncode == 130 and err.strip().splitlines()[-1] == "Interrupted.", err
    assert wait_until(lambda: not any(tmp.iterdir()), 30), list(tmp.iterdir())
    store = Store.open(store_root)
    assert store.list_blobs() == []
    assert store.tags() == {}


def test_the_tcp_api_reads_only_under_the_directories_the_operator_lists(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Guards against the TCP API's put reading whatever the daemon's user can (its key,
    api.token, /etc/shadow as root) for anyone holding the token, maybe on another
    machine: paths only under `--api-put-dir`, judged after `..` and links resolve."""
    shared = tmp_path / "shared"
    shared.mkdir()
    good = random_file(shared / "ok.bin", 4096, seed=23)
    secret = random_file(tmp_path / "secret.bin", 4096, seed=24)
    (shared / "link.bin").symlink_to(secret)
    cluster.serve("b", "--api-listen", "127.0.0.1:0", "--api-put-dir", str(shared))
    store = cluster.store("b")
    local = connect(store)
    assert local is not None
    host, port = str(local.status()["api_tcp"]).rsplit(":", 1)
    tcp = DaemonClient(
        Endpoint(host=host, port=int(port), token=api.token_path(store).read_text().strip())
    )

    assert tcp.request("put", path=str(good))["size"] == 4096
    for path in (
        secret, shared / "link.bin", shared / ".." / "secret.bin", api.token_path(store),
        cluster.key("b"), Path("/etc/shadow"),
    ):  # fmt: skip
        with pytest.raises(DaemonRefused) as refused:
            tcp.request("put", path=str(path))
        assert (refused.value.code, refused.value.exit_code) == ("forbidden", 5), path
    with pytest.raises(DaemonRefused, match="no symbolic links") as refused:
        tcp.request("put", path=str(shared), follow_symlinks=True)
    # The socket's caller is the daemon's own user: it reads for them as before.
    assert local.request("put", path=str(secret))["size"] == 4096


def test_the_sockets_caller_must_be_the_daemons_user() -> None:
    """p2p.daemon.paths rule 1, decided on the caller's uid as the socket reports it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    with ours, theirs:
        assert peer_uid(ours) == os.geteuid()
    check_caller(1001, 1001)
    check_caller(0, 1001)  # root could open the file itself
    for uid in (1000, None):
        with pytest.raises(api.ApiError) as refused:
            check_caller(uid, 1001)
        assert refused.value.code == "forbidden"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_another_user_on_a_widened_socket_cannot_have_the_daemon_read() -> None:
    """Guards against the socket's mode being the only thing between another user and
    the daemon's rights: with the socket opened to everyone (an operator's chmod), a
    process of user `nobody` asking a root daemon to put a root-only file is refused
    from its peer credentials."""
    root = Path(tempfile.mkdtemp(prefix="blobnet-peer-uid-"))
    cluster = Cluster(root)
    try:
        secret = random_file(root / "secret.bin", 4096, seed=25)
        secret.chmod(0o600)
        cluster.serve("b")
        store = cluster.store("b")
        for path in (root, root / "b", store):
            path.chmod(0o711)
        api.socket_path(store).chmod(0o666)
        # Loaded as root (the interpreter lies under /root), then the process becomes
        # `nobody` before it connects: the socket reports the uid at connect time.
        script = (
            "import os, sys\n"
            "from p2p.daemon.client import DaemonClient, DaemonRefused\n"
            "os.setgroups([])\n"
            "os.setresgid(65534, 65534, 65534)\n"
            "os.setresuid(65534, 65534, 65534)\n"
            "try:\n"
            "    DaemonClient(sys.argv[1]).request('put', path=sys.argv[2])\n"
            "    print('stored')\n"
            "except DaemonRefused as exc:\n"
            "    print(exc.code)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(api.socket_path(store)), str(secret)],
            capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
        )  # fmt: skip
        assert done.stdout.strip() == "forbidden", done.stderr
        assert Store.open(store).list_blobs() == []
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
