"""Back the memory ONNX Runtime allocated for a session's weights with 2 MB pages (Linux transparent huge pages).

A 1-thread MiniLM INT8 run streams about 22 MB of prepacked weights: some 5,500 pages of 4 KB, far more than the
TLB holds, and in a VM every TLB miss is a two-level page walk. Where transparent huge pages are in ``madvise``
mode (Ubuntu's default and this development host's: ``/sys/kernel/mm/transparent_hugepage/enabled``), nothing ONNX
Runtime allocates gets them. ``load()`` notes the process's anonymous memory before it opens a bundle's sessions
(``anonymous_ranges``) and afterwards collapses what is new into huge pages (``advise``: ``madvise(MADV_COLLAPSE)``,
Linux 6.1+, on each 2 MB-aligned stretch of at least one huge page). The same idea as NumPy's huge-page advice for
arrays of 4 MB or more, PyTorch's ``THP_MEM_ALLOC_ENABLE`` and llama.cpp's advice on its mapped weights (madvise(2);
the kernel's ``admin-guide/mm/transhuge``).

Only the collapse, not ``MADV_HUGEPAGE`` first: the advice marks the ranges, so later page faults there (malloc
reusing freed blocks while serving) may compact memory directly (``defrag`` is ``madvise`` here too); with it,
collapsing took 145-230 ms of a MiniLM ``load()`` against 7-25 ms without. Memory that a session reuses from one
closed earlier is not new here; it keeps what it was given then. Measured (2-core Xeon VM, MiniLM int8 cpu bundle,
2026-12-06): two threads running batch 1 back to back on the instances' shared session served 463-480 rows/s on huge
pages against 430-467 on 4 KB pages (five interleaved pairs: three with every large mapping advised and collapsed,
two with the collapse alone); serving figures are in docs/streaming.md (Instances).

Best effort and silent: off Linux, on an older kernel, or where a stretch cannot be collapsed (in full or in part:
``EINVAL``), memory stays as it was. It never changes what a run computes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

HUGE = 2 << 20  # bytes in an x86-64 / arm64 (4 KB granule) transparent huge page
MADV_COLLAPSE = 25  # linux/mman.h (asm-generic), Linux 6.1+
_MAPS = Path("/proc/self/maps")


def anonymous_ranges() -> list[tuple[int, int]]:
    """``[(start, end)]`` byte addresses of this process's readable and writable anonymous mappings (the heap and
    unnamed ``mmap``s, where malloc puts large blocks); [] off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) < 5 or not parts[1].startswith("rw"):
            continue
        name = parts[5] if len(parts) > 5 else ""
        if name in ("", "[heap]"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def new_stretches(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MB-aligned ``(start, end)`` stretches of ``after`` not in ``before``, each at least one huge page."""
    out = []
    for lo, hi in after:
        pieces = [(lo, hi)]
        for blo, bhi in before:  # cut away what was mapped already
            pieces = [p for a, b in pieces for p in ((a, min(b, blo)), (max(a, bhi), b)) if p[1] > p[0]]
        for a, b in pieces:
            a2, b2 = -(-a // HUGE) * HUGE, b // HUGE * HUGE
            if b2 > a2:
                out.append((a2, b2))
    return out


def advise(before: list[tuple[int, int]]) -> int:
    """Collapse into huge pages the anonymous memory mapped since ``before`` (``anonymous_ranges()`` then); returns
    the bytes of the stretches collapsed in full (a stretch refused in part may still have been partly collapsed)."""
    stretches = new_stretches(before, anonymous_ranges())
    if not stretches:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    done = 0
    for a, b in stretches:
        if madvise(a, b - a, MADV_COLLAPSE) == 0:
            done += b - a
    return done
