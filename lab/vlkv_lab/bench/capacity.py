"""Past 10x (issue 19): sequences one decode pool holds with int8 compact caches and decode re-compression,
the wire bytes of such a cache, and decode speed int8 vs fp16 on this machine.

``python -m vlkv_lab.bench.capacity [--quick] [--pool-gib 4] [--out out/bench_capacity]``
(``vlkv bench capacity``)

1. Capacity, on the full 32-layer LLaVA-Mistral-7B layout (8 KV heads, head dim 128, 16-token blocks), in
   the same pool bytes, with the decode worker's own ``KVCache`` sizing (on the meta device: int8 blocks
   count their fp16 scales), ``BlockManager`` (grow admission, 1% watermark), ``Scheduler`` and the
   decode core's re-compression rule (``block_manager.recompress_target`` + ``shrink``): 2K-token prompts,
   each request generating a uniform random 100-200 tokens (fixed seed). Cases: 100% fp16, 10% fp16,
   10% int8, 10% int8 + decode re-compression (``--decode-budget`` x prompt-time tokens +
   ``--decode-window``). Admitted: caches taken by an empty pool one after another until admission
   refuses; sustained: a closed loop (a new cache whenever admission takes one), the mean number
   decoding per step over the last two thirds of ``3 x 200`` steps, with host swap space equal to the
   pool (the server's default): a preempted sequence that does not fit there fails, and is counted.
   The 10% caches are VL-Cache-like uneven per-layer budgets (``admission.uneven_lengths``).
2. Wire bytes: every serialized message (header, data chunks with their CRCs, trailer) of a 10% int8
   cache against the full fp16 cache of the same 2K prompt (random K/V of the 7B layout), metadata
   included (the 10% cache's header also carries its prompt-time scores, 2 bytes per kept token per layer).
3. Decode throughput on this CPU: ``ModelRunner.step`` (the real language model with paged attention:
   the torch reference, which dequantizes inside) on the 7B layout truncated to ``--layers`` layers, fp32
   weights, one torch thread, 10% caches of 2K prompts in a pool stored in the model's dtype ("fp16" here
   means the model's dtype, fp32 on this CPU) and in int8. Beside each: the bytes one step reads
   (weights + K/V + scales) and the bound that puts on tokens/s at this machine's measured read bandwidth,
   and the time inside paged attention against its own bound (K/V bytes / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.quantize import quantize_compact
from vlkv.common.handoff.wire import compact_layers, encode_compact_kv
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import AdmissionPolicy, BlockManager, SequenceBlocks, recompress_target
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner, StepInput
from vlkv.decode_worker.scheduler import Scheduler
from vlkv.decode_worker.sequence import Sequence

from vlkv_lab.bench.admission import BLOCK_SIZE, GIB, LAYOUT_7B, WATERMARK, uneven_lengths

PROMPT = 2048
NEW_MIN, NEW_MAX = 100, 200
BUDGET = 0.10
DECODE_BUDGET, DECODE_WINDOW = 1.0, 32
ADMIT_TARGET, SUSTAIN_TARGET, WIRE_TARGET = 18.0, 15.0, 0.055


@dataclass(frozen=True)
class Case:
    name: str
    budget: float
    kv_dtype: str
    decode_budget: float = 0.0


def cases(decode_budget: float) -> list[Case]:
    return [
        Case("100% fp16", 1.0, "fp16"),
        Case("10% fp16", BUDGET, "fp16"),
        Case("10% int8", BUDGET, "int8"),
        Case("10% int8 + decode re-compression", BUDGET, "int8", decode_budget),
    ]


def meta_cache(pool_bytes: int, kv_dtype: str) -> KVCache:
    lay = LAYOUT_7B
    return KVCache.from_bytes(
        pool_bytes, BLOCK_SIZE, lay.kv_heads, lay.head_dim, torch.float16, "meta", kv_dtype=kv_dtype
    )


def case_lengths(case: Case) -> list[int]:
    return (
        [PROMPT] * LAYOUT_7B.layers
        if case.budget >= 1
        else uneven_lengths(PROMPT, case.budget, LAYOUT_7B.layers)
    )


def _pool(cache: KVCache) -> BlockManager:
    n = cache.num_blocks
    return BlockManager(n, BLOCK_SIZE, AdmissionPolicy.from_config("grow", WATERMARK, n))


def admitted(pool_bytes: int, case: Case) -> int:
    pool, lengths, n = _pool(meta_cache(pool_bytes, case.kv_dtype)), case_lengths(case), 0
    while isinstance(pool.admit(lengths, NEW_MAX), SequenceBlocks):
        n += 1
    return n


def sustained(pool_bytes: int, case: Case, window: int, seed: int = 0) -> dict:
    """Closed loop through the scheduler (and the re-compression rule): mean decoding, preemptions, failed."""
    cache = meta_cache(pool_bytes, case.kv_dtype)
    pool, lengths = _pool(cache), case_lengths(case)
    sched: Scheduler[Sequence] = Scheduler(pool, 1 << 30, pool_bytes, cache.token_bytes)
    rng = random.Random(seed)
    steps, counts, finished, failed, evicted = 3 * NEW_MAX, [], 0, 0, 0
    for step in range(steps):
        while True:
            want = rng.randint(NEW_MIN, NEW_MAX)
            blocks = pool.admit(lengths, want, len(sched.swapped))
            if not isinstance(blocks, SequenceBlocks):
                break
            sched.add(
                Sequence(str(step), blocks, list(lengths), PROMPT, 0, SamplingConfig(max_new_tokens=want))
            )
        plan = sched.schedule()
        failed += len(plan.failed)
        counts.append(len(plan.running))
        for seq in plan.running:  # the step: one token per running sequence, then the core's re-compression
            seq.lengths = [n + 1 for n in seq.lengths]
            seq.generated.append(0)
            for layer, n in enumerate(seq.lengths):
                target = recompress_target(
                    seq.prompt_lengths[layer], n, case.decode_budget, window, BLOCK_SIZE
                )
                if target < n:
                    pool.shrink(seq.blocks, layer, target)
                    seq.lengths[layer] = target
                    evicted += n - target
            if len(seq.generated) >= seq.sampling.max_new_tokens:
                sched.finish(seq)
                finished += 1
    tail = counts[steps // 3 :]
    return {
        "mean_running": sum(tail) / len(tail),
        "preemptions": sched.preemptions,
        "failed": failed,
        "finished": finished,
        "evicted_tokens": evicted,
        "num_blocks": cache.num_blocks,
        "block_bytes": cache.block_bytes,
    }


@dataclass
class CapacityRow:
    case: str
    kv_dtype: str
    decode_budget: float
    k_total: int
    num_blocks: int
    block_bytes: int
    admitted: int
    admitted_vs_full: float
    sustained: float
    sustained_vs_full: float
    preemptions: int
    failed: int
    finished: int


def capacity(pool_bytes: int, decode_budget: float, window: int) -> list[CapacityRow]:
    rows: list[CapacityRow] = []
    for case in cases(decode_budget):
        n, sus = admitted(pool_bytes, case), sustained(pool_bytes, case, window)
        full_n = rows[0].admitted if rows else n
        full_s = rows[0].sustained if rows else sus["mean_running"]
        rows.append(
            CapacityRow(case.name, case.kv_dtype, case.decode_budget, sum(case_lengths(case)), sus["num_blocks"],
                        sus["block_bytes"], n, n / full_n, sus["mean_running"], sus["mean_running"] / full_s,
                        sus["preemptions"], sus["failed"], sus["finished"])
        )  # fmt: skip
    return rows


# -- wire bytes ---------------------------------------------------------------------------------------------
def _random_cache(lengths: list[int], seed: int = 0, scored: bool = False) -> CompactKV:
    """``scored``: with the prompt-time scores a compressing policy sends in the header (fp16 per token)."""
    lay, g = LAYOUT_7B, torch.Generator().manual_seed(seed)
    keys = [torch.randn(lay.kv_heads, n, lay.head_dim, generator=g).half() for n in lengths]
    values = [torch.randn(lay.kv_heads, n, lay.head_dim, generator=g).half() for n in lengths]
    scores = [torch.rand(n, generator=g).half() for n in lengths] if scored else None
    return CompactKV(keys, values, prompt_length=PROMPT, first_token=1, prompt_scores=scores)


def _stream_bytes(ckv: CompactKV) -> int:
    return sum(len(m) for m in encode_compact_kv(ckv, request_id="r" * 36, fingerprint="f" * 64, wire=True))


def wire_bytes() -> dict:
    full = _stream_bytes(_random_cache([PROMPT] * LAYOUT_7B.layers))
    small = _random_cache(uneven_lengths(PROMPT, BUDGET, LAYOUT_7B.layers), seed=1, scored=True)
    fp16_10, int8_10 = _stream_bytes(small), _stream_bytes(quantize_compact(small, "int8"))
    return {"full_fp16": full, "10%_fp16": fp16_10, "10%_int8": int8_10, "int8_share": int8_10 / full}


# -- decode throughput -----------------------------------------------------------------------------------------
def read_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes per second one thread reads (a sum over a tensor much larger than the caches)."""
    x = torch.ones(mib << 18)  # fp32
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times)


def _side(model, kv_dtype: str, lengths: list[int], batch: int, steps: int):
    from vlkv_lab.bench.decode import DTYPE

    lay = LAYOUT_7B
    n_blocks = batch * sum(math.ceil((n + steps + 1) / BLOCK_SIZE) for n in lengths)
    cache = KVCache(n_blocks, BLOCK_SIZE, lay.kv_heads, lay.head_dim, DTYPE, kv_dtype=kv_dtype)
    blocks = BlockManager(n_blocks, BLOCK_SIZE)
    ckv = _random_cache(lengths)
    ckv = CompactKV([k.to(DTYPE) for k in ckv.keys], [v.to(DTYPE) for v in ckv.values], prompt_length=PROMPT)
    ckv = quantize_compact(ckv, kv_dtype)
    layers = list(compact_layers(ckv))
    seqs = []
    for _ in range(batch):
        seq = blocks.allocate(lengths, steps + 1)
        for table, tensors in zip(seq.tables, layers, strict=True):
            cache.write(table, *tensors)
        seqs.append([seq, list(lengths)])
    return ModelRunner(model, cache), seqs, cache


def throughput(layers: int, batch: int, reps: int) -> list[dict]:
    from vlkv_lab.bench.decode import _AttentionTimer, build_model, weight_bytes_per_step

    torch.set_num_threads(1)
    model = build_model(layers)
    lengths = uneven_lengths(PROMPT, BUDGET, LAYOUT_7B.layers)[:layers]
    bw = read_bandwidth()
    sides = {d: _side(model, d, lengths, batch, reps + 1) for d in ("fp16", "int8", "fp8")}
    times: dict[str, list[float]] = {d: [] for d in sides}
    attn: dict[str, list[float]] = {d: [] for d in sides}
    timer = _AttentionTimer()
    with timer.installed():
        for step in range(reps + 1):  # interleaved: both see the same machine load; step 0 warms up
            for d, (runner, seqs, _cache) in sides.items():
                inputs = [StepInput(1, PROMPT + step, s.tables, n) for s, n in seqs]
                a0, t0 = timer.seconds, time.perf_counter()
                runner.step(inputs)
                if step:
                    times[d].append(time.perf_counter() - t0)
                    attn[d].append(timer.seconds - a0)
                for item in seqs:
                    item[1] = [n + 1 for n in item[1]]
    weights = weight_bytes_per_step(model, layers, batch)
    rows = []
    for d, (_runner, _seqs, cache) in sides.items():
        tokens = sum(n + 1 for n in lengths) + reps // 2  # mid-run cached tokens per sequence, all layers
        kv = batch * tokens * cache.token_bytes  # K/V (and int8 scales) read per step
        sec = statistics.median(times[d])
        rows.append({
            "kv_dtype": d, "batch": batch, "layers": layers, "ms_per_step": sec * 1000,
            "ms_attention": statistics.median(attn[d]) * 1000, "attention_bound_ms": kv / bw * 1000,
            "tokens_per_s": batch / sec, "weight_bytes": weights, "kv_bytes": kv,
            "bound_tokens_per_s": batch * bw / (weights + kv), "kv_only_bound_tokens_per_s": batch * bw / kv,
            "read_gbps": bw / 1e9,
        })  # fmt: skip
    return rows


# -- report ----------------------------------------------------------------------------------------------------
def report(rows: list[CapacityRow], wire: dict, speed: list[dict], pool_bytes: int, window: int) -> str:
    best = rows[-1]
    md = [
        f"# Capacity past 10x: int8 compact caches and decode re-compression ({pool_bytes / GIB:.1f} GiB pool)",
        "",
        f"Full 32-layer 7B layout, {PROMPT}-token prompts, {NEW_MIN}-{NEW_MAX} new tokens each, {BLOCK_SIZE}-token "
        f"blocks, grow admission, swap space = pool; 10% = VL-Cache-like uneven budgets; re-compression: "
        f"{best.decode_budget:g} x prompt-time tokens + {window}.",
        "",
        "| cache | kv dtype | blocks in pool | block bytes | tokens at admission | admitted | vs 100% fp16 | "
        "sustained (mean decoding) | vs 100% fp16 | preemptions | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r.case} | {r.kv_dtype} | {r.num_blocks} | {r.block_bytes} | {r.k_total} | {r.admitted} | "
            f"{r.admitted_vs_full:.2f}x | {r.sustained:.1f} | {r.sustained_vs_full:.2f}x | {r.preemptions} | {r.failed} |"
        )
    ok = lambda good: "meets" if good else "MISSES"  # noqa: E731
    md += [
        "",
        f"10% int8 + re-compression: {best.admitted_vs_full:.2f}x admitted ({ok(best.admitted_vs_full >= ADMIT_TARGET)} "
        f"the {ADMIT_TARGET:g}x target), {best.sustained_vs_full:.2f}x sustained ({ok(best.sustained_vs_full >= SUSTAIN_TARGET)} "
        f"the {SUSTAIN_TARGET:g}x target), {best.failed} requests failed.",
        "",
        "## Wire bytes of one cache (every serialized message, metadata included)",
        "",
        "| cache | bytes | share of full fp16 |",
        "|---|---:|---:|",
    ]
    for name in ("full_fp16", "10%_fp16", "10%_int8"):
        md.append(f"| {name} | {wire[name]} | {wire[name] / wire['full_fp16']:.2%} |")
    md += ["", f"10% int8: {wire['int8_share']:.2%} of the full fp16 cache ({ok(wire['int8_share'] <= WIRE_TARGET)} "
           f"the {WIRE_TARGET:.1%} target)."]  # fmt: skip
    if speed:
        s = speed[0]
        md += [
            "",
            f"## Decode throughput on this CPU ({s['layers']} of 32 layers, batch {s['batch']}, 10% caches of "
            f"{PROMPT}-token prompts, fp32 weights, 1 thread; read bandwidth {s['read_gbps']:.1f} GB/s)",
            "",
            "| pool | ms per step | tokens/s | weights read per step | K/V read per step | bytes-read bound "
            "(tokens/s) | share of bound | ms in paged attention | its bytes-read bound (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in speed:
            name = r["kv_dtype"] if r["kv_dtype"] != "fp16" else "model dtype (fp32)"
            md.append(
                f"| {name} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['weight_bytes'] / 2**20:.0f} MiB "
                f"| {r['kv_bytes'] / 2**20:.1f} MiB | {r['bound_tokens_per_s']:.1f} | "
                f"{r['tokens_per_s'] / r['bound_tokens_per_s']:.0%} | {r['ms_attention']:.1f} | "
                f"{r['attention_bound_ms']:.1f} |"
            )
    return "\n".join(md)


def plot(rows: list[CapacityRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.admitted for r in rows], width=0.4, label="admitted")
    ax.bar([i + 0.2 for i in x], [r.sustained for r in rows], width=0.4, label="sustained (mean decoding)")
    ax.set_xticks(list(x), [r.case.replace(" + ", "\n+ ") for r in rows], fontsize=8)
    ax.set_ylabel("sequences in one pool")
    ax.set_title("2K prompts, 100-200 new tokens, same KV memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: str, quick: bool, pool_gib: float = 4.0, decode_budget: float = DECODE_BUDGET,
        window: int = DECODE_WINDOW, layers: int = 2, batch: int = 32) -> int:  # fmt: skip
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    pool_bytes = int(pool_gib * GIB)
    rows = capacity(pool_bytes, decode_budget, window)
    wire = wire_bytes()
    speed = throughput(layers, 8 if quick else batch, 3 if quick else 10)
    md = report(rows, wire, speed, pool_bytes, window)
    (out_dir / "capacity.md").write_text(md + "\n")
    (out_dir / "capacity.json").write_text(
        json.dumps({"rows": [asdict(r) for r in rows], "wire": wire, "throughput": speed}, indent=2)
    )
    plot(rows, out_dir / "capacity.png")
    print(md)
    print(f"wrote {out_dir / 'capacity.md'}, capacity.json and capacity.png")
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/bench_capacity")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--decode-budget", type=float, default=DECODE_BUDGET)
    ap.add_argument("--decode-window", type=int, default=DECODE_WINDOW)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    run(a.out, a.quick, a.pool_gib, a.decode_budget, a.decode_window, a.layers, a.batch)


if __name__ == "__main__":
    main()
