"""The worker's background heap trimmer (``common/heap.py``): when it collects and trims, from its samples."""

from __future__ import annotations

import pytest
from vlkv.common import heap

MB = 1 << 20


class Samples:
    """A scripted ``(held, free, resident)`` sequence; the trimmer reads one per check (two after a trim)."""

    def __init__(self, values):
        self.values = list(values)
        self.last = self.values[0]

    def __call__(self):
        if self.values:
            self.last = self.values.pop(0)
        return self.last


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "release_memory", lambda: calls.append("trim"))
    return calls


def _trimmer(values, **kw) -> heap.HeapTrimmer:
    return heap.HeapTrimmer(min_free_bytes=32 * MB, sample=Samples(values), **kw)


def test_no_trim_while_nothing_grows(trims):
    t = _trimmer([(100 * MB, 1 * MB, 500 * MB)] * 5)
    assert [t.check() for _ in range(4)] == [False] * 4
    assert trims == []


def test_free_heap_growth_trims_once_it_settles(trims):
    base = (100 * MB, 1 * MB, 500 * MB)
    t = _trimmer(
        [base, (100 * MB, 60 * MB, 560 * MB), (100 * MB, 90 * MB, 590 * MB), (100 * MB, 90 * MB, 590 * MB)]
    )
    assert t.check() is False  # the first check only records
    assert t.check() is False  # grew, still moving
    assert t.check() is False
    assert t.check() is True  # grew and held still: trimmed
    assert trims == ["trim"] and t.trims == 1


def test_resident_growth_alone_trims(trims):
    """A burst that reuses pages an earlier trim gave back: neither heap figure grows, resident memory does."""
    base = (170 * MB, 60 * MB, 530 * MB)
    redirtied = (170 * MB, 60 * MB, 620 * MB)
    t = _trimmer([base, redirtied, redirtied, base])
    assert t.check() is False
    assert t.check() is False
    assert t.check() is True
    assert trims == ["trim"]


def test_growth_that_never_settles_trims_after_max_wait(trims):
    moving = [(100 * MB, (1 + 40 * i) * MB, 500 * MB) for i in range(8)]
    t = _trimmer(moving, max_wait_checks=3)
    results = [t.check() for _ in range(5)]
    assert results.count(True) == 1 and results.index(True) == 3


def test_resident_bytes_reads_this_process():
    assert heap.resident_bytes() > 1 * MB


def test_workers_set_the_configured_trim_threshold(monkeypatch, tiny_model_dirs):
    """``ServerConfig.malloc_trim_mb`` (``vlkv serve --malloc-trim-mb``) is what each worker hands glibc."""
    from vlkv.common.config import ModelConfig, ServerConfig
    from vlkv.common.errors import ConfigError
    from vlkv.deploy import servers

    seen = []
    monkeypatch.setattr(servers, "tune_malloc", lambda **kw: seen.append(kw) or True)
    path = tiny_model_dirs("llava-gqa")
    for mb in (None, 32):
        cfg = ServerConfig(model=ModelConfig(path=path), **({} if mb is None else {"malloc_trim_mb": mb}))
        servers._load_worker(cfg, None)
    assert [kw["trim_threshold"] for kw in seen] == [4 << 20, 32 << 20]
    with pytest.raises(ConfigError, match="malloc_trim_mb"):
        ServerConfig(model=ModelConfig(path=path), malloc_trim_mb=0)
