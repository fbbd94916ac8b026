"""Every Triton kernel compiled ahead of time for A100, H100 and B200 (``vlkv kernels compile``), no GPU.

The compile test runs the command itself: each distinct program the launchers make (kernels/specs.py) is
compiled for sm_80, sm_90a and sm_100a in a process pool; it fails on a compiler error, a spill, local
memory or occupancy under a kernel's floor. Triton's cache (``TRITON_CACHE_DIR``, default ``~/.triton``)
keeps the binaries by source hash, so a rerun with unchanged kernels compiles nothing. Also here: the
launch recorder and the occupancy formula. (The lab's cost model, ``vlkv bench kernels`` and ``vlkv bench gpu``:
lab/tests/test_bench_kernels.py.)
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from vlkv.deploy.cli.main import main as cli
from vlkv.deploy.kernel_compile import FLOORS, occupancy, problems

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"


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
