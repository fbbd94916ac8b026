"""What the tools' worker pools share (``vlkv eval --zoo --jobs``: ``eval/zoo_jobs.py``; ``vlkv calibrate
--jobs``: ``calibrate_jobs.py``): how many workers ``--jobs`` means, and one torch thread per worker.

Their matmuls are small, so a second torch thread in one process gains little; two processes on two cores
run two pieces of work at once.
"""

from __future__ import annotations

import contextlib
import os

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def auto_jobs() -> int:
    """``--jobs auto``: one worker per core, at most two (the machine the default runs are sized for)."""
    return max(1, min(2, os.cpu_count() or 1))


def parse_jobs(value: str | int | None) -> int:
    """``--jobs``: ``auto`` (or None) or a count >= 1."""
    if value in (None, "", "auto"):
        return auto_jobs()
    jobs = int(value)
    if jobs < 1:
        raise ValueError(f"--jobs must be auto or >= 1, got {value!r}")
    return jobs


@contextlib.contextmanager
def one_thread_env():
    """Children inherit the environment at spawn: one OpenMP/BLAS thread from their first import."""
    saved = {k: os.environ.get(k) for k in THREAD_ENV}
    os.environ.update({k: "1" for k in THREAD_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
