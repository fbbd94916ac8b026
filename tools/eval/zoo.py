"""``vlkv eval --zoo``: every zoo member x policy x budget, one Table-1 per member and the worst member.

Each member (``tools/zoo``) is loaded through ``load_model`` / ``load_processor`` like any user's checkpoint;
its examples are prefilled once by the prefill worker's forward (``evaluation.prepare``) and every
(policy, budget) compresses them with ``policy.compress`` and decodes them through the decode worker's core
(``deploy/inprocess.py``), as ``vlkv eval --table`` does for the default model. ``--api`` then asks every
question again through a local gateway and workers (real gRPC) with the default policy at each budget and
counts the answers that differ from the in-process ones. ``--ablation`` swaps the table's rows for vlcache's
options (``ABLATION``), the rows the tuning protocol chooses from (``common/compression/README.md``).

Writes ``<out>/zoo.md`` (or ``zoo_ablation.md``), ``results.json`` beside it and a plot.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

from vlkv.common.compression.presets import preset_params
from vlkv.common.compression.registry import DEFAULT_POLICY, POLICY_NAMES
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.tools.eval.evaluation import compress, decode_batch, evaluate, prepare
from vlkv.tools.progress import progress as track
from vlkv.tools.zoo import MEMBERS, member

ZOO_BUDGETS = (0.01, 0.02, 0.05, 0.10)
BASELINES = tuple(p for p in POLICY_NAMES if p not in ("full", DEFAULT_POLICY))
# (label, policy, params): vlcache's registered options, one change at a time from its defaults
PREVIOUS_DEFAULT = preset_params("vlcache_paper")
"""vlcache's settings before the zoo (#30), the paper's own (``common/compression/presets.py``): the
protocol's "before" row."""
PREVIOUS_LABEL = "vlcache before the zoo"
ABLATION = (
    ("vlcache (defaults)", "vlcache", {}),
    (PREVIOUS_LABEL, "vlcache", PREVIOUS_DEFAULT),
    ("window: the best-scoring question tokens", "vlcache", {"post_vision_by_score": True}),
    ("window: none (the paper's recent window only)", "vlcache", {"post_vision_window": False}),
    ("window: cap 1/4", "vlcache", {"post_vision_cap": 0.25}),
    ("scores not pooled", "vlcache", {"pool_kernel": 1}),
    ("sinks: first 4 tokens", "vlcache", {"sink_tokens": 4}),
    ("allocator: Algorithm 1", "vlcache", {"allocator": "sparsity"}),
    ("allocator: uniform", "vlcache", {"allocator": "uniform"}),
    ("allocator: mixed (0.8 uniform + 0.2 Algorithm 1)", "vlcache", {"allocator": "mixed"}),
    ("allocator: coverage", "vlcache", {"allocator": "coverage"}),
    ("allocator: cake", "vlcache", {"allocator": "cake"}),
    ("allocator: pyramid, beta 2", "vlcache", {"pyramid_beta": 2.0}),
    ("allocator: pyramid, beta 20 (PyramidKV's)", "vlcache", {"pyramid_beta": 20.0}),
    ("snapkv (baseline)", "snapkv", {}),
    ("pyramidkv (baseline)", "pyramidkv", {}),
)


def _configs(ablation: bool) -> list[tuple[str, str, dict]]:
    if ablation:
        return list(ABLATION)
    previous = (PREVIOUS_LABEL, DEFAULT_POLICY, PREVIOUS_DEFAULT)
    return [(DEFAULT_POLICY, DEFAULT_POLICY, {}), previous] + [(p, p, {}) for p in BASELINES]


def run_member(name: str, n: int, seed: int, split: str, configs, budgets, api: bool = False) -> dict:
    """One member's rows: ``{"full": acc, "rows": {label: {budget: acc}}, "api": {...}}``."""
    mod = member(name)
    path = str(mod.model_dir)
    model = load_model(ModelConfig(path=path))
    processor = load_processor(path)
    examples = mod.make_examples(n, seed=seed, split=split)
    prepared = prepare(model, processor, examples, progress=True, task=mod)
    full = evaluate(model, processor, prepared, "full", 1.0, mod.max_new_tokens)
    out: dict = {"full": full.accuracy, "m": sum(p.m for p in prepared) / len(prepared), "rows": {}}
    answers: dict = {}
    for b in track(budgets, desc=f"{name}", unit="budget"):
        accs = evaluate_many(model, processor, prepared, configs, b, mod.max_new_tokens, answers)
        for label, acc in accs.items():
            out["rows"].setdefault(label, {})[str(b)] = acc
    if api:
        out["api"] = _api_check(mod, model, processor, examples, budgets, answers)
    del prepared, model
    gc.collect()
    return out


def evaluate_many(
    model, processor, prepared, configs, budget: float, max_new_tokens: int, answers: dict, chunk: int = 1200
) -> dict[str, float]:
    """Accuracy of every ``(label, policy, params)`` at ``budget``: all their caches decoded together, in
    batches of up to ``chunk`` sequences (a tiny model's decode step costs about the same at 300 and at 1,200
    rows). ``answers[budget]`` receives the default policy's texts."""
    eos = {processor.tokenizer.eos_token_id}
    caches = []
    for _label, policy, params in configs:
        caches += [compress(p, policy, budget, **params) for p in prepared]
    texts = []
    for i in range(0, len(caches), chunk):
        outs = decode_batch(model, caches[i : i + chunk], max_new_tokens, eos)
        texts += [processor.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    accs: dict[str, float] = {}
    for j, (label, _, _) in enumerate(configs):
        mine = texts[j * len(prepared) : (j + 1) * len(prepared)]
        accs[label] = sum(p.task.is_correct(t, p.example) for t, p in zip(mine, prepared, strict=True)) / len(
            prepared
        )
        if label == DEFAULT_POLICY:
            answers[budget] = mine
    return accs


def _api_check(mod, model, processor, examples, budgets, answers) -> dict:
    """Ask every question through real gRPC at the default policy and each budget: accuracy and how many
    answers differ from the in-process evaluation's."""
    import asyncio
    import threading

    from vlkv.common.config import ServerConfig
    from vlkv.tools.eval.api_check import _ask_all, _serve

    cfg = ServerConfig(model=ModelConfig(path=str(mod.model_dir)))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = asyncio.run_coroutine_threadsafe(_serve(cfg, model, processor), loop).result(300)
    result = {}
    try:
        address = servers[2].address
        for b in budgets:
            texts = _ask_all(address, examples, DEFAULT_POLICY, b, mod.max_new_tokens, 4)
            acc = sum(mod.is_correct(t, ex) for t, ex in zip(texts, examples, strict=True)) / len(examples)
            differ = sum(t.strip() != a.strip() for t, a in zip(texts, answers[b], strict=True))
            result[str(b)] = {"accuracy": acc, "differ": differ}
    finally:
        for s in reversed(servers):
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return result


def worst_member(results: dict, label: str, budgets) -> dict:
    """Per budget: the lowest relative accuracy (accuracy / full-cache accuracy) over the members, and which."""
    out = {}
    for b in budgets:
        rel = {
            name: r["rows"][label][str(b)] / r["full"] if r["full"] else 0.0
            for name, r in results.items()
            if label in r["rows"]
        }
        worst = min(rel, key=rel.get)
        out[str(b)] = (rel[worst], worst)
    return out


def render(results: dict, budgets, command: str, split: str, n: int, seconds: float) -> list[str]:
    md = [f"# Zoo: accuracy against KV budget ({n} examples per member, split {split})", ""]
    md += [f"Command: `{command}`", ""]
    head = "| policy | " + " | ".join(f"{b:.0%}" for b in budgets) + " |"
    rule = "| --- |" + " --- |" * len(budgets)
    for name, r in results.items():
        mod = member(name)
        md += [f"## {name}", "", f"{mod.geometry}; mean prompt {r['m']:.0f} tokens.", ""]
        md += [f"Full cache: {r['full']:.3f}. Accuracy (relative to full in brackets):", "", head, rule]
        for label, by_b in r["rows"].items():
            cells = [
                f"{by_b[str(b)]:.3f} ({by_b[str(b)] / r['full'] if r['full'] else 0:.3f})" for b in budgets
            ]
            md.append(f"| {label} | " + " | ".join(cells) + " |")
        if "api" in r:
            api = r["api"]
            md += [
                "",
                f"Through the public API ({DEFAULT_POLICY}): "
                + ", ".join(
                    f"{float(b):.0%} {v['accuracy']:.3f} ({v['differ']} of {n} differ from the table)"
                    for b, v in api.items()
                ),
            ]
        md.append("")
    labels = list(next(iter(results.values()))["rows"])
    md += ["## Worst member (lowest accuracy relative to full, over every member)", "", head, rule]
    for label in labels:
        w = worst_member(results, label, budgets)
        md.append(
            f"| {label} | " + " | ".join(f"{w[str(b)][0]:.3f} ({w[str(b)][1]})" for b in budgets) + " |"
        )
    if PREVIOUS_LABEL in labels:
        md += protocol_table(results, budgets)
    md += [
        "",
        "Ranking (the tuning protocol's score: the worst member's relative accuracy averaged over the "
        "budgets; ties by the mean over members):",
        "",
        "| rank | row | worst member | mean |",
        "| --- | --- | --- | --- |",
    ]
    for i, (label, worst, mean) in enumerate(rank_configs(results, budgets), 1):
        md.append(f"| {i} | {label} | {worst:.3f} | {mean:.3f} |")
    md += ["", f"Wall time: {seconds:.0f} s"]
    return md


def protocol_table(results: dict, budgets) -> list[str]:
    """The tuning protocol's before/after check: per member and budget, the default's accuracy minus the
    previous default's (points); a drop of more than 1 point fails."""
    new = DEFAULT_POLICY if DEFAULT_POLICY in next(iter(results.values()))["rows"] else "vlcache (defaults)"
    md = ["", f"Protocol check: `{new}` minus `{PREVIOUS_LABEL}` (accuracy points; fails below -1):", ""]
    md += [
        "| member | " + " | ".join(f"{b:.0%}" for b in budgets) + " | holds |",
        "| --- |" + " --- |" * (len(budgets) + 1),
    ]
    for name, r in results.items():
        diffs = [100 * (r["rows"][new][str(b)] - r["rows"][PREVIOUS_LABEL][str(b)]) for b in budgets]
        holds = "yes" if min(diffs) >= -1.0 - 1e-9 else "no"
        md.append(f"| {name} | " + " | ".join(f"{d:+.1f}" for d in diffs) + f" | {holds} |")
    return md


def rank_configs(results: dict, budgets) -> list[tuple[str, float, float]]:
    """``(row, worst-member score, mean score)`` best first; a member's score is its accuracy relative to its
    full cache averaged over ``budgets``."""
    labels = list(next(iter(results.values()))["rows"])
    ranked = []
    for label in labels:
        per_member = [
            sum(r["rows"][label][str(b)] for b in budgets) / len(budgets) / r["full"] if r["full"] else 0.0
            for r in results.values()
        ]
        ranked.append((label, min(per_member), sum(per_member) / len(per_member)))
    return sorted(ranked, key=lambda t: (-t[1], -t[2]))


def run_zoo(args) -> int:
    budgets = ZOO_BUDGETS
    names = args.members.split(",") if getattr(args, "members", "") else list(MEMBERS)
    ablation = getattr(args, "ablation", False)
    configs = _configs(ablation)
    split = getattr(args, "split", "heldout")
    start = time.perf_counter()
    results = {}
    for name in names:
        results[name] = run_member(
            name, args.n, args.seed, split, configs, budgets, api=getattr(args, "api", False)
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "zoo_ablation" if ablation else "zoo"
    flags = (" --ablation" if ablation else "") + (" --api" if getattr(args, "api", False) else "")
    command = f"vlkv eval --zoo{flags} -n {args.n} --split {split}" + (
        f" --members {args.members}" if getattr(args, "members", "") else ""
    )
    md = render(results, budgets, command, split, args.n, time.perf_counter() - start)
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"split": split, "n": args.n, "results": results}, indent=1))
    _plot(results, budgets, out / f"{stem}.png")
    print("\n".join(md))
    print(f"wrote {out / (stem + '.md')}, {stem}.json and {stem}.png")
    return 0


def _plot(results: dict, budgets, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    cols = min(3, len(names) + 1)
    rows = (len(names) + 1 + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    xs = [b * 100 for b in budgets]
    labels = list(results[names[0]]["rows"])
    for ax, name in zip(axes.flat, names, strict=False):
        r = results[name]
        for label in labels:
            ax.plot(xs, [r["rows"][label][str(b)] / r["full"] for b in budgets], marker="o", label=label)
        ax.set_title(name)
    ax = axes.flat[len(names)]
    for label in labels:
        w = worst_member(results, label, budgets)
        ax.plot(xs, [w[str(b)][0] for b in budgets], marker="o", label=label)
    ax.set_title("worst member")
    for ax in list(axes.flat)[: len(names) + 1]:
        ax.set_xscale("log")
        ax.set_xlabel("KV budget (%)")
        ax.set_ylabel("accuracy / full")
        ax.set_ylim(0, 1.05)
    for ax in list(axes.flat)[len(names) + 1 :]:
        ax.axis("off")
    axes.flat[len(names)].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
