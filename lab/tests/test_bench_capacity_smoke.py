"""``lab/vlkv_lab/bench/capacity.py`` counts (no timing): int8 blocks hold about twice the sequences of fp16 ones in
the same bytes, decode re-compression sustains more of them with nothing failing, and the int8 cache's
wire stream is about half the fp16 one."""

from __future__ import annotations

from vlkv_lab.bench.capacity import GIB, capacity, report, wire_bytes


def test_capacity_counts_and_wire_bytes():
    rows = {r.case: r for r in capacity(1 * GIB, 1.0, 32)}
    full, fp16, int8, recomp = (rows[c] for c in rows)
    assert full.admitted >= 2 and not any(r.failed for r in rows.values())
    assert 1.8 <= int8.admitted / fp16.admitted <= 2.0  # int8 K/V plus fp16 scales: ~1.87x the blocks
    assert recomp.admitted == int8.admitted and recomp.sustained > int8.sustained
    assert recomp.preemptions < int8.preemptions
    wire = wire_bytes()
    assert 0.49 < wire["10%_int8"] / wire["10%_fp16"] < 0.52  # int8 halves the bytes; scales add ~1.6%
    md = report(list(rows.values()), wire, [], 1 * GIB, 32)
    assert "10% int8 + decode re-compression" in md and "share of full fp16" in md
