"""The lab's kernel cost model (``lab/vlkv_lab/bench/cost_model.py``: bytes and time of a paged decode step, the
launcher's split rule, a 7B model's decode step), ``vlkv bench kernels --model-only`` and ``vlkv bench gpu`` on a
CPU-only machine. (The kernels' ahead-of-time compile: tests/unit/test_kernel_compile.py.)"""

from __future__ import annotations

import pytest
import torch
from vlkv.deploy.cli.main import main as cli
from vlkv_lab.bench import cost_model as cm


def test_cost_model_bytes_and_decode_step():
    # One layer, 32 sequences of 2,048 tokens, 32 KV heads of 128: K and V in fp16 dominate the bytes.
    fp16 = cm.paged_decode_costs(32, 2048, 32, 32, 128, kv="fp16")
    kv = 2 * 32 * 2048 * 32 * 128 * 2
    assert kv <= fp16[0].bytes < 1.01 * kv
    int8 = cm.paged_decode_costs(32, 2048, 32, 32, 128, kv="int8")
    assert 0.5 * kv < int8[0].bytes < 0.52 * kv  # one byte per element plus the fp16 V scales
    h100 = cm.GPUS["H100"]
    assert fp16[0].seconds(h100) == pytest.approx(fp16[0].bytes / h100.bandwidth)  # memory-bound
    # The launcher's split rule: a 4K sequence on an H100 with 8 KV heads splits 33 ways.
    assert cm.decode_splits(1, 4133, 8, 132, 64) == 33 and cm.decode_splits(128, 205, 32, 132, 64) == 1
    full = cm.decode_step(cm.LLAVA_15_7B, h100, 32, 2048, "fp16")
    tenth = cm.decode_step(cm.LLAVA_15_7B, h100, 32, 205, "fp16")
    weights = 2 * cm.LLAVA_15_7B.matmul_params / h100.bandwidth
    assert full["weights_s"] == pytest.approx(weights) and 6.4e9 < cm.LLAVA_15_7B.matmul_params < 6.8e9
    assert full["step_s"] / tenth["step_s"] > 2
    assert not cm.decode_step(cm.LLAVA_15_7B, h100, 128, 2048, "fp16")["fits"]


def test_bench_kernels_model_only_prints_the_model(tmp_path, capsys):
    assert cli(["bench", "kernels", "--model-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "H100 batch 32 fp16: 10%" in out and "_split_kernel" in out and "B200 model ms" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_bench_gpu_on_cpu_says_so_in_one_line(tmp_path, capsys):
    assert cli(["bench", "gpu", "--out", str(tmp_path / "gpu")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out
    assert not (tmp_path / "gpu").exists()
