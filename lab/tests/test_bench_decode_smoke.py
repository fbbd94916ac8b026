"""The admission benchmark's arithmetic (the decode worker's pool, admission and scheduler on the meta
device; no model, no timing)."""

from __future__ import annotations

from vlkv_lab.bench.admission import (
    GIB,
    admission,
    admit_count,
    row_of,
    sustained,
    uneven_lengths,
    uniform_lengths,
)


def test_uneven_split_keeps_the_uniform_total():
    uniform, uneven = uniform_lengths(2048, 0.1, 32), uneven_lengths(2048, 0.1, 32)
    assert uniform == [205] * 32
    assert sum(uneven) == sum(uniform)
    assert uneven[0] > uneven[-1] and len(set(uneven)) > 10


def test_admission_counts_follow_the_block_arithmetic():
    blocks = 32768  # 2 GiB of 64 KiB fp16 blocks (16 tokens x 8 heads x 128 dims, K+V)
    watermark = blocks // 100
    small = [205] * 32  # 13 blocks per layer
    assert admit_count(2 * GIB, small, 100, "grow") == (blocks - watermark) // (13 * 32)
    assert admit_count(2 * GIB, small, 100, "reserve") == blocks // (20 * 32)  # 305 tokens: 20 blocks
    assert admit_count(2 * GIB, [2048] * 32, 100, "reserve") == blocks // (135 * 32)


def test_ten_percent_caches_admit_at_least_nine_times_the_full_caches():
    adm = admission(2 * GIB, prompt=2048, max_new_tokens=100)
    for case in ("10% uniform", "10% uneven (VL-Cache-like)"):
        assert row_of(adm, "grow", case)["admitted_vs_full"] >= 9
        assert row_of(adm, "reserve", case)["admitted_vs_full"] < 9  # what reserving 100 tokens costs
        assert row_of(adm, "reserve", case)["preemptions"] == 0


def test_sustained_loop_preempts_and_finishes_sequences():
    small = sustained(256 << 20, [205] * 32, 40, "grow")
    assert small["preemptions"] > 0 and small["finished"] > 0
    # Never more decoding than admission alone would allow, never fewer than the reserve policy holds.
    assert admit_count(256 << 20, [205] * 32, 40, "reserve") <= small["mean_running"]
    assert small["mean_running"] <= admit_count(256 << 20, [205] * 32, 40, "grow")
