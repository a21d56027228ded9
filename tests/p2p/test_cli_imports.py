"""The light commands stay light: ``blob --help`` and ``blob put`` import neither torch nor
libp2p (seconds each on a loaded machine). Both are imported lazily, by the commands that
run a node or train; a module-level import of either anywhere on these paths fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "libp2p")


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
