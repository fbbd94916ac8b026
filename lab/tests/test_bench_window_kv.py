"""``vlkv bench window-kv`` (lab/vlkv_lab/bench/window_kv.py): the byte table's arithmetic and the step timing's path."""

from __future__ import annotations

import pytest
from vlkv_lab.bench import window_kv as wk


def _rows(layout, m, new_tokens=128):
    rows = wk.kv_rows((layout,), (m,), pool_gib=40.0, new_tokens=new_tokens)
    return {r["row"]: r for r in rows}


@pytest.mark.parametrize("layout", [lay for lay in wk.LAYOUTS if lay.name.startswith("Gemma")])
@pytest.mark.parametrize("m", [2048, 8192, 32768])
def test_gemma_like_windows_save_bytes(layout, m):
    r = _rows(layout, m)
    sliding = sum(1 for w in layout.windows if w)
    assert r["10%, window-only sliding"]["bytes"] <= r["10%, no windows"]["bytes"]
    assert r["10%, window-only sliding"]["seqs"] >= r["10%, no windows"]["seqs"]
    assert r["full"]["bytes"] < r["full, no windows"]["bytes"]
    assert r["full"]["sliding_kept"] == sliding * 1023  # a sliding layer keeps its last W - 1 positions
    assert r["full"]["global_kept"] == r["full, no windows"]["global_kept"]
    assert r["full"]["seqs"] > r["full, no windows"]["seqs"]
    kept, _ = wk.kept(layout, "10%, window-only sliding", m, 128)
    assert all(k <= 1023 for k, w in zip(kept, layout.windows, strict=True) if w)
    if m == 32768:  # 10% (3,277) outgrows the window: the cut spills to the global layers, the total kept
        assert r["10%, window-only sliding"]["tokens"] == r["10%, no windows"]["tokens"]
        assert r["10%, window-only sliding"]["global_kept"] > r["10%, no windows"]["global_kept"]


def test_mistral_window_binds_only_past_it():
    mistral = next(lay for lay in wk.LAYOUTS if lay.name == "Mistral-7B")
    short = _rows(mistral, 2048)  # 2,048 + 128 < 4,096: the window never cuts, the pool counts every layer
    for key in ("bytes", "blocks", "seqs"):
        assert short["full"][key] == short["full, no windows"][key]
        assert short["10%, window-only sliding"][key] == short["10%, no windows"][key]
    long = _rows(mistral, 8192)
    assert long["full"]["tokens"] == 32 * 4095
    assert long["full"]["seqs"] > long["full, no windows"]["seqs"]


def test_markdown_and_step_path(tmp_path):
    rows = wk.kv_rows(lengths=(2048,))
    table = wk.kv_table(rows, 40.0)
    assert table.count("\n") == 2 + len(wk.LAYOUTS) * len(wk.ROWS) - 1
    engine = wk.family_engine("gemma3_text", 8)
    assert engine.spec.windows == (8, 8, 8, 8, 8, 0)
    assert wk.family_engine("mistral", 8).spec.windows == (8,) * 6
    assert wk.plot(rows, tmp_path) is None or (tmp_path / "window_kv.png").is_file()
