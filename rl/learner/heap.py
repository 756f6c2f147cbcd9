"""A CPU learner's heap: keep the memory a step frees for the next step's tensors.

glibc serves every block of 128 KiB or more (past its adaptive threshold: 32 MiB) with its own
mmap and unmaps it when freed, so each step maps, faults in and zeroes its activations and gradients
again (a SmolLM2 learner step on two cores: 5-10%, benchmarks/RESULTS.md). With mmap off
and the heap's top never trimmed, freed blocks stay mapped and the next step reuses them. The cost:
the process keeps its peak memory, which a learner reaches again every step anyway."""
from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # an int: the largest threshold mallopt takes


def keep_freed_memory() -> bool:
    """Turn glibc's mmap'd blocks and heap trimming off for this process. Returns False (and changes
    nothing) where the C library has no mallopt (not glibc)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
