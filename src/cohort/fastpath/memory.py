"""Process-level memory settings: keep freed tensor memory from staying in the process.

glibc's malloc serves a block from mmap when it is larger than its mmap threshold, and returns it to
the system on free. By default that threshold is dynamic: each freed mmapped block raises it to that
block's size (up to 32 MiB). After the first large tensor is freed, every tensor up to that size is
carved from the heap instead, and a fragmented heap is seldom given back, so resident memory climbs to
several times what is live: a forward + backward over a 152k-token vocabulary held 1.9 GB resident
for 0.5 GB of live tensors. Fixing the threshold (any explicit setting turns the dynamic rule off)
keeps large tensors on mmap. Blocks between 1 and 16 MiB stay on the heap, because mmapping them costs
a page fault per 4 KiB on every allocation (a 1 MiB threshold doubled a 14 M model's step time).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h
_applied: int | None = None


def bound_heap(mmap_threshold_mib: int = 16) -> bool:
    """Returns whether glibc's mmap threshold is now fixed at `mmap_threshold_mib` MiB (False: not glibc, or 0)."""
    global _applied
    if mmap_threshold_mib <= 0 or not sys.platform.startswith("linux"):
        return False
    if _applied == mmap_threshold_mib:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_mib) << 20) == 1
    if ok:
        _applied = mmap_threshold_mib
    return ok


def heap_bound_unavailable(mmap_threshold_mib: int = 16) -> str | None:
    """Returns None after fixing the mmap threshold (bound_heap), or why it could not be fixed here."""
    if bound_heap(mmap_threshold_mib):
        return None
    return f"malloc's mmap threshold can only be fixed on Linux with glibc (this is {sys.platform})"
