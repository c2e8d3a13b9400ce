"""Host tensors on 2 MB pages, where Linux lends them (transparent huge pages).

A decode step reads every sequence's KV blocks, scattered over a pool of hundreds of MB: with
4 KB pages each 2 KB block costs a TLB miss and a page walk, and the kernel's prefetches of the
next blocks wait on them (bench/README.md, "Huge pages and layer ops"). Linux backs a range with 2 MB pages
when it is marked MADV_HUGEPAGE before its first touch (or always, where THP is set to
"always"); where it isn't lent, or the platform has no madvise, or FAIRWAY_HUGE_PAGES=0, the
tensor is the same one on small pages. Where the host lends them only slowly (it compacts its
memory for each), the rest of a range goes on small pages too (zero_in_place).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys
import time
from functools import cache

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
MADV_NOHUGEPAGE = 15
# A first touch that finds a free 2 MB page costs ~0.2 ms; one that must compact memory to make one
# (THP's defrag on marked ranges, on a host whose memory is fragmented: a machine that has read
# gigabytes of files) ~10 ms, seconds for a KV cache, at every process start. Past this a page, the
# rest of a range goes on small pages: a few percent of a decode step is not worth that wait.
SLOW_PAGE_S = 0.002
PROBE_PAGES = 16  # touched at a time, and timed


def _madvise() -> ctypes._CFuncPtr | None:
    return _libc_madvise() if os.environ.get("FAIRWAY_HUGE_PAGES", "1") != "0" else None


@cache
def _libc_madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor, advice: int = MADV_HUGEPAGE) -> int:
    """Marks the whole 2 MB pages inside t's memory for huge pages (or, with MADV_NOHUGEPAGE, for
    small ones); returns the bytes marked (0 where nothing could be). Pages touched before this
    call keep the pages they have."""
    fn = _madvise()
    nbytes = t.nbytes
    if fn is None or t.device.type != "cpu" or not t.is_contiguous() or nbytes < HUGE_PAGE:
        return 0
    start = t.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= first:
        return 0
    if fn(first, end - first, advice) != 0:
        log.debug("madvise(%d) refused (errno %d): small pages", advice, ctypes.get_errno())
        return 0
    return end - first


def zero_in_place(t: torch.Tensor) -> int:
    """Zeroes t (contiguous, marked for huge pages and not touched yet) PROBE_PAGES huge pages at a
    time, so its memory is held from the start; once those come slower than SLOW_PAGE_S a page,
    the rest is unmarked first and goes on small pages. Returns the bytes touched while marked."""
    flat = t.view(-1).view(torch.uint8)
    step = PROBE_PAGES * HUGE_PAGE
    for start in range(0, flat.numel(), step):
        chunk = flat[start:start + step]
        began = time.perf_counter()
        chunk.zero_()
        if time.perf_counter() - began > -(-chunk.numel() // HUGE_PAGE) * SLOW_PAGE_S:
            rest = flat[start + step:]
            if rest.numel():
                advise_huge_pages(rest, MADV_NOHUGEPAGE)
                rest.zero_()
                log.info("huge pages came slowly (the host compacts memory for them): %d MB of %d on small "
                         "pages", rest.numel() >> 20, flat.numel() >> 20)
            return start + chunk.numel()
    return flat.numel()


def fresh(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory, starting on a 2 MB boundary and not touched yet: a mapping of its
    own (a heap allocation could reuse pages already touched on small pages)."""
    if _madvise() is None or nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # a mapping refused (limits): torch's allocator may still find the memory
        log.debug("no mapping of %d bytes (%s): small pages", nbytes, exc)
        return torch.zeros(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, on huge pages where the device is the CPU and Linux lends them."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = fresh(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
    if advise_huge_pages(t):
        zero_in_place(t)  # every page now: the cache's memory is held from the start
        return t
    return t.zero_()


def gather(model: torch.nn.Module) -> int:
    """Moves every CPU parameter and buffer of model into one allocation, on huge pages where
    marked: a decode step streams all of them, and on small pages each 4 KB of weights is a TLB
    miss. Tensors that shared memory still do; each old copy is freed as soon as it is moved.
    Call before anything holds their pointers (the native decode pass does). Returns the bytes on
    huge pages (0: nothing moved)."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # a storage's address -> who holds it
    places: dict[int, tuple[int, int]] = {}  # a storage's address -> (its offset in the allocation, bytes)
    total = 0
    for mod in model.modules():
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is not None and t.device.type == "cpu" and t.layout == torch.strided:  # not oneDNN's opaque ones
                storage = t.untyped_storage()
                if storage.data_ptr() not in places:
                    places[storage.data_ptr()] = (total, storage.nbytes())
                    total += -(-storage.nbytes() // 64) * 64  # 64-byte aligned, as torch's allocator gives
                holders.setdefault(storage.data_ptr(), []).append((mod, name))
    if total < HUGE_PAGE or _madvise() is None:
        return 0
    whole = fresh(total)
    marked = zero_in_place(whole) if advise_huge_pages(whole) else 0  # (touched before the copies: timed)
    for address, held_by in holders.items():
        offset, nbytes = places[address]
        first = _held(*held_by[0])
        whole[offset:offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage()))
        moved: dict[int, torch.Tensor] = {}  # by the old tensor's id: a tensor held twice stays one
        for mod, name in held_by:
            t = _held(mod, name)
            if id(t) not in moved:
                at = (whole.storage_offset() + offset) // t.element_size() + t.storage_offset()
                moved[id(t)] = torch.empty(0, dtype=t.dtype).set_(whole.untyped_storage(), at, t.size(), t.stride())
            if name in mod._parameters:
                mod._parameters[name].data = moved[id(t)]
            else:
                mod._buffers[name] = moved[id(t)]
    return marked


def _held(mod: torch.nn.Module, name: str) -> torch.Tensor:
    return mod._parameters[name] if name in mod._parameters else mod._buffers[name]
