"""``vlkv bench gpu``: every GPU measurement in one report, or one line saying there is no GPU.

On a CUDA machine, in order, each step's output going into ``<out>/report.md``:

1. The compiled kernels against their torch references: the kernel tests with ``TRITON_INTERPRET=0``
   (needs the repository's ``tests/unit/``; skipped with a note when run from an installed package).
2. ``vlkv kernels compile --targets <this GPU>``: registers, shared memory, spills, occupancy of the
   binaries this GPU runs.
3. ``python -m vlkv_lab.bench.kernels``: the statistics kernel's overhead against a prefill layer (SDPA
   attention + MLP), paged decode time and bandwidth against the references and dense SDPA, and measured /
   modelled for every shape (``cost_model.py``).

On a CPU-only machine it prints one line and returns 0: ``vlkv kernels compile`` is the GPU path's check there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

NO_GPU = "vlkv bench gpu: no CUDA device on this machine, nothing measured (`vlkv kernels compile` checks the GPU kernels without one)"


def _steps(out: Path, quick: bool, cc: int) -> list[tuple[str, list[str], dict]]:
    py = sys.executable
    repo = Path(__file__).resolve().parents[3]  # lab/vlkv_lab/bench/gpu.py -> the repo
    tests = [
        repo / "tests" / "unit" / n for n in ("test_kernel_attention_stats.py", "test_kernel_paged_decode.py")
    ]
    steps = []
    if all(t.exists() for t in tests):
        cmd = [py, "-m", "pytest", "-q", *map(str, tests)]
        steps.append(("Compiled kernels against their references", cmd, {"TRITON_INTERPRET": "0"}))
    compile_cmd = [py, "-m", "vlkv.deploy.kernel_compile", "--targets", str(cc), "--out", str(out)]
    steps.append((f"Binaries for this GPU (sm_{cc})", compile_cmd, {}))
    bench = [py, "-m", "vlkv_lab.bench.kernels", "--out", str(out / "kernels")] + ["--quick"] * quick
    steps.append(("Kernel speed, statistics overhead, decode bandwidth, measured / modelled", bench, {}))
    return steps


def run(out: str | Path = "out/bench_gpu", quick: bool = False) -> int:
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    name = torch.cuda.get_device_name()
    sections, failed = [f"# vlkv bench gpu: {name} (sm_{cc})\n"], []
    for title, cmd, env in _steps(out, quick, cc):
        print(f"== {title}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True)
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        if proc.returncode:
            failed.append(title)
        body = proc.stdout + (f"\nstderr:\n{proc.stderr[-4000:]}" if proc.returncode else "")
        sections.append(
            f"## {title}: {status}, {time.perf_counter() - t0:.0f} s\n\n`{' '.join(cmd)}`\n\n```\n{body}\n```\n"
        )
    report = out / "report.md"
    report.write_text("\n".join(sections))
    print(f"wrote {report}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
