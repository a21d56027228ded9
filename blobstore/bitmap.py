"""Chunk bitmaps: bit i set means chunk i is held and verified.

Layout (shared with the wire protocol's ``have`` reply): LSB-first within each byte, so
chunk i is bit ``i % 8`` of byte ``i // 8``; ``ceil(n / 8)`` bytes; bits past ``n`` are 0.
"""

from __future__ import annotations


def bitmap_len(num_chunks: int) -> int:
    return (num_chunks + 7) // 8


def empty_bitmap(num_chunks: int) -> bytearray:
    return bytearray(bitmap_len(num_chunks))


def full_bitmap(num_chunks: int) -> bytes:
    bits = bytearray(b"\xff" * bitmap_len(num_chunks))
    if num_chunks % 8:
        bits[-1] = (1 << (num_chunks % 8)) - 1
    return bytes(bits)


def get_bit(bits: bytes | bytearray, index: int) -> bool:
    return bool(bits[index >> 3] >> (index & 7) & 1)


def set_bit(bits: bytearray, index: int) -> None:
    bits[index >> 3] |= 1 << (index & 7)


def count_bits(bits: bytes | bytearray) -> int:
    return int.from_bytes(bits, "little").bit_count()


def set_indices(bits: bytes | bytearray, num_chunks: int) -> list[int]:
    return [i for i in range(num_chunks) if get_bit(bits, i)]


def is_well_formed(bits: bytes | bytearray, num_chunks: int) -> bool:
    """Right length and no bits set past the last chunk."""
    if len(bits) != bitmap_len(num_chunks):
        return False
    return not (num_chunks % 8 and bits and bits[-1] >> (num_chunks % 8))
