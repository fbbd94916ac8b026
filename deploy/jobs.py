"""``--jobs`` of ``vlkv eval zoo`` and ``vlkv calibrate``: how many workers of the tools' one pool
(``pool.py``) it means.

Their matmuls are small, so a second torch thread in one process gains little; two processes on two cores
run two pieces of work at once.
"""

from __future__ import annotations

import argparse
import os


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


def jobs_flag(value: str) -> int:
    """``--jobs`` as an argparse type, so a bad value is reported as a usage error."""
    try:
        return parse_jobs(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"auto or a count >= 1, got {value!r}") from None
