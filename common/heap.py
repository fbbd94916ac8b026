"""Giving freed heap memory back to the OS (glibc ``malloc_trim``), once and in the background.

Workers keep MiB-sized buffers on the glibc heap on purpose (``grpc_transport.tune_malloc`` raises the mmap
and trim thresholds, so KV chunks are not mmapped and unmapped one by one), which also means glibc keeps
what a large request freed: a 60 MB message, its copies and the tensors built from it stay in the process
after the request is gone, and grow with each further one. ``release_memory`` hands every arena's free pages
back now, but for the free top of each thread's arena, which glibc gives back only on a free that reaches it
and only above the trim threshold (the workers set theirs to 4 MiB: at 32 MiB those tops were what a worker
kept after a burst, up to 94 MiB); ``HeapTrimmer`` (one per worker process) does it in the background, off the event loop, whenever
the heap's free bytes (``mallinfo2``, all arenas) or the process's resident memory grew by ``min_free_bytes``
since the last trim, after a garbage collection where the bytes held grew as much. Elsewhere than glibc both
do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 1.0
TRIM_MIN_FREE_BYTES = 32 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
    ] + [("fordblks", ctypes.c_size_t), ("keepcost", ctypes.c_size_t)]


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None, False
    try:
        libc.mallinfo2.restype = _Mallinfo2
        has_info = True
    except AttributeError:  # glibc < 2.33
        has_info = False
    return libc, has_info


_libc, _has_mallinfo2 = _load_libc()


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """The process's resident memory (``/proc/self/statm``); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _sample() -> tuple[int, int, int] | None:
    """``(held, free, resident)``: ``heap_bytes`` and ``resident_bytes``; None where the heap cannot be read."""
    heap = heap_bytes()
    return None if heap is None else (*heap, resident_bytes())


def release_memory() -> None:
    """Hand every arena's free heap pages back to the OS now (glibc ``malloc_trim(0)``)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def heap_bytes() -> tuple[int, int] | None:
    """``(held, free)``: bytes the allocator holds for the program (heap and mmapped chunks, all arenas) and
    bytes free inside the heap (``mallinfo2``); None where they cannot be read."""
    if not _has_mallinfo2:
        return None
    m = _libc.mallinfo2()
    return int(m.uordblks + m.hblkhd), int(m.fordblks)


class HeapTrimmer:
    """Every ``interval_s``, in a worker thread: once the bytes the allocator holds, the heap's free bytes or
    the resident memory grew by ``min_free_bytes`` over what the last trim left, and then held still for a
    check (a burst of large requests is over), or after ``max_wait_checks`` checks regardless: collect
    garbage, then trim.

    Resident memory counts because the heap's free bytes do not tell trimmed pages from used ones: a trim
    hands free pages back but they stay free in ``mallinfo2``; a later burst that reuses and frees them makes
    them resident again with no growth in either heap figure (a worker kept 90 MB after ten refused 48 MB
    KV streams when a trim had run mid-burst).

    The collection matters: a refused request's message (tens of MB) can sit in a reference cycle (its
    exception's traceback) until the next full collection, which a worker allocating few Python objects may
    not run for a long time; the trim gives back the free pages. Waiting for the values to settle keeps
    the collections (tens of ms each) out of a busy stretch and catches the last request's garbage too."""

    def __init__(
        self,
        interval_s: float = TRIM_INTERVAL_S,
        min_free_bytes: int = TRIM_MIN_FREE_BYTES,
        max_wait_checks: int = 10,
        sample: Callable[[], tuple[int, int, int] | None] = _sample,
    ) -> None:
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.max_wait_checks = max_wait_checks
        self.trims = 0
        self._sample = sample
        self._base: tuple[int, int, int] | None = None  # (held, free, resident) right after the last trim
        self._prev: tuple[int, int, int] | None = None  # at the previous check
        self._waited = 0  # checks since growth was first seen (0: none seen)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None and self._sample() is not None:
            self._base = self._prev = self._sample()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vlkv-heap-trimmer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def check(self) -> bool:
        """One check (synchronous; the background task runs it off the event loop). True if it trimmed."""
        now = self._sample()
        if self._base is None:
            self._base = self._prev = now
        grew = any(n - b >= self.min_free_bytes for n, b in zip(now, self._base, strict=True))
        settled = all(abs(n - p) < self.min_free_bytes // 4 for n, p in zip(now, self._prev, strict=True))
        self._prev = now
        if not grew:
            self._waited = 0
            return False
        self._waited += 1
        if not settled and self._waited < self.max_wait_checks:
            return False
        gc.collect()
        release_memory()
        self.trims += 1
        self._base = self._prev = self._sample()
        self._waited = 0
        mib = 1 << 20
        log.info(
            "heap trimmed: held %d -> %d MiB, free %d -> %d MiB, resident %d -> %d MiB",
            *(x // mib for pair in zip(now, self._base, strict=True) for x in pair),
        )
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await loop.run_in_executor(None, self.check)
            except Exception:  # noqa: BLE001 - memory bookkeeping must never take the worker down
                log.exception("heap trim failed")
