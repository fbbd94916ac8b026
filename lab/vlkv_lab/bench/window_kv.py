"""``vlkv bench window-kv``: what sliding-window layers save in KV bytes, and decode step time per family (issue 65).

1. Arithmetic (no model): KV bytes one sequence keeps after the prefill, at 2K and 8K-token prompts, on
   public layouts (``LAYOUTS``): Gemma 3 4B and 12B (no Gemma 3 near 7B exists; they bracket it: 5 of every 6
   layers sliding with window 1024, the sixth global), and Mistral-7B v0.1 (every layer sliding, window 4096).
   Rows, per layout and prompt length ``m``:

   - ``full, no windows``: every layer keeps the whole prompt (a Llama-shaped server; vlkv before issue 65);
   - ``full``: the model's own cache: a binding sliding layer keeps its last ``W - 1`` positions
     (``windows.fit_windows`` on ``[m] * L``, with ``windows.binding_windows``);
   - ``10%, no windows``: ``budgets.uniform_budgets`` (``ceil(0.1 m)`` in every layer), windows ignored;
   - ``10%, window-only sliding``: the same budgets through ``fit_windows`` (what the prefill does): a sliding
     layer keeps only what its window reads (its tail, no scores), the cut spilled to the global layers;
   - ``window + 10% global``: the sliding layers compressed by their window alone (their last ``W - 1``), the
     global layers at 10% (what serving the windows with no score-based cut of the sliding layers keeps).

   Bytes: ``2 (K, V) x kept tokens x KV heads x head dim x 2`` (bfloat16). Sequences one decode pool holds:
   ``pool bytes // kv_cache.block_bytes_of`` blocks over ``block_manager.blocks_needed`` per sequence with
   ``--new-tokens`` reserved in every layer (``reserve`` admission), a binding sliding layer capped by its ring
   (``block_math.layer_blocks``); the ``no windows`` rows count every layer in full.
2. Measured: decode step time on this CPU per family (``llama``, ``qwen2``, ``mistral`` with window 64,
   ``gemma3_text`` with 5 of 6 layers sliding-64): a random-init LLaVA of ``lab/vlkv_lab/task/tiny_llava.build_tiny`` with
   the family's transformers config (``STEP_SIZES``: hidden 256, 6 layers, 8 query / 2 KV heads, head dim 32),
   float32, one thread, through ``InProcessEngine`` (prefill, admission, the decode core's paged steps):
   ``--step-batch`` caches of a ``--step-prompt``-token prompt decoded together, full cache; a step's time is
   (wall of ``--step-tokens`` new tokens - wall of 2) / (``--step-tokens`` - 2), the median of 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
LENGTHS = (2048, 8192)
BUDGET = 0.1
ROWS = ("full, no windows", "full", "10%, no windows", "10%, window-only sliding", "window + 10% global")


@dataclass(frozen=True)
class Layout:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int, ...]  # per layer (0: global)
    source: str = ""


def gemma3_windows(layers: int, window: int, pattern: int = 6) -> tuple[int, ...]:
    """Gemma 3's ``layer_types``: every ``pattern``-th layer global, the others sliding with ``window``."""
    return tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers))


LAYOUTS = (
    Layout("Gemma 3 4B", 34, 4, 256, gemma3_windows(34, 1024), "34 layers (29 sliding-1024, 5 global), 4 KV heads, D 256"),
    Layout("Gemma 3 12B", 48, 8, 256, gemma3_windows(48, 1024), "48 layers (40 sliding-1024, 8 global), 8 KV heads, D 256"),
    Layout("Mistral-7B", 32, 8, 128, (4096,) * 32, "32 layers, all sliding-4096, 8 KV heads, D 128"),
)  # fmt: skip


def kept(layout: Layout, row: str, m: int, new_tokens: int) -> tuple[list[int], tuple[int, ...]]:
    """``(tokens kept per layer, the windows the pool counts as rings)`` of one row."""
    from vlkv.common.compression.budgets import uniform_budgets
    from vlkv.common.compression.windows import binding_windows, fit_windows, prompt_reach

    L = layout.layers
    binding = binding_windows(layout.windows, m, new_tokens)
    if row == "full, no windows":
        return [m] * L, ()
    if row == "10%, no windows":
        return uniform_budgets(L, BUDGET, m), ()
    if row == "full":
        return fit_windows([m] * L, binding, m)[0], binding
    if row == "10%, window-only sliding":
        return fit_windows(uniform_budgets(L, BUDGET, m), binding, m)[0], binding
    if row == "window + 10% global":
        tenth = uniform_budgets(L, BUDGET, m)
        slide = binding or (0,) * L
        return [prompt_reach(w, m) if w else k for k, w in zip(tenth, slide, strict=True)], binding
    raise ValueError(f"unknown row {row!r}")


def kv_rows(
    layouts=LAYOUTS, lengths=LENGTHS, pool_gib: float = 40.0, new_tokens: int = 128, block_size: int = 16
) -> list[dict]:
    import torch
    from vlkv.decode_worker.block_manager import blocks_needed
    from vlkv.decode_worker.kv_cache import block_bytes_of

    rows = []
    for lay in layouts:
        block = block_bytes_of(block_size, lay.kv_heads, lay.head_dim, torch.bfloat16)
        pool_blocks = int(pool_gib * GIB) // block
        for m in lengths:
            full_bytes = None
            for row in ROWS:
                lengths_l, rings = kept(lay, row, m, new_tokens)
                nbytes = 2 * sum(lengths_l) * lay.kv_heads * lay.head_dim * 2
                full_bytes = full_bytes or nbytes
                need = blocks_needed(lengths_l, new_tokens, block_size, rings)
                rows.append(
                    dict(layout=lay.name, m=m, row=row, tokens=sum(lengths_l), bytes=nbytes,
                         share=nbytes / full_bytes, blocks=need, seqs=pool_blocks // need,
                         sliding_kept=sum(k for k, w in zip(lengths_l, lay.windows, strict=True) if w),
                         global_kept=sum(k for k, w in zip(lengths_l, lay.windows, strict=True) if not w))
                )  # fmt: skip
    return rows


def _md(head: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def kv_table(rows: list[dict], pool_gib: float) -> str:
    head = ["layout", "prompt", "row", "kept (sliding / global token-layers)", "KV MiB / seq", "of full",
            "blocks / seq", f"seqs in {pool_gib:g} GiB"]  # fmt: skip
    body = [
        [r["layout"], f"{r['m'] // 1024}K", r["row"], f"{r['sliding_kept']} / {r['global_kept']}",
         f"{r['bytes'] / (1 << 20):.1f}", f"{r['share']:.1%}", r["blocks"], r["seqs"]]
        for r in rows
    ]  # fmt: skip
    return _md(head, body)


# -- decode step time per family -----------------------------------------------------------------------------
STEP_SIZES = dict(hidden=256, layers=6, num_heads=8, num_kv_heads=2)
FAMILIES = (("llama", 0), ("qwen2", 0), ("mistral", 64), ("gemma3_text", 64))
WORDS = "what colour shape is the square circle triangle red blue green it a there are one two".split()


def family_config(text, family: str, window: int):
    """A config of ``family``'s transformers class with the sizes and ids of ``text`` (the tiny Mistral one)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    sizes = {k: getattr(text, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
             "pad_token_id", "bos_token_id", "eos_token_id")}  # fmt: skip
    sizes["tie_word_embeddings"] = False
    if family == "llama":
        return LlamaConfig(**sizes)
    if family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **sizes)
    if family == "mistral":
        return MistralConfig(sliding_window=window or None, **sizes)
    if family == "gemma3_text":
        types = [
            "sliding_attention" if w else "full_attention" for w in gemma3_windows(text.num_hidden_layers, 1)
        ]
        return Gemma3TextConfig(
            sliding_window=window, layer_types=types, query_pre_attn_scalar=text.head_dim, **sizes
        )
    raise ValueError(f"unknown family {family!r}")


def family_engine(family: str, window: int, seed: int = 0):
    import torch
    from transformers import LlavaForConditionalGeneration
    from vlkv.deploy.inprocess import InProcessEngine

    from vlkv_lab.task.tiny_llava import build_tiny

    _, proc, cfg = build_tiny(WORDS, kind="llava", image_size=32, patch_size=8, vision_hidden=32,
                              vision_heads=2, max_position_embeddings=2048, **STEP_SIZES)  # fmt: skip
    cfg.text_config = family_config(cfg.text_config, family, window)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    return InProcessEngine(model, proc)


def step_rows(prompt: int = 512, batch: int = 4, tokens: int = 34, threads: int = 1) -> list[dict]:
    import torch
    from vlkv.common.sampling import SamplingConfig

    torch.set_num_threads(threads)
    rows = []
    for family, window in FAMILIES:
        engine = family_engine(family, window)
        text = " ".join(WORDS[i % len(WORDS)] for i in range(prompt))
        req = engine.prepare([], text, sampling=SamplingConfig(max_new_tokens=tokens))
        cache = engine.prefill.run(req).cache
        walls = {}
        for n in (2, tokens):
            samples = []
            for _ in range(3):
                t0 = time.perf_counter()
                engine.decode_caches([cache] * batch, SamplingConfig(max_new_tokens=n), eos_ids=())
                samples.append(time.perf_counter() - t0)
            walls[n] = statistics.median(samples)
        step = (walls[tokens] - walls[2]) / (tokens - 2)
        windows = engine.spec.windows
        rows.append(dict(family=family, window=window, sliding=sum(1 for w in windows if w), layers=STEP_SIZES["layers"],
                         m=req.modality.m, batch=batch, step_ms=1e3 * step))  # fmt: skip
    return rows


def step_table(rows: list[dict]) -> str:
    head = ["family", "sliding layers (window)", "prompt tokens", "batch", "decode step ms"]
    body = [
        [r["family"], f"{r['sliding']} of {r['layers']} ({r['window'] or '-'})", r["m"], r["batch"],
         f"{r['step_ms']:.2f}"]
        for r in rows
    ]  # fmt: skip
    return _md(head, body)


def plot(rows: list[dict], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = list(dict.fromkeys((r["layout"], r["m"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(ROWS)
    for j, row in enumerate(ROWS):
        vals = [next(r["bytes"] for r in rows if (r["layout"], r["m"]) == g and r["row"] == row) / (1 << 20)
                for g in groups]  # fmt: skip
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=row)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{name}\n{m // 1024}K" for name, m in groups])
    ax.set_ylabel("KV MiB per sequence (bf16)")
    ax.set_yscale("log")
    ax.set_title("KV bytes per sequence: sliding windows against every layer's whole prompt")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "window_kv.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool-gib", type=float, default=40.0, help="window-kv: one decode pool's KV bytes (GiB)")
    p.add_argument("--new-tokens", type=int, default=128, help="window-kv: new tokens reserved per sequence")
    p.add_argument("--window-lengths", default="2048,8192", help="window-kv: prompt lengths in tokens")
    p.add_argument("--step-prompt", type=int, default=512, help="window-kv: prompt tokens of the step timing")
    p.add_argument("--step-batch", type=int, default=4, help="window-kv: sequences decoded together")
    p.add_argument("--step-tokens", type=int, default=34, help="window-kv: new tokens per timed decode")
    p.add_argument("--no-steps", action="store_true", help="window-kv: the byte table only")


def main(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = tuple(int(x) for x in args.window_lengths.split(","))
    rows = kv_rows(lengths=lengths, pool_gib=args.pool_gib, new_tokens=args.new_tokens)
    layouts = "; ".join(f"{lay.name}: {lay.source}" for lay in LAYOUTS)
    md = (
        f"KV bytes per sequence after the prefill (bfloat16; {layouts}); pool: {args.pool_gib:g} GiB, blocks of "
        f"16 tokens, {args.new_tokens} new tokens reserved per sequence\n\n{kv_table(rows, args.pool_gib)}"
    )
    steps = []
    if not args.no_steps:
        steps = step_rows(args.step_prompt, args.step_batch, args.step_tokens)
        md += (
            f"\n\nDecode step time on this CPU (random-init LLaVA, {STEP_SIZES}, float32, one thread, full cache, "
            f"InProcessEngine.decode_caches)\n\n{step_table(steps)}"
        )
    (out / "report.md").write_text(md + "\n")
    (out / "results.json").write_text(json.dumps(dict(kv=rows, steps=steps), indent=1))
    path = plot(rows, out)
    print(md + f"\n\nplot: {path or 'not drawn (matplotlib not installed)'}; report and results in {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench_window_kv")
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
