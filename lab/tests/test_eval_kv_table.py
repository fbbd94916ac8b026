"""``vlkv eval kv-table`` on the shipped default model (a few examples): the 8-bit formats against fp16
on the short kinds, and the long kind decoded to its end with decode-phase re-compression off and on."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "common" / "default_model"

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL / "model.safetensors").exists(), reason="default model not trained yet"
)


def test_kv_table_runs_the_long_kind_and_re_compresses_only_when_asked(tmp_path, capsys):
    from vlkv.common.config import DEFAULT_PROMPT_WEIGHT, ModelConfig
    from vlkv.common.model.loading import load_model, load_processor
    from vlkv.deploy.synthetic_task import make_examples
    from vlkv_lab.eval.evaluation import evaluate, prepare
    from vlkv_lab.eval.kv_storage import run_kv_table

    torch.set_num_threads(2)
    model, processor = load_model(ModelConfig(path=str(DEFAULT_MODEL))), load_processor(str(DEFAULT_MODEL))
    n = 4
    prepared = prepare(model, processor, make_examples(n, 0, "heldout"), progress=False)
    full = evaluate(model, processor, prepared, "full", 1.0, 12)
    args = SimpleNamespace(
        out=str(tmp_path), policy="vlcache", budget=0.1, kv_dtype="fp16", decode_budget=0.0,
        decode_window=32, n=n, seed=0, json=True, max_new_tokens=12,
    )  # fmt: skip
    assert run_kv_table(args, model, processor, prepared, full, 0.0) == 0
    rows = {}
    for line in (tmp_path / "kv.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[0] not in ("run", "---"):
            rows[cells[0]] = cells
    assert set(rows) == {
        "fp16", "int8", "fp8", "long, full cache", "long, re-compression off",
        "long, re-compression, decode-time mass alone", "long, re-compression 1 + 32",
    }  # fmt: skip
    assert [rows[f][3] for f in ("fp16", "int8", "fp8")] == ["fp16", "int8", "fp8"]
    long_full, off, alone, on = (rows[k] for k in list(rows)[3:])
    assert long_full[1] == off[1] == alone[1] == on[1] == "colour_of_shape_long"
    assert "prompt weight 0" in alone[5] and f"prompt weight {DEFAULT_PROMPT_WEIGHT:g}" in on[5]
    # the long answers run to their end (69 tokens, eos included), not to a forced length
    assert 60 <= float(long_full[7]) <= 72 and float(long_full[6]) >= 0.75
    # re-compression cuts tokens only when it is on, as many whatever it ranks them by
    assert int(long_full[8]) == int(off[8]) == 0 < int(on[8]) == int(alone[8])
    assert "long answers, re-compression on vs off" in capsys.readouterr().out


def test_a_one_point_drop_is_exactly_one_point_not_a_float_miss():
    from vlkv_lab.eval.kv_storage import TARGET_POINTS, _points

    assert (289 / 300 - 292 / 300) * 100 < -TARGET_POINTS  # the float noise the rounding removes
    assert _points(289 / 300, 292 / 300) == -TARGET_POINTS
    assert _points(288 / 300, 292 / 300) < -TARGET_POINTS
