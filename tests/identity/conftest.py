"""Fixtures of the identity tests: an authority, an admitted machine, a fixed clock."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from identity import (
    AdmissionCertificate,
    Authority,
    MachineKey,
    SoftwareSigner,
    TrustStore,
)

NOW = 1_800_000_000  # a fixed "now": time is an argument, never read by the code under test
DAY = 86_400
KERNEL_CLASS = "cuda-sm90-bf16"


@dataclass
class World:
    authority_key: MachineKey
    authority: Authority
    machine: MachineKey
    signer: SoftwareSigner
    cert: AdmissionCertificate
    trust: TrustStore


@pytest.fixture
def world() -> World:
    authority_key = MachineKey.generate()
    authority = Authority(SoftwareSigner(authority_key))
    machine = MachineKey.generate()
    cert = authority.admit(
        machine.peer_id,
        operator="alice",
        kernel_class=KERNEL_CLASS,
        not_before=NOW - DAY,
        not_after=NOW + 30 * DAY,
        serial=42,
    )
    trust = TrustStore(frozenset({authority_key.public_key_bytes}))
    return World(authority_key, authority, machine, SoftwareSigner(machine), cert, trust)


def pack_custom(
    fields: dict[str, object],
    *,
    wide: frozenset[str] = frozenset(),
    str8: frozenset[str] = frozenset(),
) -> bytes:
    """msgpack of ``fields`` in order, spelling the ``wide`` ints as uint64 and the ``str8``
    strings with a str8 header: valid msgpack, but not the canonical encoding."""
    assert len(fields) < 16
    out = bytearray([0x80 | len(fields)])
    for key, value in fields.items():
        out += msgpack.packb(key)
        if key in wide:
            assert isinstance(value, int)
            out += b"\xcf" + struct.pack(">Q", value)
        elif key in str8:
            assert isinstance(value, str)
            raw = value.encode()
            out += bytes([0xD9, len(raw)]) + raw
        else:
            out += msgpack.packb(value, use_bin_type=True)
    return bytes(out)


@pytest.fixture
def repack() -> Any:
    """:func:`pack_custom`, for test modules (which cannot import this conftest)."""
    return pack_custom
