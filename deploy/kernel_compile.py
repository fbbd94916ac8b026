"""Ahead-of-time compiles of every Triton kernel for A100, H100 and B200, with each binary's resources.

``vlkv kernels compile [--targets 80,90,100] [--jobs N] [--out DIR] [--cache-dir DIR]``

No GPU needed. :func:`vlkv.kernels.specs.launch_specs` records every launch the product makes (from the
launchers); each is turned into the program Triton's JIT would build for it on a target (the JIT's own
binder: argument types, values specialized to constants, divisibility-by-16 hints, options) and each
distinct program is compiled once with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``
in a process pool. Triton caches binaries by a key over the kernel's source hash, the specialization, the
options and the ``ptxas`` version (``TRITON_CACHE_DIR``, default ``~/.triton/cache``); the resources read
from a binary are stored beside it in that cache, so an unchanged kernel costs no compile on a second run.

Resources per binary: ``ptxas -v`` on the program's PTX with the flags Triton uses (registers, spill
stores/loads, stack frame) and ``cuobjdump --dump-resource-usage`` on the cubin Triton built (registers,
static shared and local memory); Triton's dynamic shared memory from the compile metadata. Occupancy by
the CUDA occupancy calculator's rules (``cuda_occupancy.h``): warps per SM limited by registers (allocated
per warp in units of 256, per SM sub-partition), by shared memory (plus 1 KiB reserved per block, 128-byte
granularity, the largest carve-out) and by the warp and block slots.

Fails (exit 1) on a compile error, any spill or local memory, or occupancy under a kernel's floor
(``FLOORS``). Writes ``kernels_compile.json`` and ``kernels_compile.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

TARGETS = {80: "A100 sm_80", 90: "H100 sm_90a", 100: "B200 sm_100a"}


@dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of a compute capability (CUDA programming guide, compute capabilities table)."""

    regs: int = 65536
    max_warps: int = 64
    max_blocks: int = 32
    smem: int = 233472  # the largest shared-memory carve-out, bytes
    reserved_smem: int = 1024  # per block, reserved by the system (cc >= 8.0)


SM = {80: SMLimits(smem=167936), 90: SMLimits(), 100: SMLimits()}

# Occupancy floors (active warps / the SM's 64), per kernel. Streaming kernels (split, mass, row and
# column statistics) loop over K/V tiles with a dot and a softmax between loads: two resident programs per
# SM (8 of 64 warps) let one load while the other computes; below that an SM's memory pipe idles between
# tiles. The reductions (combine, sum of counts) hold a few vectors and no shared memory: under half the
# warp slots would mean register blow-up, which is what the floor is there to catch.
FLOORS = {
    "_split_kernel": 0.125,
    "_mass_kernel": 0.125,
    "_row_stats_kernel": 0.125,
    "_col_stats_kernel": 0.125,
    "_combine_kernel": 0.5,
    "_sum_counts_kernel": 0.5,
}
RESOURCES_FILE = "vlkv_resources.json"


def _ceil_to(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(regs: int, smem: int, warps: int, cc: int) -> dict:
    """Resident blocks per SM and the active-warp fraction for ``warps``-warp blocks using ``regs``
    registers per thread and ``smem`` bytes of shared memory (static + dynamic) per block."""
    lim = SM[cc]
    by_warps = min(lim.max_blocks, lim.max_warps // warps)
    regs_per_warp = _ceil_to(max(regs, 1) * 32, 256)
    by_regs = (lim.regs // 4 // regs_per_warp) * 4 // warps  # 4 sub-partitions, registers allocated in each
    by_smem = lim.smem // _ceil_to(smem + lim.reserved_smem, 128)
    limits = {"warps": by_warps, "registers": by_regs, "shared memory": by_smem}
    blocks = min(limits.values())
    limiter = min(limits, key=limits.get)
    return {"blocks_per_sm": blocks, "occupancy": blocks * warps / lim.max_warps, "limiter": limiter}


def _init_worker(cache_dir: str | None) -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, even under a test run that interprets
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    warnings.simplefilter("ignore")


def plan(ccs: list[int]) -> tuple[list[dict], int]:
    """The distinct programs of every recorded launch on each target, and the number of launches."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from vlkv.kernels.specs import launch_specs

    launches = launch_specs()
    programs: dict[tuple, dict] = {}
    for cc in ccs:
        backend = make_backend(GPUTarget("cuda", cc, 32))
        binders = {}
        for launch in launches:
            fn = launch.kernel
            if fn.__name__ not in binders:
                binders[fn.__name__] = create_function_from_signature(fn.signature, fn.params, backend)
            # What JITFunction.run adds before binding, then its own binder and packing.
            kwargs = dict(
                launch.kwargs,
                debug=bool(fn.debug or knobs.runtime.debug),
                instrumentation_mode=knobs.compilation.instrumentation_mode,
                fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts,
            )
            bound, spec, opts = binders[fn.__name__](*launch.args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
            key = (fn.__name__, cc, *(repr(sorted(d.items())) for d in (signature, constexprs, attrs)))
            key += (repr(sorted(options.__dict__.items())),)
            prog = programs.setdefault(
                key,
                dict(
                    kernel=fn.__name__, module=fn.fn.__module__, cc=cc, signature=signature,
                    constexprs=constexprs, attrs=attrs, options=dict(options.__dict__), launches=0,
                    configs=[],
                ),
            )  # fmt: skip
            prog["launches"] += 1
            prog["configs"].append(launch.config)
    return list(programs.values()), len(launches)


def _ptxas_report(ptx: str, cc: int, options: dict) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        fmad = [] if options.get("enable_fp_fusion", True) else ["--fmad=false"]
        extra = options["ptx_options"].split() if options.get("ptx_options") else []
        cmd = [get_ptxas(cc).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2", *extra]
        cmd += [f"--gpu-name={sm_arch_from_capability(cc)}", str(src), "-o", str(Path(tmp) / "k.o")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr

    def grab(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {
        "ptxas_regs": grab(r"Used (\d+) registers"),
        "stack_frame": grab(r"(\d+) bytes stack frame"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
    }


def _cuobjdump_report(cubin: bytes) -> dict:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {"regs": int(fields["REG"]), "static_smem": int(fields["SHARED"]), "local": int(fields["LOCAL"])}


def compile_program(prog: dict) -> dict:
    """Compile one program (in a pool worker) and read its binary's resources."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(prog["module"]), prog["kernel"])
    head = {k: prog[k] for k in ("kernel", "cc", "launches", "configs")}
    head["constexprs"] = {fn.arg_names[i]: v for (i, *_), v in prog["constexprs"].items()}
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn, prog["signature"], prog["constexprs"], prog["attrs"])
        ck = triton.compile(src, target=GPUTarget("cuda", prog["cc"], 32), options=prog["options"])
    except Exception as exc:  # noqa: BLE001 - a compiler rejection is the result being reported
        return {**head, "error": f"{type(exc).__name__}: {exc}"[:4000], "compile_s": time.perf_counter() - t0}
    res_path = (
        Path(next(p for n, p in ck.metadata_group.items() if n.endswith(".json"))).parent / RESOURCES_FILE
    )
    if res_path.exists():
        res = json.loads(res_path.read_text()) | {"cached": True}
    else:
        res = _cuobjdump_report(ck.asm["cubin"]) | _ptxas_report(ck.asm["ptx"], prog["cc"], prog["options"])
        res["dynamic_smem"] = ck.metadata.shared
        res["num_warps"] = ck.metadata.num_warps
        res_path.write_text(json.dumps(res))
    res = {**head, **res, "compile_s": time.perf_counter() - t0, "hash": ck.hash}
    res["smem"] = res["static_smem"] + res["dynamic_smem"]
    res.update(occupancy(res["regs"], res["smem"], res["num_warps"], prog["cc"]))
    return res


def problems(result: dict) -> list[str]:
    """What fails the check for one compiled program (empty when it passes)."""
    if "error" in result:
        return [f"compile error: {result['error'].splitlines()[0] if result['error'] else '?'}"]
    out = []
    if result["spill_stores"] or result["spill_loads"]:
        out.append(f"spills {result['spill_stores']} B stored, {result['spill_loads']} B loaded")
    if result["local"] or result["stack_frame"]:
        out.append(f"local memory {result['local']} B, stack frame {result['stack_frame']} B")
    floor = FLOORS.get(result["kernel"])
    if floor is None:
        out.append("no occupancy floor chosen for this kernel: add one, with its reason, to FLOORS")
    elif result["occupancy"] < floor:
        out.append(f"occupancy {result['occupancy']:.1%} < floor {floor:.1%} ({result['limiter']})")
    return out


def compile_all(ccs: list[int], jobs: int | None = None, cache_dir: str | None = None) -> dict:
    """Plan and compile every program on a spawn pool of ``jobs`` workers (default: the usable cores)."""
    jobs = jobs or len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no torch/CUDA state is forked
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(cache_dir,)) as pool:
        programs, n_launches = pool.submit(plan, ccs).result()
        # The big kernels first, so the pool does not end waiting on one of them.
        programs.sort(key=lambda p: p["kernel"] not in ("_split_kernel", "_mass_kernel", "_col_stats_kernel"))
        results = list(pool.map(compile_program, programs))
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers, reaped when the pool closed
    cpu_s = usage.ru_utime + usage.ru_stime
    return {
        "launches": n_launches,
        "programs": results,
        "wall_s": time.perf_counter() - t0,
        "jobs": jobs,
        "cpu_s": cpu_s,
    }


def summary_rows(results: list[dict]) -> list[dict]:
    """One row per (kernel, target): the worst case over its programs."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["kernel"], r["cc"])].append(r)
    rows = []
    for (kernel, cc), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ok = [r for r in rs if "error" not in r]
        row = {"kernel": kernel, "cc": cc, "programs": len(rs), "launches": sum(r["launches"] for r in rs)}
        row["errors"] = len(rs) - len(ok)
        row["failing"] = sum(bool(problems(r)) for r in rs)
        if ok:
            row["regs"] = (min(r["regs"] for r in ok), max(r["regs"] for r in ok))
            row["smem"] = (min(r["smem"] for r in ok), max(r["smem"] for r in ok))
            row["spill"] = sum(r["spill_stores"] + r["spill_loads"] for r in ok)
            row["local"] = max(r["local"] + r["stack_frame"] for r in ok)
            worst = min(ok, key=lambda r: r["occupancy"])
            row["occupancy"] = (worst["occupancy"], max(r["occupancy"] for r in ok))
            row["blocks"] = worst["blocks_per_sm"]
            row["limiter"] = worst["limiter"]
            row["warps"] = worst["num_warps"]
        rows.append(row)
    return rows


def _span(pair, fmt="{}") -> str:
    lo, hi = pair
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def table(rows: list[dict]) -> str:
    """The resource table in Markdown (what the README's kernel section shows)."""
    lines = [
        "| kernel | target | programs (launches) | warps | registers / thread | shared memory KiB "
        "| spill B | local B | occupancy (worst: limiter) | floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "regs" not in r:
            lines.append(
                f"| `{r['kernel']}` | {TARGETS[r['cc']]} | {r['programs']} | compile errors: {r['errors']} |"
            )
            continue
        smem = _span(tuple(x / 1024 for x in r["smem"]), "{:.1f}")
        occ = f"{_span(r['occupancy'], '{:.1%}')} ({r['blocks']} blocks: {r['limiter']})"
        lines.append(
            f"| `{r['kernel']}` | {TARGETS[r['cc']]} | {r['programs']} ({r['launches']}) | {r['warps']} "
            f"| {_span(r['regs'])} | {smem} | {r['spill']} | {r['local']} | {occ} | {FLOORS.get(r['kernel'], 0):.1%} |"
        )
    return "\n".join(lines)


def run(args) -> int:
    ccs = [int(x) for x in str(args.targets).split(",")]
    unknown = [cc for cc in ccs if cc not in SM]
    if unknown:
        print(f"unknown target(s) {unknown}; known: {sorted(SM)}", file=sys.stderr)
        return 2
    report = compile_all(ccs, args.jobs, args.cache_dir)
    results = report["programs"]
    rows = summary_rows(results)
    md = table(rows)
    fails = [(r, p) for r in results for p in problems(r)]
    print(md)
    print(
        f"\n{report['launches']} launches -> {len(results)} programs on {len(ccs)} targets in "
        f"{report['wall_s']:.1f} s wall, {report['cpu_s']:.0f} CPU s in {report['jobs']} workers "
        f"({sum(r.get('cached', False) for r in results)} found in the cache)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_compile.md").write_text(md + "\n")
    (out / "kernels_compile.json").write_text(json.dumps({**report, "summary": rows}, indent=1, default=str))
    for r, p in fails[:20]:
        example = ", ".join(f"{k}={v}" for k, v in r["configs"][0].items())
        print(f"FAIL {r['kernel']} {TARGETS[r['cc']]}: {p}\n  e.g. {example}", file=sys.stderr)
    if fails:
        print(f"{len(fails)} problem(s) in {len({id(r) for r, _ in fails})} program(s)", file=sys.stderr)
        return 1
    print(f"all compiled, no spills, occupancy at or above every floor; wrote {out}/kernels_compile.md")
    return 0


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--targets", default="80,90,100", help="compute capabilities (80: A100, 90: H100, 100: B200)"
    )
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: the usable cores)")
    ap.add_argument("--out", default="out/kernels", help="where kernels_compile.md / .json go")
    ap.add_argument(
        "--cache-dir", default=None, help="Triton's cache (default: TRITON_CACHE_DIR or ~/.triton)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
