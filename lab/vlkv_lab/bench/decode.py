"""Benchmark of the decode worker: admission into one pool and decode throughput, 10% vs 100% caches.

``python -m vlkv_lab.bench.decode [--quick] [--out out/bench_decode] [--max-kv-gb 8]``

On a LLaVA-Mistral-7B text layout (hidden 4096, 32 query heads, 8 KV heads, head dim 128, MLP 14336,
vocab 32000), side by side in one run:

1. Admission: ``bench_admission`` (the decode worker's ``BlockManager``, ``AdmissionPolicy`` and ``Scheduler`` on
   the full 32-layer layout, no model): 2K-token sequences admitted into the same pool bytes, and
   sustained while each generates 100 tokens, with 10% caches (uniform and VL-Cache-like uneven ``k_l``)
   vs 100% caches, under both admission policies.
2. Decode throughput of ``ModelRunner.step`` (the real LLaVA language model, paged decode attention) on
   the layout truncated to ``--layers`` layers, random weights, fp32, one torch thread by default
   (``--threads``): batch sizes 1, 8, 32, 64 at prompt lengths 2K and 8K, with pools filled with random
   K/V through ``KVCache.write`` (10%: ``ceil(0.1 m)`` tokens per layer; 100%: m). The 100% and 10% steps are interleaved (a warm-up step
   each, then ``--reps`` timed steps each), so both see the same machine load; the speedup is the median
   of the per-repeat ratios. Beside it: the ideal speedup from bytes read per step,
   ``(weights + KV at 100%) / (weights + KV at 10%)``, and the share of it reached. Configurations whose
   100% pool would exceed ``--max-kv-gb`` are skipped (their 10% side still runs).

On CPU the paged decode attention is the pure-torch reference (the Triton kernel needs CUDA). The time
spent inside it is measured by wrapping the ``paged_decode_attention`` name the model runner calls, for
this process only. Writes ``bench_decode.md``, ``.json`` and ``.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from vlkv.common.block_math import ceil_div
from vlkv.common.model.loading import language_model
from vlkv.decode_worker import model_runner as runner_module
from vlkv.decode_worker.block_manager import BlockManager
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner, StepInput

from vlkv_lab.bench.admission import (
    BLOCK_SIZE,
    BUDGET,
    GIB,
    LAYOUT_7B,
    Layout,
    admission,
    admission_table,
    uniform_lengths,
)

GAIN_MIN = 0.1  # the gain share (measured - 1) / (ideal - 1) is shown only where the ideal is >= 1.1x
DTYPE = torch.float32  # fp32 matmuls beat bf16 on this CPU (no AVX-512 BF16); see the module notes


def _fmt_gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# -- 2. decode throughput --------------------------------------------------------------------------------


def build_model(layers: int, dtype: torch.dtype = DTYPE, seed: int = 0):
    """Random-init LLaVA with the 7B text shape truncated to ``layers`` layers and a tiny vision tower.

    transformers' own initialisation of ~0.7 G parameters takes tens of seconds on two cores, so the
    model is built without it and every matrix is filled with one block of uniform random numbers
    (std 0.02) tiled over it; norms are 1, biases 0. The values do not change the timing.
    """
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, MistralConfig
    from transformers.initialization import no_init_weights

    lay = LAYOUT_7B
    text = MistralConfig(
        vocab_size=lay.vocab, hidden_size=lay.hidden, intermediate_size=lay.ffn, num_hidden_layers=layers,
        num_attention_heads=lay.heads, num_key_value_heads=lay.kv_heads, head_dim=lay.head_dim,
        max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=16, projection_dim=32,
    )  # fmt: skip
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=lay.vocab - 1, image_seq_length=4,
        tie_word_embeddings=False,
    )  # fmt: skip
    with no_init_weights():
        model = LlavaForConditionalGeneration(cfg)
    model = model.to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    tile = torch.empty(1_000_003).uniform_(-0.02 * 3**0.5, 0.02 * 3**0.5, generator=gen).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                flat = p.view(-1)
                full, rest = divmod(flat.numel(), tile.numel())
                if full:
                    flat[: full * tile.numel()].view(full, -1).copy_(tile.expand(full, -1))
                flat[full * tile.numel() :].copy_(tile[:rest])
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return model


def weight_bytes_per_step(model, layers: int, batch: int) -> int:
    """Weights one step reads: the decoder layers, the final norm, lm_head and ``batch`` embedding rows."""
    lm = language_model(model)
    params = [p for layer in lm.layers[:layers] for p in layer.parameters()]
    params += list(lm.norm.parameters()) + list(model.lm_head.parameters())
    emb = lm.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in params) + batch * emb.shape[1] * emb.element_size()


def kv_bytes_per_step(batch: int, lengths: list[int], elem: int, lay: Layout = LAYOUT_7B) -> int:
    """K and V one step reads: every cached token plus the new one, in every layer, for each sequence."""
    return batch * sum(n + 1 for n in lengths) * 2 * lay.kv_heads * lay.head_dim * elem


class _AttentionTimer:
    """Wraps the name ``model_runner.paged_decode_attention`` to add up the seconds spent inside it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = runner_module.paged_decode_attention

    def _timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._orig(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def installed(self):
        runner_module.paged_decode_attention = self._timed
        try:
            yield self
        finally:
            runner_module.paged_decode_attention = self._orig


class Side:
    """One cache budget's blocks, K/V cache, runner and ``n_seqs`` sequences of one prompt length."""

    def __init__(self, model, m: int, lengths: list[int], n_seqs: int, reserve: int, seed: int) -> None:
        lay = LAYOUT_7B
        self.m, self.initial = m, lengths
        blocks = n_seqs * sum(ceil_div(n + reserve, BLOCK_SIZE) for n in lengths)
        self.blocks = BlockManager(blocks, BLOCK_SIZE)
        self.cache = KVCache(blocks, BLOCK_SIZE, lay.kv_heads, lay.head_dim, DTYPE)
        self.runner = ModelRunner(model, self.cache)
        gen = torch.Generator().manual_seed(seed)
        # One random cache per layer, written into every sequence's own blocks (timing does not depend
        # on the values; distinct blocks keep the memory traffic real).
        kv = [
            (torch.randn(lay.kv_heads, n, lay.head_dim, generator=gen, dtype=DTYPE),
             torch.randn(lay.kv_heads, n, lay.head_dim, generator=gen, dtype=DTYPE))
            for n in lengths
        ]  # fmt: skip
        self.seqs = []
        for i in range(n_seqs):
            seq = self.blocks.allocate(lengths, reserve)
            assert seq is not None, "the pool was sized for these sequences"
            for table, (k, v) in zip(seq.tables, kv, strict=True):
                self.cache.write(table, k, v)
            self.seqs.append({"blocks": seq, "lengths": list(lengths), "steps": 0, "token": 1 + i})
        del kv

    def step(self, batch: int, timer: _AttentionTimer) -> tuple[float, float]:
        """One decode step of the first ``batch`` sequences -> (seconds, seconds in attention)."""
        seqs = self.seqs[:batch]
        inputs = [StepInput(s["token"], self.m + s["steps"], s["blocks"].tables, s["lengths"]) for s in seqs]
        attn0 = timer.seconds
        t0 = time.perf_counter()
        logits = self.runner.step(inputs)
        dt = time.perf_counter() - t0
        for s, row in zip(seqs, logits, strict=True):
            s["token"], s["steps"] = int(row.argmax()), s["steps"] + 1
            s["lengths"] = [n + 1 for n in s["lengths"]]
        return dt, timer.seconds - attn0


@dataclass
class ThroughputRow:
    prompt: int
    batch: int
    ms_full: float | None  # median step time, 100% caches (None: skipped)
    ms_small: float  # median step time, 10% caches
    attn_share_full: float | None  # share of the step inside paged attention
    attn_share_small: float
    measured: float | None  # median of per-repeat (100% time / 10% time)
    ideal: float  # bytes read per step, truncated model
    ideal_32l: float  # the same for the full 32-layer model
    full_pool_bytes: int  # what the 100% pool for this batch needs
    kv_full_bytes: int
    kv_small_bytes: int
    weight_bytes: int
    steps_full: list[tuple[float, float]]  # every timed step: (seconds, seconds in attention)
    steps_small: list[tuple[float, float]]

    @property
    def ratios(self) -> list[float]:
        """Per-repeat 100% / 10% step-time ratios (the two steps of a repeat run back to back)."""
        return [f[0] / s[0] for f, s in zip(self.steps_full, self.steps_small, strict=True)]

    @property
    def share(self) -> float | None:
        return None if self.measured is None else self.measured / self.ideal

    @property
    def gain_share(self) -> float | None:
        return None if self.measured is None else (self.measured - 1) / (self.ideal - 1)


def _measure(full: Side | None, small: Side, batch: int, reps: int, timer: _AttentionTimer):
    """A warm-up step per side, then ``reps`` steps per side alternating 100% and 10%.

    Returns the per-step ``(seconds, attention seconds)`` lists of the 100% side (empty without one)
    and the 10% side."""
    sides = [s for s in (full, small) if s is not None]
    for side in sides:
        side.step(batch, timer)
    times: list[list[tuple[float, float]]] = [[] for _ in sides]
    for _ in range(reps):
        for side, t in zip(sides, times, strict=True):
            t.append(side.step(batch, timer))
    return (times[0], times[1]) if full is not None else ([], times[0])


def _median_s(times: list[tuple[float, float]]) -> float:
    return statistics.median(t for t, _ in times)


def _attn_share(times: list[tuple[float, float]]) -> float:
    return sum(a for _, a in times) / sum(t for t, _ in times)


def throughput(
    model,
    layers: int,
    prompts: list[int],
    batches: list[int],
    reps: int,
    max_kv_bytes: int,
    log=print,
) -> list[ThroughputRow]:
    lay, elem = LAYOUT_7B, torch.empty((), dtype=DTYPE).element_size()
    reserve = len(batches) * (1 + reps)  # the first sequence decodes in every batch size
    per_layer_w = weight_bytes_per_step(model, 1, 0) - weight_bytes_per_step(model, 0, 0)
    timer = _AttentionTimer()
    block_bytes = 2 * lay.kv_heads * BLOCK_SIZE * lay.head_dim * elem

    def pool_bytes(b: int, lengths: list[int]) -> int:
        return b * sum(ceil_div(n + reserve, BLOCK_SIZE) for n in lengths) * block_bytes

    rows = []
    for m in prompts:
        full_len, small_len = [m] * layers, uniform_lengths(m, BUDGET, layers)
        fits = [b for b in batches if pool_bytes(b, full_len) <= max_kv_bytes]
        t0 = time.perf_counter()
        full = Side(model, m, full_len, max(fits), reserve, seed=m) if fits else None
        small = Side(model, m, small_len, max(batches), reserve, seed=m + 1)
        log(f"  [{m / 1024:g}K] pools filled in {time.perf_counter() - t0:.1f} s "
            f"(100%: {_fmt_gib(full.cache.k.numel() * elem * 2) if full else 'none'}, "
            f"10%: {_fmt_gib(small.cache.k.numel() * elem * 2)})", flush=True)  # fmt: skip
        with timer.installed():
            for b in batches:
                t_full, t_small = _measure(
                    full if full and b <= len(full.seqs) else None, small, b, reps, timer
                )
                measured = None
                if t_full:
                    measured = statistics.median(f[0] / s[0] for f, s in zip(t_full, t_small, strict=True))
                w = weight_bytes_per_step(model, layers, b)
                kv_f, kv_s = kv_bytes_per_step(b, full_len, elem), kv_bytes_per_step(b, small_len, elem)
                w32 = w + (lay.layers - layers) * per_layer_w
                per_layer = lay.layers / layers
                row = ThroughputRow(
                    prompt=m, batch=b,
                    ms_full=1e3 * _median_s(t_full) if t_full else None,
                    ms_small=1e3 * _median_s(t_small),
                    attn_share_full=_attn_share(t_full) if t_full else None,
                    attn_share_small=_attn_share(t_small),
                    measured=measured, ideal=(w + kv_f) / (w + kv_s),
                    ideal_32l=(w32 + kv_f * per_layer) / (w32 + kv_s * per_layer),
                    full_pool_bytes=pool_bytes(b, full_len), kv_full_bytes=kv_f, kv_small_bytes=kv_s,
                    weight_bytes=w, steps_full=t_full, steps_small=t_small,
                )  # fmt: skip
                rows.append(row)
                log("  " + _progress(row, max_kv_bytes), flush=True)
        del full, small
        gc.collect()
    return rows


def _progress(r: ThroughputRow, cap: int) -> str:
    small = f"10%: {r.ms_small:8.1f} ms/step {r.batch / r.ms_small * 1e3:7.1f} tok/s"
    if r.measured is None:
        return (f"m={r.prompt:5d} batch={r.batch:2d}  100%: skipped (pool needs "
                f"{_fmt_gib(r.full_pool_bytes)} > cap {_fmt_gib(cap)})  {small}  ideal {r.ideal:.2f}x")  # fmt: skip
    return (f"m={r.prompt:5d} batch={r.batch:2d}  100%: {r.ms_full:8.1f} ms/step "
            f"{r.batch / r.ms_full * 1e3:7.1f} tok/s  {small}  speedup {r.measured:.2f}x "
            f"[{min(r.ratios):.2f}-{max(r.ratios):.2f}] "
            f"(ideal {r.ideal:.2f}x, {100 * r.share:.0f}% of it)")  # fmt: skip


def throughput_table(rows: list[ThroughputRow], cap: int) -> str:
    lines = [
        "| prompt | batch | tok/s 100% | tok/s 10% | ms/step 100% | ms/step 10% | measured speedup [range] "
        "| ideal (bytes) | measured / ideal | gain share | attention share of step 100% / 10% "
        "| ideal, 32 layers |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        small_tps = f"{r.batch / r.ms_small * 1e3:.1f}"
        if r.measured is None:
            lines.append(
                f"| {r.prompt / 1024:g}K | {r.batch} | skipped: needs {_fmt_gib(r.full_pool_bytes)} > "
                f"{_fmt_gib(cap)} | {small_tps} | - | {r.ms_small:.0f} | - | {r.ideal:.2f}x | - | - "
                f"| - / {100 * r.attn_share_small:.0f}% | {r.ideal_32l:.2f}x |"
            )
            continue
        gain = f"{100 * r.gain_share:.0f}%" if r.ideal >= 1 + GAIN_MIN else "n/a"
        lines.append(
            f"| {r.prompt / 1024:g}K | {r.batch} | {r.batch / r.ms_full * 1e3:.1f} | {small_tps} "
            f"| {r.ms_full:.0f} | {r.ms_small:.0f} | {r.measured:.2f}x [{min(r.ratios):.2f}-{max(r.ratios):.2f}] "
            f"| {r.ideal:.2f}x "
            f"| {100 * r.share:.0f}% | {gain} "
            f"| {100 * r.attn_share_full:.0f}% / {100 * r.attn_share_small:.0f}% | {r.ideal_32l:.2f}x |"
        )
    done = [r for r in rows if r.measured is not None]
    if done:
        lines += [
            "",
            f"Measured speedup {min(r.measured for r in done):.2f}x-{max(r.measured for r in done):.2f}x "
            f"against an ideal of {min(r.ideal for r in done):.2f}x-{max(r.ideal for r in done):.2f}x; "
            f"measured / ideal {100 * min(r.share for r in done):.0f}%-{100 * max(r.share for r in done):.0f}% "
            f"(median {100 * statistics.median(r.share for r in done):.0f}%).",
        ]
        big = [r for r in done if r.ideal >= 1 + GAIN_MIN]
        if big:
            lines.append(
                f"Where the ideal is >= {1 + GAIN_MIN:g}x ({len(big)} configurations): gain share "
                f"{100 * min(r.gain_share for r in big):.0f}%-{100 * max(r.gain_share for r in big):.0f}% "
                f"(median {100 * statistics.median(r.gain_share for r in big):.0f}%)."
            )
    return "\n".join(lines)


def plot(rows: list[ThroughputRow], prompts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(prompts), figsize=(5.5 * len(prompts), 4.2), squeeze=False)
    for ax, m in zip(axes[0], prompts, strict=True):
        rs = [r for r in rows if r.prompt == m]
        ax.plot([r.batch for r in rs], [r.ideal for r in rs], "--o", color="grey", label="ideal (bytes read)")
        done = [r for r in rs if r.measured is not None]
        err = [
            [r.measured - min(r.ratios) for r in done],
            [max(r.ratios) - r.measured for r in done],
        ]
        ax.errorbar([r.batch for r in done], [r.measured for r in done], yerr=err, fmt="-o", color="C0",
                    capsize=3, label="measured (median, min-max of repeats)")  # fmt: skip
        for r in rs:
            if r.measured is None:
                ax.annotate("100% skipped\n(memory cap)", (r.batch, r.ideal), textcoords="offset points",
                            xytext=(-8, -4), ha="right", va="top", fontsize=8)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks([r.batch for r in rs], [str(r.batch) for r in rs])
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode speedup, 10% vs 100% caches")
        ax.set_title(f"{m / 1024:g}K-token prompts")
        ax.legend()
    fig.suptitle("vlkv decode step (CPU, torch paged-decode reference, fp32)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------------


def machine() -> dict:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "loadavg_start": load,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 layer, 3 timed steps")
    ap.add_argument("--out", default="out/bench_decode")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 2, 1 with --quick)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per side (default 9, 3 with --quick)")
    ap.add_argument("--max-kv-gb", type=float, default=8.0, help="skip 100%% pools above this (GiB)")
    ap.add_argument("--pool-gib", type=float, default=2.0, help="admission pool size (GiB)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see the notes)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompts", default="2048,8192")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = args.layers or (1 if args.quick else 2)
    reps = args.reps or (3 if args.quick else 9)
    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    cap = int(args.max_kv_gb * GIB)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    mach = machine()
    header = [
        "# vlkv decode benchmark",
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} ({mach['torch_threads']} "
        f"threads), transformers {mach['transformers']}; load average at start {mach['loadavg_start']}.",
        "Paged decode attention: the pure-torch reference on CPU (the Triton kernel needs CUDA).",
        "",
    ]
    print("\n".join(header), flush=True)

    print("## 1. Admission into one pool (BlockManager accounting)\n", flush=True)
    adm = admission(int(args.pool_gib * GIB))
    adm_text = admission_table(adm)
    print(adm_text + "\n", flush=True)

    print(f"## 2. Decode throughput ({layers} of 32 layers, fp32, block size {BLOCK_SIZE})\n", flush=True)
    t0 = time.perf_counter()
    model = build_model(layers)
    print(f"  model built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = throughput(model, layers, prompts, batches, reps, cap)
    tp_text = throughput_table(rows, cap)
    with open("/proc/loadavg") as f:
        mach["loadavg_end"] = " ".join(f.read().split()[:3])
    elapsed = time.perf_counter() - t_start
    notes = [
        f"Model: random-init LlavaForConditionalGeneration, Mistral-7B text shape truncated to {layers} "
        "layer(s), tiny CLIP vision tower (unused by decode), fp32 weights and KV (bf16 matmuls are slower "
        "on this CPU, which lacks AVX-512 BF16).",
        f"torch threads: {args.threads}. One thread is the default because this small VM is shared: with "
        "two, every OpenMP region waits for a thread the other processes keep descheduled (a 256-token "
        "attention call took 56 ms with 2 threads vs 1 ms with 1, whole steps ~2x slower).",
        f"Each configuration: one warm-up step per side, then {reps} timed steps per side, 100% and 10% "
        "interleaved; times are medians, the speedup is the median of per-repeat ratios, [min-max] of those ratios beside it.",
        "Ideal = (weights + KV at 100%) / (weights + KV at 10%), bytes read per step: decoder layers, final "
        "norm, lm_head and the batch's embedding rows; KV = cached tokens + the new one, K and V, all layers. "
        "'gain share' = (measured - 1) / (ideal - 1), shown where the ideal is >= 1.1x. 'ideal, 32 layers' is the same ratio for the full model.",
        f"100% pools above --max-kv-gb={args.max_kv_gb:g} are skipped; the 10% side still runs.",
        f"Load average at end {mach['loadavg_end']}; total run time {elapsed:.0f} s.",
    ]
    report = "\n".join(
        [*header, "## 1. Admission into one pool (BlockManager accounting)", "", adm_text, "",
         f"## 2. Decode throughput ({layers} of 32 layers, fp32, block size {BLOCK_SIZE})", "", tp_text, "",
         *[f"- {n}" for n in notes], ""]
    )  # fmt: skip
    print("\n" + tp_text + "\n\n" + "\n".join(f"- {n}" for n in notes), flush=True)
    (out / "bench_decode.md").write_text(report)
    result = {
        "machine": mach,
        "layers": layers,
        "reps": reps,
        "max_kv_bytes": cap,
        "admission": adm,
        "throughput": [asdict(r) | {"share": r.share, "gain_share": r.gain_share} for r in rows],
        "elapsed_s": elapsed,
    }
    (out / "bench_decode.json").write_text(json.dumps(result, indent=2))
    plot(rows, prompts, out / "bench_decode.png")
    print(f"\nwrote {out / 'bench_decode.md'}, .json, .png", flush=True)


if __name__ == "__main__":
    main()
