"""Leases (blobstore.lease.Leases), built without a Store."""

from __future__ import annotations

import pytest

from tests.blobstore.conftest import Parts

ID_A = "a" * 64
ID_B = "b" * 64


def test_a_lease_names_its_ids_while_it_is_held(parts: Parts) -> None:
    with parts.leases.take([ID_A]) as lease:
        lease.add([ID_B])
        with parts.lock.hold():
            assert parts.leases.live_ids() == {ID_A, ID_B}
        assert lease.ids == {ID_A, ID_B}
    with parts.lock.hold():
        assert parts.leases.live_ids() == set()
    with pytest.raises(ValueError, match="released"):
        lease.add(["c" * 64])
