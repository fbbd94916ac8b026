"""Benchmark of the attention-statistics and paged-decode kernels.

``python -m vlkv_lab.bench.kernels [--quick] [--out DIR] [--layout 7b|small] [--m 1024,2048] [--model-only]``
(``vlkv bench kernels``)

On CUDA: the Triton kernels against their torch references and PyTorch SDPA, with achieved bandwidth
(unique bytes read / time), and the statistics overhead (50 query rows) as a share of one prefill layer
(attention + MLP) at m in {1K, 2K, 8K, 32K}. On CPU (no Triton): the torch reference's share of the
prefill, at m in {1K, 2K, 8K} by default (``--m`` for others; a 7B layer at 32K takes minutes on CPU),
and paged-decode reference timings. Times are per layer; totals multiply by the layer count. Prints a
table and saves ``bench_kernels_<device>.png`` and ``.json`` into ``--out``.

Beside the measured tables: the roofline cost model (``cost_model.py``) of the same shapes on A100, H100
and B200, and on CUDA measured / modelled for this GPU. ``--model-only`` measures nothing: it prints the
model (LLaVA-1.5-7B launches and decode steps, then the benchmark's shapes) beside the figures of the last
measured run saved in ``--out`` (this machine's CPU figures when that run was on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from vlkv.kernels.attention_stats import attention_stats, attention_stats_reference
from vlkv.kernels.paged_decode import paged_decode_attention, paged_decode_reference

from vlkv_lab.bench import cost_model as cm

TAU = 50  # query rows for the statistics, as in the paper's speed benchmark


@dataclass(frozen=True)
class Layout:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int


LAYOUTS = {
    # LLaVA-Mistral-7B's language model (Mistral-7B): GQA 4.
    "7b": Layout("7B Mistral (d=4096, H=32, H_kv=8, D=128, ffn=14336, L=32)", 4096, 32, 8, 128, 14336, 32),
    "small": Layout("small (d=1024, H=16, H_kv=4, D=64, ffn=2816, L=24)", 1024, 16, 4, 64, 2816, 24),
}


def _timeit(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=max(20, reps * 10), return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class PrefillLayer:
    """One decoder layer's prefill: RMSNorm, QKV, causal SDPA (GQA), O, RMSNorm, SwiGLU MLP."""

    def __init__(self, lay: Layout, device: str, dtype: torch.dtype, chunk: int = 4096):
        def w(i, o):
            return torch.randn(i, o, device=device, dtype=dtype) * i**-0.5

        self.lay, self.chunk = lay, chunk
        self.w_qkv = w(lay.hidden, (lay.heads + 2 * lay.kv_heads) * lay.head_dim)
        self.w_o = w(lay.heads * lay.head_dim, lay.hidden)
        self.w_gu = w(lay.hidden, 2 * lay.ffn)
        self.w_down = w(lay.ffn, lay.hidden)

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lay, m = self.lay, x.shape[0]
        qkv = F.rms_norm(x, (lay.hidden,)) @ self.w_qkv
        q, k, v = qkv.split([lay.heads * lay.head_dim] + [lay.kv_heads * lay.head_dim] * 2, dim=-1)
        q = q.view(m, lay.heads, lay.head_dim).transpose(0, 1)[None]
        k = k.reshape(m, lay.kv_heads, lay.head_dim).transpose(0, 1)[None]
        v = v.reshape(m, lay.kv_heads, lay.head_dim).transpose(0, 1)[None]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + att[0].transpose(0, 1).reshape(m, -1) @ self.w_o
        for c0 in range(0, m, self.chunk):  # the MLP is per token: chunk it to bound activation memory
            h = F.rms_norm(x[c0 : c0 + self.chunk], (lay.hidden,)) @ self.w_gu
            gate, up = h.chunk(2, dim=-1)
            x[c0 : c0 + self.chunk] += (F.silu(gate) * up) @ self.w_down
        return x


def bench_stats(lay: Layout, ms: list[int], device: str, dtype: torch.dtype, reps: int, prefill_reps: int):
    rows = []
    layer = PrefillLayer(lay, device, dtype)
    layer(torch.randn(256, lay.hidden, device=device, dtype=dtype))  # warm-up
    for m in ms:
        q = torch.randn(lay.heads, TAU, lay.head_dim, device=device, dtype=dtype)
        k = torch.randn(lay.kv_heads, m, lay.head_dim, device=device, dtype=dtype)
        scale, start = lay.head_dim**-0.5, m - TAU
        row = {"m": m}
        kw = dict(q_start=start, scale=scale)
        row["ref_s"] = _timeit(partial(attention_stats_reference, q, k, **kw), device, reps)
        x = torch.randn(m, lay.hidden, device=device, dtype=dtype)
        row["prefill_s"] = _timeit(partial(layer, x), device, prefill_reps)
        if device == "cuda":
            row["triton_s"] = _timeit(partial(attention_stats, q, k, **kw), device, reps)
            qf = torch.randn(1, lay.heads, m, lay.head_dim, device=device, dtype=dtype)
            kf = torch.randn(1, lay.kv_heads, m, lay.head_dim, device=device, dtype=dtype)
            sdpa = partial(F.scaled_dot_product_attention, qf, kf, kf, is_causal=True, enable_gqa=True)
            row["sdpa_prefill_s"] = _timeit(sdpa, device, reps)
            # Unique bytes: Q and K read by kernels 1 and 2, col_sum written.
            nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + lay.heads * m * 4
            row["triton_GBps"] = nbytes / row["triton_s"] / 1e9
        stats_s = row.get("triton_s", row["ref_s"])
        row["share_pct"] = 100 * stats_s / row["prefill_s"]
        rows.append(row)
    return rows


def bench_decode(lay: Layout, points: list[tuple[int, int]], device: str, dtype: torch.dtype, reps: int):
    rows, page = [], 16
    for n_seq, length in points:
        n_blk = -(-length // page)
        pool_blocks = n_seq * n_blk + 64
        k_pool = torch.randn(pool_blocks, lay.kv_heads, page, lay.head_dim, device=device, dtype=dtype)
        v_pool = torch.randn_like(k_pool)
        ids = torch.randperm(pool_blocks, device=device)[: n_seq * n_blk].view(n_seq, n_blk).int()
        lengths = torch.full((n_seq,), length, device=device, dtype=torch.int32)
        q = torch.randn(n_seq, lay.heads, lay.head_dim, device=device, dtype=dtype)
        args, scale = (q, k_pool, v_pool, ids, lengths), lay.head_dim**-0.5
        kv_bytes = 2 * n_seq * length * lay.kv_heads * lay.head_dim * k_pool.element_size()
        row = {"S": n_seq, "length": length}
        row["ref_s"] = _timeit(partial(paged_decode_reference, *args, scale=scale), device, reps)
        if device == "cuda":
            kw = dict(scale=scale, max_length=length, validate=False)
            row["triton_s"] = _timeit(partial(paged_decode_attention, *args, **kw), device, reps)
            kd = torch.randn(n_seq, lay.kv_heads, length, lay.head_dim, device=device, dtype=dtype)
            sdpa = partial(F.scaled_dot_product_attention, q[:, :, None], kd, kd, enable_gqa=True)
            row["sdpa_dense_s"] = _timeit(sdpa, device, reps)
            row["triton_GBps"] = kv_bytes / row["triton_s"] / 1e9
        row["ref_GBps"] = kv_bytes / row["ref_s"] / 1e9
        rows.append(row)
        del k_pool, v_pool
    return rows


def _fmt(rows: list[dict], cols: list[tuple[str, str, float]]) -> str:
    head = " | ".join(f"{title:>12}" for title, _, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for _, key, mult in cols:
            v = r.get(key)
            cells.append(f"{'-':>12}" if v is None else f"{v * mult:>12.{0 if isinstance(v, int) else 2}f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _plot(stats_rows, decode_rows, lay: Layout, device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.5))
    ms = [r["m"] for r in stats_rows]
    key = "triton_s" if device == "cuda" else "ref_s"
    a1.loglog(ms, [r[key] * 1e3 * lay.layers for r in stats_rows], "o-", label=f"statistics ({key[:-2]})")
    a1.loglog(ms, [r["prefill_s"] * 1e3 * lay.layers for r in stats_rows], "s-", label="prefill attn+MLP")
    a1.set(xlabel="prompt length m", ylabel=f"ms, {lay.layers} layers", title=f"{device}: {TAU} query rows")
    a1.legend()
    a2.semilogx(ms, [r["share_pct"] for r in stats_rows], "o-")
    a2.axhline(5, color="r", ls="--", label="5% limit")
    a2.set(xlabel="prompt length m", ylabel="statistics / prefill (%)", title="overhead", ylim=(0, None))
    a2.legend()
    labels = [f"S={r['S']}\nL={r['length']}" for r in decode_rows]
    a3.bar(labels, [r.get("triton_s", r["ref_s"]) * 1e3 for r in decode_rows])
    a3.set(ylabel="ms per layer", title="paged decode " + ("(Triton)" if device == "cuda" else "(reference)"))
    fig.suptitle(lay.name, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _model_gpu(device: str) -> str | None:
    """The modelled GPU this CUDA device is (by name), else None."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((g for g in cm.GPUS if g in name), None)


def model_beside(lay: Layout, result: dict) -> str:
    """The cost model of a run's shapes (per layer) beside its measured figures; measured / modelled on a
    modelled GPU."""
    dev = result["device"]
    key = "triton_s" if dev == "cuda" else "ref_s"
    gpu = _model_gpu(dev)
    gpus = tuple(cm.GPUS)
    head = f"| shape | measured {dev} ms | " + " | ".join(f"{g} model ms" for g in gpus)
    head += f" | measured / modelled ({gpu}) |" if gpu else " |"
    lines = [head, "|" + " --- |" * (2 + len(gpus) + bool(gpu))]
    shapes = [
        (f"stats {TAU} rows, m={r['m']}", r, cm.attention_stats_costs(lay.heads, lay.kv_heads, TAU, r["m"], lay.head_dim))
        for r in result["stats"]
    ] + [
        (
            f"decode S={r['S']}, {r['length']} tokens",
            r,
            cm.paged_decode_costs(r["S"], r["length"], lay.heads, lay.kv_heads, lay.head_dim, sms=cm.GPUS[g].sms),
        )
        for r in result["decode"]
        for g in [gpu or "H100"]
    ]  # fmt: skip
    for name, row, costs in shapes:
        model = {g: sum(c.seconds(cm.GPUS[g]) for c in costs) for g in gpus}
        cells = [f"{model[g] * 1e3:.4g}" for g in gpus]
        measured = row.get(key)
        line = f"| {name} | {'-' if measured is None else f'{measured * 1e3:.2f}'} | " + " | ".join(cells)
        if gpu:
            line += f" | {measured / model[gpu]:.2f} |" if measured else " | - |"
        else:
            line += " |"
        lines.append(line)
    return "\n".join(lines)


def model_only(args, lay: Layout) -> None:
    cm.print_model()
    saved = sorted(args.out.glob("bench_kernels_*.json"))
    print(f"\nThe benchmark's shapes ({lay.name}, fp16 on the GPUs), per layer:")
    if not saved:
        empty = {"device": "cpu", "stats": [{"m": m} for m in (1024, 2048, 8192)]}
        empty["decode"] = [{"S": s, "length": n} for s, n in [(1, 1024), (8, 2048), (64, 2048)]]
        print(model_beside(lay, empty))
        print(f"(no measured run in {args.out}: `python -m vlkv_lab.bench.kernels` measures one)")
        return
    for path in saved:
        result = json.loads(path.read_text())
        if result.get("layout") != lay.name:
            continue
        print(f"measured figures: {path} ({result['device']}, {result['dtype']})")
        print(model_beside(lay, result))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", type=Path, default=Path("out/bench_kernels"))
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="7b")
    ap.add_argument("--m", type=str, default=None, help="comma-separated prompt lengths")
    default_dev = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", choices=["cuda", "cpu"], default=default_dev)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument(
        "--model-only", action="store_true", help="print the cost model beside the last run's figures"
    )
    args = ap.parse_args(argv)
    dev, lay = args.device, LAYOUTS[args.layout]
    if args.model_only:
        model_only(args, lay)
        return
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # CPU: fp32 (no fast bf16 GEMM on AVX2)
    if args.m:
        ms = [int(x) for x in args.m.split(",")]
    elif dev == "cuda":
        ms = [1024, 2048, 8192] if args.quick else [1024, 2048, 8192, 32768]
    else:
        ms = [1024, 2048] if args.quick else [1024, 2048, 8192]
    points = [(1, 1024), (8, 2048), (64, 2048)] + ([] if args.quick else [(64, 512), (64, 8192)])
    reps = 3 if args.quick else 7
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"device={dev} dtype={dtype} threads={torch.get_num_threads()} load avg={load}\nlayout={lay.name}")

    stats_rows = bench_stats(lay, ms, dev, dtype, reps, reps if dev == "cuda" else 1 if args.quick else 2)
    cols = [("m", "m", 1), ("ref ms", "ref_s", 1e3)]
    if dev == "cuda":
        cols += [
            ("triton ms", "triton_s", 1e3),
            ("GB/s", "triton_GBps", 1),
            ("sdpa ms", "sdpa_prefill_s", 1e3),
        ]
    cols += [("prefill ms", "prefill_s", 1e3), ("share %", "share_pct", 1)]
    cols += [(f"stats x{lay.layers} ms", "triton_s" if dev == "cuda" else "ref_s", 1e3 * lay.layers)]
    cols += [(f"prefill x{lay.layers} s", "prefill_s", lay.layers)]
    print(f"\nAttention statistics ({TAU} query rows) vs prefill attention+MLP, per layer "
          f"(x{lay.layers} layers for the model; the share is the same):")  # fmt: skip
    print(_fmt(stats_rows, cols))

    decode_rows = bench_decode(lay, points, dev, dtype, reps)
    cols = [("S", "S", 1), ("length", "length", 1), ("ref ms", "ref_s", 1e3), ("ref GB/s", "ref_GBps", 1)]
    if dev == "cuda":
        cols += [("triton ms", "triton_s", 1e3), ("GB/s", "triton_GBps", 1), ("sdpa ms", "sdpa_dense_s", 1e3)]
    print(f"\nPaged decode attention, one layer (page 16, H={lay.heads}, H_kv={lay.kv_heads}, "
          f"D={lay.head_dim}; sdpa = dense unpaged K/V):")  # fmt: skip
    print(_fmt(decode_rows, cols))

    result = dict(device=dev, layout=lay.name, dtype=str(dtype), stats=stats_rows, decode=decode_rows)
    print("\nRoofline model of the same shapes (cost_model.py; fp16 on the GPUs), per layer:")
    print(model_beside(lay, result))
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"bench_kernels_{dev}.png"
    _plot(stats_rows, decode_rows, lay, dev, png)
    (args.out / f"bench_kernels_{dev}.json").write_text(json.dumps(result, indent=1))
    print(f"\nsaved {png} and {png.with_suffix('.json')}")


if __name__ == "__main__":
    main()
