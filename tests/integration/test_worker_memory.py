"""Workers give memory back (issue 33): after ten 60 MB inputs to the prefill worker and ten 48 MB TransferKV
chunks to the decode worker, each refused, each worker's resident memory is within 100 MB of where it was
before them. Real worker processes on loopback (``lab/vlkv_lab/bench/worker_memory.py``, which also prints the
figures, split into anonymous and file-backed memory: ``python -m vlkv_lab.bench.worker_memory``).

What a worker keeps is anonymous memory (heap arenas), never file-backed pages: the warm-up (two whole
requests) already touched the libraries' pages, and the file-backed part of what was kept was 0 MiB in every
one of 24 runs (2026-11-27), so resident memory is the measure here and its anonymous part is checked too."""

from __future__ import annotations

import pytest
from vlkv_lab.bench.worker_memory import measure, table

BOUND = 100_000_000  # bytes kept at most, per worker (issue 33)
# Kept after ten inputs, 12 runs each (python -m vlkv_lab.bench.worker_memory --runs 12 --settle-s 8 on the
# tiny llava-gqa model, 2026-11-27): with the workers' 32 MiB trim threshold, prefill 7 / 36 / 94 MiB
# (min / median / max), decode 27 / 68 / 81 MiB: the free tops of glibc thread arenas, which malloc_trim never
# trims and glibc gave back only above 32 MiB each; with 4 MiB (ServerConfig.malloc_trim_mb, the default), prefill
# 2 / 7 / 34 MiB, decode 1 / 9 / 68 MiB. A bound of 2 inputs still fails a worker that keeps 2 of the 10.


@pytest.mark.timeout(600)
def test_rss_returns_after_ten_large_inputs_on_both_workers(tiny_model_dirs):
    figures = measure(tiny_model_dirs("llava-gqa"), inputs=10, prefill_mb=60, transfer_mb=48, settle_s=8.0)
    print(table(figures, 10))
    for f in figures:
        assert set(f.codes) <= {"INVALID_ARGUMENT", "DATA_LOSS", "RESOURCE_EXHAUSTED"}, (f.worker, f.codes)
        assert f.peak - f.start.rss > 40_000_000, (f.worker, "the inputs did not reach the worker")
        assert f.peak > f.start.hwm, (f.worker, "the peak is not the inputs'")
        assert f.kept <= BOUND, (f.worker, f.kept)
        assert f.kept_anon <= BOUND, (f.worker, f.kept_anon)
