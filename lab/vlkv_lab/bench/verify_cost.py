"""``vlkv bench verify-cost``: what verified compression costs the prefill worker (issue 62, item 2).

1. Measured: SmolLM2-135M-Instruct as vlkv's text-only LLaVA wrapper (``zoo_text.load_text_model``, bfloat16
   unless ``VLKV_TEXT_DTYPE``), ``--verify-threads`` torch threads; ~1K / ~2K-token ``needle`` prompts of the text
   suite as text, and with one image between context and question (the wrapper's random 4-token tower: a cost
   probe only; it sends ``vlcache`` down its image path, lookahead 16, where text takes its text preset, lookahead
   0). Per prompt each configuration (``floor``, ``select`` at ``VerifyConfig()``'s defaults; ``default``: named
   ``vlcache``, unverified; ``lookahead off``) runs once through ``PrefillEngine.run``, serially, the order rotated
   per prompt. TTFT is ``prefill_ms`` (the prefill worker's step: forward, first token, draft, verification,
   compression); requests/s is n over the summed wall time of ``run``; shares are of the summed ``prefill_ms``.
2. Modelled: ``cost_model.LLAVA_15_7B`` at H100 (``cost_model.GPUS``) and H200 figures, roofline lower bounds of an
   image prompt (50 post-vision statistics rows): prefill, the 16-step greedy draft (``decode_step``'s weights and
   paged attention at batch 1, over the full cache) and verification rounds (4 candidates' gathers, one forward of
   4 x 16 teacher-forced tokens over the compact caches with ``teacher_force``'s fp32 padded copies).

Target (issue 62): draft + verification <= 25% of the prefill worker's time at 2K tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TARGET = 0.25
DRAFT, CANDIDATES = 16, 4
CONFIGS = ("floor", "select", "default", "lookahead off")


@dataclass(frozen=True)
class Prompt:
    group: str  # the table's row group ("text 1K")
    prompt: str | None = None  # a rendered prompt (image placeholders in place), or
    question: str | None = None  # a one-turn chat question after the images
    images: tuple = field(default=(), repr=False)


def settings(config: str, budget: float):
    from vlkv.common.compression.registry import CompressionSettings

    if config in ("floor", "select"):
        return CompressionSettings(budget=budget, explicit=False, verify=config)
    return CompressionSettings("vlcache", budget, lookahead=0 if config == "lookahead off" else None)


def measure(engine, prompts: list[Prompt], budget: float, warmup: bool = True) -> list[dict]:
    """One record per (prompt, configuration), the configurations' order rotated by one with each prompt of a
    group; ``engine``: an ``InProcessEngine`` built with a ``VerifyConfig``; ``warmup``: a first pass over the
    first prompt, not recorded."""
    from vlkv.common.sampling import SamplingConfig

    sampling, records, skip, turn = SamplingConfig(max_new_tokens=1), [], int(warmup), Counter()
    for i, p in enumerate(prompts[:skip] + prompts):
        k, turn[p.group] = turn[p.group] % 4, turn[p.group] + (i >= skip)
        for config in CONFIGS[k:] + CONFIGS[:k]:
            kw = dict(question=p.question, sampling=sampling, compression=settings(config, budget))
            req = engine.prepare(list(p.images), p.prompt, **kw)
            t0 = time.perf_counter()
            res = engine.prefill.run(req)
            wall = time.perf_counter() - t0
            v = res.verdict
            if i >= skip:
                records.append(
                    dict(group=p.group, config=config, m=req.modality.m, wall_s=wall, prefill_ms=res.prefill_ms,
                         draft_ms=res.draft_ms, verify_ms=res.verify_ms, raises=v.raises if v else 0,
                         ratio=res.cache.compression_ratio, verified=v is not None,
                         agreement=v.agreement if v else None, candidate=v.candidate if v else res.policy)
                )  # fmt: skip
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per (group, configuration): shares of the summed ``prefill_ms``; ``excess``: the share of the mean
    ``prefill_ms`` above lookahead off's (what the draft, verification and every candidate's statistics add)."""
    rows = []
    for group in dict.fromkeys(r["group"] for r in records):
        of = {c: [r for r in records if r["group"] == group and r["config"] == c] for c in CONFIGS}
        base = np.mean([r["prefill_ms"] for r in of["lookahead off"]])
        for config, rs in of.items():
            ms = np.array([r["prefill_ms"] for r in rs])
            draft, ver = sum(r["draft_ms"] for r in rs) / ms.sum(), sum(r["verify_ms"] for r in rs) / ms.sum()
            rows.append(
                dict(group=group, config=config, n=len(rs), m=round(float(np.mean([r["m"] for r in rs]))),
                     req_s=len(rs) / sum(r["wall_s"] for r in rs), p50_ms=float(np.percentile(ms, 50)),
                     p99_ms=float(np.percentile(ms, 99)), draft_share=draft, verify_share=ver,
                     excess=float(1 - base / ms.mean()), raises=float(np.mean([r["raises"] for r in rs])),
                     ratio=float(np.mean([r["ratio"] for r in rs])), meets=bool(draft + ver <= TARGET))
            )  # fmt: skip
    return rows


def _md(head: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def table(rows: list[dict]) -> str:
    head = (
        "prompts,config,n,tokens,req/s,TTFT p50 / p99 ms,draft,verify,draft + verify <= 25%,excess over off"
    )
    return _md(
        [*head.split(","), "raises", "ratio"],
        [
            [r["group"], r["config"], r["n"], r["m"], f"{r['req_s']:.3f}", f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}",
             f"{r['draft_share']:.1%}", f"{r['verify_share']:.1%}", "yes" if r["meets"] else "no",
             f"{r['excess']:.1%}", f"{r['raises']:.2f}", f"{r['ratio']:.3f}"]
            for r in rows
        ],
    )  # fmt: skip


# -- the 7B layout's cost model ------------------------------------------------------------------------------
def _phases(m: int, budgets: tuple[float, ...], draft: bool):
    """The 7B layout's prefill, draft and verification as lists of ``cost_model.Cost``."""
    from vlkv_lab.bench.cost_model import LLAVA_15_7B as M
    from vlkv_lab.bench.cost_model import Cost, attention_stats_costs, paged_decode_costs

    params, layers, h, hkv, d = M.matmul_params, M.layers, M.heads, M.kv_heads, M.dim
    stats = attention_stats_costs(h, hkv, 50, m, d) * layers * (2 if budgets else 1)  # verified: snapkv's too
    prefill = [
        Cost("matmuls", 2 * params + 2 * m * M.hidden * 2 * layers, 2 * params * m),
        Cost("attention", layers * 4 * m * h * d * 2, layers * 4 * h * d * m * (m + 1) / 2),
        *stats,
    ]
    steps, drafting = (DRAFT if draft else 0), []
    for s in range(steps):  # decode_step at batch 1: the weights, then paged attention over m + s tokens
        drafting.append(Cost("weights", 2 * params, 2 * params))
        drafting += paged_decode_costs(1, m + s, h, hkv, d) * layers
    drafting += attention_stats_costs(h, hkv, steps, m + steps, d) * layers if steps else []
    verify, n = [], CANDIDATES * DRAFT
    for b in budgets:  # per round: each candidate's gather, then one forward of 4 x 16 forced tokens
        kept = math.ceil(b * m)
        gather = CANDIDATES * (2 * kept * M.kv_bytes_per_token("fp16") + layers * h * m * 4)
        verify.append(Cost("compress", gather, 0))
        verify.append(Cost("forced matmuls", 2 * params + n * M.vocab * 12, 2 * params * n))
        kv = 2 * CANDIDATES * kept * hkv * d * layers  # elements of the kept K and V, all layers
        verify.append(Cost("forced attention", kv * (2 + 4 + 4), layers * 4 * n * h * d * (kept + DRAFT)))
    return prefill, drafting, verify


def model_rows(lengths=(1024, 2048), budget: float = 0.1, cap: float = 0.25) -> list[dict]:
    from vlkv_lab.bench.cost_model import GPUS

    raised = [budget]
    while raised[-1] < cap:  # floor's rounds when no candidate meets it: doubled up to the cap
        raised.append(min(2 * raised[-1], cap))
    configs = (  # (label, draft, verification rounds' budgets)
        ("lookahead off (= default, text)", False, ()),
        ("default, image (lookahead 16)", True, ()),
        ("select / floor, no raise", True, (budget,)),
        (f"floor, {len(raised) - 1} raises (cap {cap:g})", True, tuple(raised)),
    )

    h200 = dataclasses.replace(GPUS["H100"], name="H200 SXM 141GB", bandwidth=4.8e12, memory=141e9)
    rows = []
    for gpu_name, gpu in {"H100": GPUS["H100"], "H200": h200}.items():
        for m in lengths:
            for label, draft, budgets in configs:
                phases = _phases(m, budgets, draft)
                s = [sum(c.seconds(gpu) for c in p) for p in phases]
                total = sum(s)
                rows.append(
                    dict(gpu=gpu_name, m=m, config=label, ms=[x * 1e3 for x in s],
                         gflop=[sum(c.flops for c in p) / 1e9 for p in phases],
                         gb=[sum(c.bytes for c in p) / 1e9 for p in phases],
                         draft_share=s[1] / total, verify_share=s[2] / total, meets=bool((s[1] + s[2]) / total <= TARGET))
                )  # fmt: skip
    return rows


def model_table(rows: list[dict]) -> str:
    three = "prefill / draft / verify"
    return _md(
        ["GPU", "tokens", "config", f"GFLOP {three}", f"GB moved {three}", f"ms {three}", "draft", "verify", "<= 25%"],
        [
            [r["gpu"], r["m"], r["config"], " / ".join(f"{x:.0f}" for x in r["gflop"]),
             " / ".join(f"{x:.1f}" for x in r["gb"]), " / ".join(f"{x:.1f}" for x in r["ms"]),
             f"{r['draft_share']:.1%}", f"{r['verify_share']:.1%}", "yes" if r["meets"] else "no"]
            for r in rows
        ],
    )  # fmt: skip


# -- the run -----------------------------------------------------------------------------------------------
def smollm2_prompts(processor, lengths: list[int], n: int, images: bool, seed: int = 0) -> list[Prompt]:
    from PIL import Image

    from vlkv_lab.zoo import text_suite as ts

    rng = np.random.default_rng(seed)
    per_length = []
    for length in lengths:
        label = f"{length // 1024}K" if length % 1024 == 0 else str(length)
        group = []
        for item in ts.items("needle", length, n=n, seed=seed, tokenizer=processor.tokenizer):
            group.append(Prompt(f"text {label}", question=item.text))
            if images:  # the context, the image, the question: the question is the post-vision window
                parts = [{"type": "text", "text": item.context}, {"type": "image"}]
                parts.append({"type": "text", "text": item.question})
                chat = [{"role": "user", "content": parts}]
                text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                pixels = Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8))
                group.append(Prompt(f"image {label}", prompt=text, images=(pixels,)))
        per_length.append(group)
    # one prompt of each group, then the next: every group sees the whole run's machine noise
    return [p for row in zip(*per_length, strict=True) for p in row]


def plot(rows: list[dict], out: Path) -> Path | None:
    """Per group, the configurations' draft and verification shares stacked, the target as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 4), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=True):
        rs = [r for r in rows if r["group"] == g]
        draft, x = [r["draft_share"] for r in rs], np.arange(len(rs))
        ax.bar(x, draft, label="draft")
        ax.bar(x, [r["verify_share"] for r in rs], bottom=draft, label="verification")
        ax.plot(x, [max(0.0, r["excess"]) for r in rs], "kx", label="excess over lookahead off")
        ax.axhline(TARGET, color="k", ls="--", lw=1, label="target 25%")
        ax.set(ylim=(0, 1), title=f"{g}: share of prefill_ms")
        ax.set_xticks(x, [r["config"] for r in rs], rotation=20)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "verify_cost.png", dpi=120)
    plt.close(fig)
    return out / "verify_cost.png"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify-budget", type=float, default=0.1, help="verify-cost: the requests' budget")
    p.add_argument("--verify-n", type=int, default=4, help="verify-cost: prompts per length (and kind)")
    p.add_argument("--verify-lengths", default="1024,2048", help="verify-cost: prompt lengths in tokens")
    p.add_argument("--verify-threads", type=int, default=1, help="verify-cost: torch threads")
    p.add_argument("--verify-no-images", action="store_true", help="verify-cost: text prompts only")
    p.add_argument(
        "--verify-batch", type=int, default=4, help="verify-cost: drafts batched together (0: not measured)"
    )


def main(args) -> int:
    import torch
    from vlkv.common.compression.verify import VerifyConfig
    from vlkv.deploy.inprocess import InProcessEngine

    from vlkv_lab.bench.draft_batch import draft_batch_rows, draft_batch_table
    from vlkv_lab.eval.zoo_text import load_text_model

    torch.set_num_threads(args.verify_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = load_text_model()
    engine = InProcessEngine(model, processor, verify=VerifyConfig())
    lengths = [int(x) for x in args.verify_lengths.split(",")]
    prompts = smollm2_prompts(processor, lengths, args.verify_n, not args.verify_no_images)
    t0 = time.perf_counter()
    records = measure(engine, prompts, args.verify_budget)
    rows, mrows = summarize(records), model_rows(tuple(lengths), args.verify_budget)
    batched = draft_batch_rows(engine, prompts, args.verify_batch) if args.verify_batch > 1 else []
    meta = dict(model="SmolLM2-135M-Instruct (text-only LLaVA wrapper)", dtype=str(model.dtype), budget=args.verify_budget,
                threads=args.verify_threads, n=args.verify_n, wall_s=round(time.perf_counter() - t0, 1))  # fmt: skip
    md = (
        f"Measured ({meta}): TTFT = prefill_ms (the prefill worker's step), shares of prefill_ms\n\n{table(rows)}\n\n"
        f"Modelled, cost_model.LLAVA_15_7B (roofline lower bounds), budget {args.verify_budget:g}\n\n"
        f"{model_table(mrows)}\n\nTarget: draft + verification <= {TARGET:.0%} of prefill-worker time at 2K tokens."
    )
    if batched:
        md += "\n\nDrafts of requests in flight, one at a time and as one batch (--prefill-concurrency)\n\n"
        md += draft_batch_table(batched)
    (out / "report.md").write_text(md + "\n")
    (out / "results.json").write_text(
        json.dumps(dict(meta=meta, rows=rows, model=mrows, records=records, draft_batch=batched), indent=1)
    )
    path = plot(rows, out)
    print(md + f"\n\nplot: {path or 'not drawn (matplotlib not installed)'}; report and results in {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench_verify_cost")
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
