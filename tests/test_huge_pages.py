"""runtime/huge_pages.py: the memory a session maps while ``load()`` opens it is backed by 2 MB pages (Linux THP)."""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

from dsedge.runtime import huge_pages

MB = 1 << 20


def test_new_stretches_cut_what_was_mapped_before_and_keep_whole_huge_pages_only() -> None:
    before = [(2 * MB, 6 * MB)]
    after = [(2 * MB, 10 * MB),  # the heap grew by 4 MB: only the growth is new
             (16 * MB + 0x3000, 23 * MB + 0x1000),  # unaligned: the whole 2 MB pages inside it
             (30 * MB, 31 * MB)]  # under one huge page: nothing
    assert huge_pages.new_stretches(before, after) == [(6 * MB, 10 * MB), (18 * MB, 22 * MB)]
    assert huge_pages.new_stretches(after, after) == []  # nothing new


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb(lo: int, hi: int) -> int:
    # AnonHugePages of the mapping that holds [lo, hi), from /proc/self/smaps
    kb, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a <= lo and hi <= b
        elif inside and line.startswith("AnonHugePages:"):
            kb = int(line.split()[1])
    return kb


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except (AttributeError, ValueError):
        return False
    return got >= (major, minor)


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in ("never", "none")
                    or not _kernel_at_least(6, 1),
                    reason="needs Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not disabled")
def test_advise_collapses_memory_mapped_since_the_snapshot_into_huge_pages() -> None:
    import ctypes

    before = huge_pages.anonymous_ranges()
    # private and anonymous, as malloc maps a session's large blocks; populated, as weights are
    buf = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\x01" * (16 * MB))
    anchor = ctypes.c_char.from_buffer(buf)
    lo = ctypes.addressof(anchor)
    del anchor
    try:
        if _thp_mode() == "madvise":
            assert _anon_huge_kb(lo, lo + 16 * MB) == 0  # nothing asked, nothing given
        done = huge_pages.advise(before)
        assert done >= 14 * MB  # the 2 MB pages wholly inside the 16 MB mapping, at least
        assert _anon_huge_kb(lo, lo + 16 * MB) >= 14 * 1024
        assert buf[:4] == b"\x01" * 4 and buf[16 * MB - 4:] == b"\x01" * 4  # the contents are kept
        assert huge_pages.advise(huge_pages.anonymous_ranges()) == 0  # nothing new since: nothing done
    finally:
        buf.close()


def test_load_advises_what_opening_the_bundle_mapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import numpy as np

    import dsedge
    from streaming_models import text_bundle, text_request

    bundle = text_bundle(tmp_path)
    seen = []
    monkeypatch.setattr(huge_pages, "anonymous_ranges", lambda: [(1, 2)])  # the snapshot, taken before opening
    monkeypatch.setattr(huge_pages, "advise", lambda before: seen.append(before) or 0)
    with dsedge.load(bundle) as s:  # ONNX Runtime's CPU provider: the run() backend and the 2 instances' session
        assert seen == [[(1, 2)]]  # once, after every session load() opens, against the snapshot before them
        out = s.run(text_request(np.random.default_rng(0), 8))
        assert out["sentence_embedding"].shape == (1, 64)
