"""``vlkv bench image-reuse`` runs end to end on a few examples (in process) and reports every condition."""

from __future__ import annotations

from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv_lab.bench.image_reuse import CONDITIONS, measure_ttft, plot, render


def test_image_reuse_bench_smoke(tmp_path):
    report = measure_ttft(str(DEFAULT_MODEL_DIR), n=3, repeats=2)
    assert [r.name for r in report.rows] == [c.name for c in CONDITIONS]
    by = {r.name: r for r in report.rows}
    assert by["miss (no reuse)"].hits == 0 and by["hit, VLCache 5%"].hits == 3
    assert by["hit, no recompute"].recompute_ratio == 0 and by["hit, VLCache 100%"].recompute_ratio == 1
    assert 0 < by["hit, VLCache 5%"].recompute_ratio < 0.1
    assert all(r.ttft_ms > 0 for r in report.rows)
    text = render(report, "vlkv bench image-reuse")
    assert "hit, MPIC 5%" in text and "Target at 5% recomputed" in text
    plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
