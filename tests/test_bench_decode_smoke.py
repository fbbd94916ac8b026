"""The decode benchmark's admission arithmetic (KVPool accounting on the meta device; no model, no timing)."""

from __future__ import annotations

from vlkv.decode_worker.bench_decode import GIB, admission, uneven_lengths, uniform_lengths


def _rows(adm: dict, reserve: int) -> dict[str, dict]:
    return {r["case"]: r for r in adm["rows"] if r["max_new_tokens"] == reserve}


def test_uneven_split_keeps_the_uniform_total():
    uniform, uneven = uniform_lengths(2048, 0.1, 32), uneven_lengths(2048, 0.1, 32)
    assert uniform == [205] * 32
    assert sum(uneven) == sum(uniform)
    assert uneven[0] > uneven[-1] and len(set(uneven)) > 10


def test_ten_percent_caches_admit_at_least_nine_times_the_full_caches():
    adm = admission(2 * GIB, prompt=2048, max_new_tokens=100)
    assert adm["num_blocks"] == 32768  # 2 GiB of 64 KiB fp16 blocks (16 tokens x 8 heads x 128 dims, K+V)
    for reserve in (0, 100):
        for r in _rows(adm, reserve).values():  # one-by-one allocation agrees with the block arithmetic
            assert r["admitted"] == adm["num_blocks"] // r["blocks_per_seq"]
    caches = _rows(adm, 0)
    assert caches["100%"]["admitted"] == 8
    assert caches["10% uniform"]["vs_full"] >= 9
    assert caches["10% uneven (VL-Cache-like)"]["vs_full"] >= 9
    # Reserving 100 new tokens per sequence costs the 10% cache about half its size again: 7 vs 51 seqs.
    reserved = _rows(adm, 100)
    assert (reserved["100%"]["admitted"], reserved["10% uniform"]["admitted"]) == (7, 51)
    # Per-layer tables cost nothing: an uneven split admits as many sequences as the uniform one (+-1
    # for each layer's last partly used block).
    for rows in (caches, reserved):
        assert abs(rows["10% uneven (VL-Cache-like)"]["admitted"] - rows["10% uniform"]["admitted"]) <= 1
    assert adm["max_reserve_by_blocks"] == 19
