"""Giving freed heap memory back to the OS (glibc ``malloc_trim``), once and in the background.

Workers keep MiB-sized buffers on the glibc heap on purpose (``grpc_transport.tune_malloc`` raises the mmap
and trim thresholds, so KV chunks are not mmapped and unmapped one by one), which also means glibc keeps
what a large request freed: a 60 MB message, its copies and the tensors built from it stay in the process
after the request is gone, and grow with each further one. ``release_memory`` hands every arena's free pages
back now; ``HeapTrimmer`` (one per worker process) does it in the background whenever the heap's free bytes
(``mallinfo2``, all arenas) grew by ``min_free_bytes`` since the last trim, off the event loop. Elsewhere than
glibc both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

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


def release_memory() -> None:
    """Hand every arena's free heap pages back to the OS now (glibc ``malloc_trim(0)``)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def free_heap_bytes() -> int | None:
    """Bytes free inside the heap, all arenas (``mallinfo2().fordblks``); None where it cannot be read."""
    if not _has_mallinfo2:
        return None
    return int(_libc.mallinfo2().fordblks)


class HeapTrimmer:
    """Trims the heap in the background once ``min_free_bytes`` more than after the last trim are free."""

    def __init__(
        self, interval_s: float = TRIM_INTERVAL_S, min_free_bytes: int = TRIM_MIN_FREE_BYTES
    ) -> None:
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.trims = 0
        self._baseline = 0  # free bytes right after the last trim (what trimming cannot give back)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None and free_heap_bytes() is not None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vlkv-heap-trimmer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if free_heap_bytes() - self._baseline >= self.min_free_bytes:
                    await loop.run_in_executor(None, release_memory)
                    self._baseline = free_heap_bytes()
                    self.trims += 1
            except Exception:  # noqa: BLE001 - memory bookkeeping must never take the worker down
                log.exception("heap trim failed")
