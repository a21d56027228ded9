"""The WAN testbed lives in bench/wan/ (not an installed package): make the repository
root importable, and give tests that need root and /dev/net/tun a fixture that skips
them, saying why, where those are missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def wan_capable() -> None:
    from bench.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def nat_capable(wan_capable: None) -> None:
    import shutil

    if shutil.which("nft") is None:
        pytest.skip("NAT hosts need the `nft` command (Debian package nftables)")


WAN_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One testbed at a time where this directory runs under pytest-xdist with the rest
    (``make test`` runs it alone, after the rest): every test here goes to one worker
    (``--dist loadgroup``), so two testbeds never shape links side by side."""
    for item in items:
        if WAN_DIR in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("wan"))
