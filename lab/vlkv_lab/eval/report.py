"""``vlkv eval``: one policy and budget, or the whole Table-1 sweep with a plot and CacheHitRate."""

from __future__ import annotations

import json
import time
from pathlib import Path

from vlkv.common.compression.registry import POLICY_NAMES, get_policy
from vlkv.common.config import DEFAULT_PROMPT_WEIGHT, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.progress import progress as track
from vlkv.deploy.synthetic_task import make_examples

from vlkv_lab.eval.evaluation import cache_hit_rate, evaluate, prepare

TABLE_BUDGETS = (0.01, 0.02, 0.05, 0.10, 0.20, 1.0)
HIT_RATE_POLICIES = ("vlcache", "h2o", "zipcache", "snapkv", "streamingllm", "random")


def run_eval(args) -> int:
    model = load_model(ModelConfig(path=args.model))
    processor = load_processor(args.model)
    examples = make_examples(args.n, seed=args.seed, split=getattr(args, "split", "heldout"))
    start = time.perf_counter()
    prepared = prepare(model, processor, examples, progress=not args.json)
    full = evaluate(model, processor, prepared, "full", 1.0, args.max_new_tokens)
    kv_options = getattr(args, "kv_dtype", "fp16") != "fp16" or getattr(args, "decode_budget", 0) > 0
    if getattr(args, "kv_table", False) or (args.table and kv_options):
        from vlkv_lab.eval.kv_storage import run_kv_table

        if not args.table:
            return run_kv_table(args, model, processor, prepared, full, start)
        _table(args, model, processor, prepared, full, start)
        return run_kv_table(args, model, processor, prepared, full, start)
    if args.table:
        return _table(args, model, processor, prepared, full, start)
    if getattr(args, "ablation", False):
        from vlkv_lab.eval.ablation import run_ablation

        return run_ablation(args, model, processor, prepared, full.accuracy, start)
    params = {"allocator": getattr(args, "allocator", None) or None}
    if getattr(args, "exact_budget", False):
        params["exact_budget"] = True
    decode = dict(
        kv_dtype=getattr(args, "kv_dtype", "fp16"),
        decode_budget=getattr(args, "decode_budget", 0.0),
        decode_window=getattr(args, "decode_window", 32),
        prompt_weight=getattr(args, "prompt_weight", DEFAULT_PROMPT_WEIGHT),
        min_new_tokens=getattr(args, "min_new_tokens", 0),
    )
    res = evaluate(
        model, processor, prepared, args.policy, args.budget, args.max_new_tokens, decode=decode, **params
    )
    report = {
        "policy": args.policy,
        "allocator": get_policy(args.policy, **params).allocator.name,
        "budget": args.budget,
        "examples": len(prepared),
        "accuracy": res.accuracy,
        "full_cache_accuracy": full.accuracy,
        "relative_accuracy": res.accuracy / full.accuracy if full.accuracy else 0.0,
        "realized_ratio": res.ratio,
        "layer_budget_share": res.layer_budget_share,
        "seconds": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"policy {args.policy} (allocator {report['allocator']}) at budget {args.budget:.0%}"
            f" on {len(prepared)} examples of split {getattr(args, 'split', 'heldout')}"
        )
        print(
            f"  accuracy {res.accuracy:.3f}  (full cache {full.accuracy:.3f}, relative {report['relative_accuracy']:.3f})"
        )
        print(f"  realized ratio {res.ratio:.4f}")
        print("  per-layer budget (mean k_l / m): " + " ".join(f"{s:.3f}" for s in res.layer_budget_share))
    return 0


def _table(args, model, processor, prepared, full, start) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict = {}
    runs = [(policy, b) for policy in POLICY_NAMES if policy != "full" for b in TABLE_BUDGETS]
    for policy, b in track(runs, desc="eval table", unit="run"):
        r = evaluate(model, processor, prepared, policy, b, args.max_new_tokens)
        rows.setdefault(policy, {})[b] = r
        print(f"{policy:>13} {b:>5.0%}: accuracy {r.accuracy:.3f} ratio {r.ratio:.4f}", flush=True)
    hit = {
        p: [sum(v) / len(prepared) for v in zip(*(cache_hit_rate(x, p, 0.1) for x in prepared), strict=True)]
        for p in track(HIT_RATE_POLICIES, desc="cache hit rate", unit="policy")
    }
    md = [
        f"# Accuracy against KV budget ({len(prepared)} examples of split {getattr(args, 'split', 'heldout')}, "
        f"full cache {full.accuracy:.3f})",
        "",
        "Command: `vlkv eval table" + (f" -n {args.n}" if args.n else "") + "`",
        "",
        "| policy | " + " | ".join(f"{b:.0%}" for b in TABLE_BUDGETS) + " |",
        "| --- |" + " --- |" * len(TABLE_BUDGETS),
    ]
    for policy, by_budget in rows.items():
        md.append(f"| {policy} | " + " | ".join(f"{by_budget[b].accuracy:.3f}" for b in TABLE_BUDGETS) + " |")
    md += _relative_and_kinds(rows, full, prepared)
    md += ["", "Realized compression ratio (sum k_l / (L m)):", ""]
    md.append("| policy | " + " | ".join(f"{b:.0%}" for b in TABLE_BUDGETS) + " |")
    md.append("| --- |" + " --- |" * len(TABLE_BUDGETS))
    for policy, by_budget in rows.items():
        md.append(f"| {policy} | " + " | ".join(f"{by_budget[b].ratio:.4f}" for b in TABLE_BUDGETS) + " |")
    layers = len(next(iter(hit.values())))
    md += ["", "CacheHitRate per layer at k = 10% of m (first decoding token's true top-k):", ""]
    md.append("| policy | " + " | ".join(f"L{i}" for i in range(layers)) + " | mean |")
    md.append("| --- |" + " --- |" * (layers + 1))
    for p, v in hit.items():
        md.append(f"| {p} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {sum(v) / len(v):.3f} |")
    vl = rows["vlcache"][0.10]
    md += [
        "",
        "vlcache per-layer budget at 10% (mean k_l / m): "
        + ", ".join(f"{s:.3f}" for s in vl.layer_budget_share),
        "",
        f"Wall time: {time.perf_counter() - start:.0f} s",
    ]
    (out / "table.md").write_text("\n".join(md) + "\n")
    _plot(rows, full.accuracy, out / "accuracy_vs_budget.png")
    print("\n".join(md))
    print(f"wrote {out / 'table.md'} and {out / 'accuracy_vs_budget.png'}")
    return 0


def _relative_and_kinds(rows, full, prepared) -> list[str]:
    """vlcache's accuracy relative to the full cache, the best baseline per budget, and accuracy per kind."""
    from vlkv.deploy.synthetic_task import is_correct

    md = [
        "",
        "Relative to the full cache (accuracy / full-cache accuracy), vlcache vs the best baseline:",
        "",
    ]
    md += ["| budget | vlcache | best baseline | vlcache >= every baseline |", "| --- | --- | --- | --- |"]
    for b in TABLE_BUDGETS:
        vl = rows["vlcache"][b].accuracy
        others = {p: r[b].accuracy for p, r in rows.items() if p != "vlcache"}
        best = max(others, key=others.get)
        rel = vl / full.accuracy if full.accuracy else 0.0
        brel = others[best] / full.accuracy if full.accuracy else 0.0
        md.append(f"| {b:.0%} | {rel:.3f} | {brel:.3f} ({best}) | {'yes' if vl >= others[best] else 'no'} |")
    kinds = sorted({p.example.kind for p in prepared})

    def per_kind(answers) -> list[str]:
        out = []
        for k in kinds:
            pairs = [(a, p) for a, p in zip(answers, prepared, strict=True) if p.example.kind == k]
            out.append(f"{sum(is_correct(a, p.example) for a, p in pairs) / len(pairs):.3f} (n={len(pairs)})")
        return out

    md += ["", "Accuracy per question kind:", ""]
    md += ["| run | " + " | ".join(kinds) + " |", "| --- |" + " --- |" * len(kinds)]
    md.append("| full cache | " + " | ".join(per_kind(full.answers)) + " |")
    for b in (0.10, 0.05, 0.02):
        md.append(f"| vlcache {b:.0%} | " + " | ".join(per_kind(rows["vlcache"][b].answers)) + " |")
    return md


def _plot(rows, full_acc: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, by_budget in rows.items():
        ax.plot(
            [b * 100 for b in TABLE_BUDGETS],
            [by_budget[b].accuracy for b in TABLE_BUDGETS],
            marker="o",
            label=policy,
        )
    ax.axhline(full_acc, color="black", linestyle="--", linewidth=1, label="full cache")
    ax.set_xscale("log")
    ax.set_xlabel("KV budget (% of prompt tokens per layer)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("vlkv default model: accuracy against KV budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
