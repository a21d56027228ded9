"""Keeping a worker's resident memory flat over a long run.

A worker allocates and frees arrays the size of the model every round (decoded updates,
the aggregate, state blobs read and written, a replay's model), from several threads.
glibc's malloc raises its mmap threshold each time such a block is freed, up to 32 MiB,
so later model-sized arrays come from the heap arenas (one per thread, up to 8 per core),
where freed space is kept rather than returned: a worker's peak RSS crept round after
round. :func:`limit_heap_growth` pins the threshold at 128 KiB (large arrays are always
mapped, and unmapped when freed) and caps the arenas. It is a no-op off glibc. A worker
process applies it as it starts (``training.outer.launch.run_worker``), and so does a
user's process when its ``OuterLoop`` joins. Measured with ``bench/outer_memory.py`` (small
model, 3.7M parameters, 3 workers, 15 rounds): peak RSS 1533-1758 MiB without it, 949-972
MiB with the same settings given as environment variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's own default before it starts raising the threshold: blocks above it are mapped.
MMAP_THRESHOLD = 128 * 1024
# Two arenas: the event loop's thread and one for the worker threads' allocations.
ARENA_MAX = 2


def limit_heap_growth() -> bool:
    """Apply the settings above to this process; False where malloc is not glibc's."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return bool(mallopt(_M_ARENA_MAX, ARENA_MAX) == 1 and ok)
