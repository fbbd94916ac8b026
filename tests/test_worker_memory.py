"""Workers give memory back (issue 33): after ten 60 MB inputs to the prefill worker and ten 48 MB TransferKV
chunks to the decode worker, each refused, each worker's resident memory is within 100 MB of where it was
before them. Real worker processes on loopback (``tools/bench/worker_memory.py``, which also prints the
figures: ``python -m vlkv.tools.bench.worker_memory``)."""

from __future__ import annotations

import pytest
from vlkv.tools.bench.worker_memory import measure, table

BOUND = 100_000_000  # bytes kept at most, per worker


@pytest.mark.timeout(600)
def test_rss_returns_after_ten_large_inputs_on_both_workers(tiny_model_dirs):
    figures = measure(tiny_model_dirs("llava-gqa"), inputs=10, prefill_mb=60, transfer_mb=48, settle_s=3.0)
    print(table(figures, 10))
    for f in figures:
        assert set(f.codes) <= {"INVALID_ARGUMENT", "DATA_LOSS", "RESOURCE_EXHAUSTED"}, (f.worker, f.codes)
        assert f.peak - f.start > 40_000_000, (f.worker, "the inputs did not reach the worker")
        assert f.kept <= BOUND, (f.worker, f.kept)
