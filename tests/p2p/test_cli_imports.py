"""The light commands stay light: ``blob --help`` and ``blob put`` import neither torch,
libp2p nor numpy (seconds, or a third of one, each on a loaded machine). They are imported
lazily, by the commands that run a node or train; a module-level import of any of them on
these paths fails here. And ``blob get`` on a store a daemon serves loads not even click,
trio or the store (p2p.cli.light): an interpreter's start and a socket's round trip."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

HEAVY = ("torch", "libp2p", "numpy")


def imported_top_level(argv: list[str], cwd: Path) -> set[str]:
    """Top-level packages a ``blob`` run imported, read from ``python -X importtime``."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "p2p.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            module = line.rsplit("|", 1)[1].strip()
            names.add(module.split(".")[0])
    assert "p2p" in names, "importtime printed nothing: the check would pass vacuously"
    return names


@pytest.mark.parametrize("command", ["--help", "put"])
def test_light_commands_import_neither_torch_nor_libp2p(tmp_path: Path, command: str) -> None:
    argv = ["--store", str(tmp_path / "store"), "--help"]
    if command == "put":
        (tmp_path / "weights.bin").write_bytes(b"x" * 4096)
        argv = ["--store", str(tmp_path / "store"), "put", str(tmp_path / "weights.bin")]
    heavy = imported_top_level(argv, tmp_path) & set(HEAVY)
    assert not heavy, f"blob {command} imported {sorted(heavy)}"


# What the light path must not load: each costs tens of milliseconds or more.
NOT_ON_THE_LIGHT_PATH = ("torch", "libp2p", "click", "trio", "blobstore", "multiaddr", "identity")


def _fake_daemon(path: Path, result: dict[str, object], seen: list[dict[str, object]]) -> None:
    """Answer one request on the Unix socket at ``path`` with ``result``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(60)

    def answer() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                request = b""
                while not request.endswith(b"\n"):
                    request += conn.recv(65536)
                seen.append(json.loads(request))
                conn.sendall(json.dumps({"event": "result", **result}).encode() + b"\n")

    threading.Thread(target=answer, daemon=True).start()


def test_get_through_a_daemon_loads_only_the_thin_client(tmp_path: Path) -> None:
    """With a daemon on the store, ``blob get ID`` sends one fetch and prints its result
    ("via": "daemon") having imported none of click, trio, the store package or libp2p."""
    store = tmp_path / "store"
    store.mkdir()
    blob_id = "ab" * 32
    seen: list[dict[str, object]] = []
    result = {"id": blob_id, "source": "network", "via": "daemon", "store_path": "/x"}
    _fake_daemon(store / "api.sock", result, seen)
    argv = ["--store", str(store), "get", blob_id, "--peer", "/ip4/127.0.0.1/tcp/1/p2p/Qm"]
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "p2p.cli", *argv, "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["via"] == "daemon"
    assert seen and seen[0]["op"] == "fetch" and seen[0]["ref"] == blob_id, seen
    names = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "p2p" in names, "importtime printed nothing: the check would pass vacuously"
    heavy = names & set(NOT_ON_THE_LIGHT_PATH)
    assert not heavy, f"blob get through the daemon imported {sorted(heavy)}"
