"""The names cache cannot be filled for good (p2p.names.cache rules 3 and 5).

4,095 valid, never-expiring records from 17 free keys, pushed by free identities, filled
the 4,096-name cache; every other publisher's new name was then refused as "full", also
after a restart. Here the cache is scaled down (64 names, 16 per publisher) and the flood
is 4 free keys filling it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from identity import MachineKey, SoftwareSigner
from p2p.names.cache import MAX_HOLD_S, NameCache
from p2p.names.record import NameRecord, sign_record

NOW = 1_800_000_000
BLOB = "a" * 64


def record(signer: SoftwareSigner, name: str, *, time: int = NOW) -> NameRecord:
    return sign_record(signer, name=name, blob_id=BLOB, seq=1, time=time)


def small_cache(root: Path) -> NameCache:
    (root / "tmp").mkdir(exist_ok=True)
    (root / "locks").mkdir(exist_ok=True)
    return NameCache.for_store_root(root, root / "tmp", max_records=64, max_per_publisher=16)


@pytest.fixture
def flooders() -> list[SoftwareSigner]:
    return [SoftwareSigner(MachineKey.generate()) for _ in range(4)]


def flood(cache: NameCache, flooders: list[SoftwareSigner], rounds: int = 1) -> None:
    for r in range(rounds):
        for n, signer in enumerate(flooders):
            for i in range(16):
                cache.offer(record(signer, f"flood-{r}-{n}-{i}"), now=NOW)
                if cache.directory is not None:
                    cache.persist(record(signer, f"flood-{r}-{n}-{i}").key, now=NOW)


def test_a_full_cache_still_takes_a_new_publishers_name(
    tmp_path: Path, flooders: list[SoftwareSigner]
) -> None:
    cache = small_cache(tmp_path)
    flood(cache, flooders)
    assert len(cache) == 64
    legit = SoftwareSigner(MachineKey.generate())
    taken = cache.offer(record(legit, "run-7/adapter"), now=NOW)
    assert taken.accepted, taken.reason
    asked_by = SoftwareSigner(MachineKey.generate())
    asked = record(asked_by, "run-8/adapter")
    assert cache.offer(asked, now=NOW, asked=True).accepted
    cache.persist(record(legit, "run-7/adapter").key, now=NOW)
    cache.persist(asked.key, now=NOW)
    # The flood goes on with fresh names: it churns its own records only.
    flood(cache, flooders, rounds=3)
    assert cache.get(record(legit, "run-7/adapter").key) is not None
    assert cache.get(asked.key) is not None
    # A restart loads what survived, and a newcomer still gets in.
    reopened = small_cache(tmp_path)
    reopened.load(now=NOW)
    assert len(reopened) <= 64
    assert reopened.get(asked.key) is not None
    late = SoftwareSigner(MachineKey.generate())
    assert reopened.offer(record(late, "run-9/adapter"), now=NOW).accepted


def test_a_record_that_never_expires_is_held_a_week(tmp_path: Path) -> None:
    cache = small_cache(tmp_path)
    other = SoftwareSigner(MachineKey.generate())
    old = record(other, "stale", time=NOW - MAX_HOLD_S - 1)
    refused = cache.offer(old, now=NOW)
    assert not refused.accepted and refused.reason == "expired"
    fresh = record(other, "fresh", time=NOW)
    assert cache.offer(fresh, now=NOW).accepted
    mine = SoftwareSigner(MachineKey.generate())
    assert cache.offer(record(mine, "mine", time=NOW - MAX_HOLD_S - 1), now=NOW, own=True).accepted


def test_a_name_asked_for_keeps_its_rank_after_a_restart(tmp_path: Path) -> None:
    """A name this node resolved outranks pushed records, but the rank lived in memory
    only: after a restart its records loaded as pushed ones, their publisher was the one
    holding the most, and a flood of small free publishers evicted them first."""
    cache = small_cache(tmp_path)
    resolved_by = SoftwareSigner(MachineKey.generate())
    resolved = [record(resolved_by, f"run-{i}/adapter") for i in range(16)]
    for rec in resolved:
        assert cache.offer(rec, now=NOW, asked=True).accepted
        cache.persist(rec.key, now=NOW)
    reopened = small_cache(tmp_path)
    reopened.load(now=NOW)
    small_flooders = [SoftwareSigner(MachineKey.generate()) for _ in range(12)]
    for n, signer in enumerate(small_flooders):
        for i in range(8):
            pushed = record(signer, f"flood-{n}-{i}")
            if reopened.offer(pushed, now=NOW).changed:
                reopened.persist(pushed.key, now=NOW)
    assert len(reopened) == 64
    assert all(reopened.get(rec.key) is not None for rec in resolved)
    again = small_cache(tmp_path)
    again.load(now=NOW)
    assert all(again.get(rec.key) is not None for rec in resolved)


def test_a_held_name_asked_for_later_is_saved_as_asked(tmp_path: Path) -> None:
    cache = small_cache(tmp_path)
    pushed = record(SoftwareSigner(MachineKey.generate()), "run-1/adapter")
    cache.offer(pushed, now=NOW)
    cache.persist(pushed.key, now=NOW)
    assert not cache.offer(pushed, now=NOW, asked=True).changed
    cache.persist_asked(pushed.key)
    assert (tmp_path / "names" / "asked" / pushed.key.hex()).is_file()
    reopened = small_cache(tmp_path)
    reopened.load(now=NOW)
    assert reopened.get(pushed.key) == pushed
