"""Fixtures for the fast data path tests. The helper modules beside this file (the p2pd
control client, the p2pd fetcher, host helpers) are made importable by name."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fetch_p2pd import DEFAULT_DEST, is_installed  # noqa: E402


@pytest.fixture
def p2pd_binary() -> Path:
    """go-libp2p's daemon, or a skip that says how to get it (never a silent pass).
    With BLOBNET_REQUIRE_P2PD=1 in the environment a missing daemon fails instead."""
    if not is_installed(DEFAULT_DEST):
        reason = (
            f"go interop not tested: p2pd is missing at {DEFAULT_DEST}; run "
            "`python tests/fast/fetch_p2pd.py` (downloads the hivemind 1.1.12 wheel from PyPI)"
        )
        if os.environ.get("BLOBNET_REQUIRE_P2PD") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return DEFAULT_DEST


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 108 bytes, so not under pytest's tmp_path."""
    with tempfile.TemporaryDirectory(prefix="p2pd-", dir="/tmp") as d:
        yield Path(d)
