"""Every Triton kernel compiled ahead of time for A100, H100 and B200 (``vlkv kernels compile``), no GPU.

The compile test runs the command itself: each distinct program the launchers make (kernels/specs.py) is
compiled for sm_80, sm_90a and sm_100a in a process pool; it fails on a compiler error, a spill, local
memory or occupancy under a kernel's floor. Triton's cache (``TRITON_CACHE_DIR``, default ``~/.triton``)
keeps the binaries by source hash, so a rerun with unchanged kernels compiles nothing. Also here: the
launch recorder, the occupancy formula, the cost model and ``vlkv bench gpu`` on a CPU-only machine.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from vlkv.deploy.cli.main import main as cli
from vlkv.deploy.kernel_compile import FLOORS, occupancy, problems
from vlkv_lab.bench import cost_model as cm

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"


def _jit_kernels() -> set[str]:
    """Names of the ``@triton.jit`` functions in kernels/ that are launched (not inlined helpers)."""
    names = set()
    for path in KERNEL_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                    names.add(node.name)
    return names


@pytest.mark.timeout(900)
def test_every_kernel_compiles_for_a100_h100_b200_without_spills(tmp_path, capsys):
    assert cli(["kernels", "compile", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "kernels_compile.json").read_text())
    progs = report["programs"]
    assert {(p["kernel"], p["cc"]) for p in progs} == {
        (k, cc) for k in _jit_kernels() for cc in (80, 90, 100)
    }
    assert not [p for p in progs if problems(p)]
    assert len(progs) / 3 < report["launches"] / 10  # deduplicated: many launches share one program
    table = (tmp_path / "kernels_compile.md").read_text()
    assert table.count("\n") == 2 + 3 * len(_jit_kernels())
    print(capsys.readouterr().out.splitlines()[-2])  # the timing line, for the CI log


def test_launch_specs_come_from_the_launchers():
    from vlkv.kernels.specs import DECODE_POINTS, launch_specs

    launches = launch_specs()
    split = [x for x in launches if x.name == "_split_kernel"]
    assert len(split) == 2 * 3 * 2 * 3 * 2 * len(DECODE_POINTS) * 2
    for x in split:
        c, kw = x.config, x.kwargs
        assert kw["GROUP"] == c["group"] and kw["PAGE"] == c["page"] and kw["BLOCK_D"] == c["head_dim"]
        assert kw["QUANT"] == (c["pool"] != "model") and kw["FP8"] == (c["pool"] == "fp8")
        assert kw["BLOCK_N"] == (32 if c["pool"] == "fp8" else 64)  # the launcher's default per format
        assert kw["PRECISION"] == "tf32" and not kw["UPCAST"]  # the GPU path, not the interpreter's
        assert x.grid[2] <= c["splits"]
    assert {x.kwargs["BLOCK_P"] for x in launches if x.name == "_combine_kernel"} == {16, 32}
    assert sum(x.name == "_mass_kernel" for x in launches) == len(split) // 2  # only with mass_out
    from vlkv.kernels.paged_decode_reference import _TABLES

    assert not any(t.device.type == "cuda" for t in _TABLES.values())  # no fake table left behind


def test_occupancy_follows_the_cuda_calculator():
    # 64 registers x 128 threads: 8 blocks fill 32 of 64 warps (the CUDA calculator's 50%).
    assert occupancy(64, 0, 4, 90) == {"blocks_per_sm": 8, "occupancy": 0.5, "limiter": "registers"}
    # 255 registers: 8,192 per warp, 2 warps per sub-partition -> 8 warps -> 2 blocks of 4 warps.
    assert occupancy(255, 0, 4, 80)["blocks_per_sm"] == 2
    # 100 KiB of shared memory: one block on an A100 (164 KiB), two on an H100 (228 KiB).
    assert occupancy(32, 100 * 1024, 4, 80)["blocks_per_sm"] == 1
    assert occupancy(32, 100 * 1024, 4, 90) == {
        "blocks_per_sm": 2,
        "occupancy": 0.125,
        "limiter": "shared memory",
    }
    assert occupancy(16, 0, 4, 100) == {"blocks_per_sm": 16, "occupancy": 1.0, "limiter": "warps"}


def test_problems_flag_spills_local_memory_and_low_occupancy():
    ok = dict(kernel="_split_kernel", spill_stores=0, spill_loads=0, local=0, stack_frame=0)
    ok.update(occupancy=FLOORS["_split_kernel"], limiter="registers")
    assert problems(ok) == []
    assert problems(ok | {"spill_stores": 8})[0].startswith("spills")
    assert problems(ok | {"local": 16})[0].startswith("local memory")
    assert problems(ok | {"occupancy": 0.0625})[0].startswith("occupancy")
    assert problems({"kernel": "_split_kernel", "error": "PTXASError: boom"}) == [
        "compile error: PTXASError: boom"
    ]


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
