"""Shared test settings: torch (where imported) is pinned to one thread by the Makefile's
environment; nothing here mocks the network or the disk."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, transformers, py-libp2p: millions of
    objects) out of the garbage collector's reach: tests/p2p collects after every test,
    and each full pass over that heap took ~0.4 s, a quarter of the suite's time. What a
    test creates is still collected."""
    gc.collect()
    gc.freeze()
