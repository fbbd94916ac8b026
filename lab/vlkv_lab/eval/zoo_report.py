"""The tables and the plot of ``vlkv eval zoo``: per member, the worst member, the protocol's check, a ranking.

A member's result (``zoo.run_member`` / ``zoo_text.run_task``): ``full``, ``n``, ``m`` (mean prompt), ``rows``
(``{label: {str(budget): accuracy}}``), ``hits`` (``{label: {str(budget): [right per example]}}``, for the
intervals), ``eviction_trained``, ``geometry``, optionally ``dropped`` (a text task the model cannot do with
the full cache) and ``api``. Marks, in every table: eviction-trained members (``lab/vlkv_lab/task/eviction.py``,
as no user's checkpoint is) and model-bound cells (the better oracle keeps < ``MODEL_BOUND`` of the full
cache's accuracy: the model, not the policy, limits them). Both are left out of the worst member, the
ranking and the protocol's check.
"""

from __future__ import annotations

from pathlib import Path

from vlkv.common.compression.registry import DEFAULT_POLICY

from vlkv_lab.eval.zoo_scoring import FULL, ORACLES, wilson

MODEL_BOUND = 0.9
EVICTION_MARK = "eviction-trained"
BOUND_MARK = "*"


def finalize(result: dict) -> dict:
    """Fill ``rows`` (and ``full``) from ``hits``."""
    hits = result.get("hits", {})
    if FULL in hits:
        full = hits[FULL]["1.0"]
        result["full"], result["n"] = sum(full) / len(full), len(full)
    result["rows"] = {
        label: {b: sum(h) / len(h) for b, h in by_b.items()} for label, by_b in hits.items() if label != FULL
    } or result.get("rows", {})
    return result


def better_oracle(r: dict, b) -> float | None:
    """The better oracle row's accuracy at ``b``; None when no oracle row was run there."""
    oracles = [r["rows"][o][str(b)] for o in ORACLES if str(b) in r["rows"].get(o, {})]
    return max(oracles) if oracles else None


def model_bound(r: dict, b) -> bool:
    """Whether the better oracle keeps less than ``MODEL_BOUND`` of the full cache's accuracy at ``b``."""
    oracle = better_oracle(r, b)
    return oracle is not None and r["full"] > 0 and oracle < MODEL_BOUND * r["full"]


def counts(r: dict) -> bool:
    """Whether a member enters the worst member, the ranking and the protocol (not eviction-trained, not
    dropped)."""
    return not r.get("eviction_trained") and "dropped" not in r


def worst_member(results: dict, label: str, budgets) -> dict:
    """Per budget: the lowest relative accuracy (accuracy / full) over the members that count, leaving out
    model-bound cells, and which member; ``(nan, "")`` where none is left."""
    out = {}
    for b in budgets:
        rel = {
            name: r["rows"][label][str(b)] / r["full"] if r["full"] else 0.0
            for name, r in results.items()
            if counts(r) and label in r.get("rows", {}) and not model_bound(r, b)
        }
        worst = min(rel, key=rel.get) if rel else ""
        out[str(b)] = (rel[worst], worst) if rel else (float("nan"), "")
    return out


def rank_configs(results: dict, budgets) -> list[tuple[str, float, float]]:
    """``(row, worst-member score, mean score)`` best first; a member's score is its accuracy relative to its
    full cache averaged over the budgets that are not model-bound (members that count only)."""
    scored = {n: r for n, r in results.items() if counts(r) and r.get("rows")}
    labels = _labels(scored)
    ranked = []
    for label in labels:
        per_member = []
        for r in scored.values():
            bs = [b for b in budgets if not model_bound(r, b)]
            if bs and r["full"]:
                per_member.append(sum(r["rows"][label][str(b)] for b in bs) / len(bs) / r["full"])
        if per_member:
            ranked.append((label, min(per_member), sum(per_member) / len(per_member)))
    return sorted(ranked, key=lambda t: (-t[1], -t[2]))


def _labels(results: dict) -> list[str]:
    for r in results.values():
        if r.get("rows"):
            return [label for label in r["rows"] if label not in ORACLES]
    return []


def _cell(r: dict, label: str, b) -> str:
    acc = r["rows"][label][str(b)]
    hits = r.get("hits", {}).get(label, {}).get(str(b))
    interval = ""
    if hits is not None:
        lo, hi = wilson(sum(hits), len(hits))
        interval = f" ({lo:.2f}-{hi:.2f})"
    return f"{acc:.3f}{interval}{BOUND_MARK if model_bound(r, b) else ''}"


def member_table(name: str, r: dict, budgets) -> list[str]:
    mark = f" ({EVICTION_MARK}: left out of the scores)" if r.get("eviction_trained") else ""
    md = [f"## {name}{mark}", "", f"{r.get('geometry', '')}; mean prompt {r['m']:.0f} tokens.", ""]
    lo, hi = wilson(round(r["full"] * r["n"]), r["n"])
    md.append(f"n = {r['n']}. Full cache: {r['full']:.3f} ({lo:.2f}-{hi:.2f}).")
    if "dropped" in r:
        return md + ["", f"**Dropped**: {r['dropped']} (the model cannot do it; no policy rows).", ""]
    md += [
        "Accuracy (95% Wilson interval); `*`: model-bound (the better oracle < 0.9 of full).",
        "",
        "| row | " + " | ".join(f"{b:.0%}" for b in budgets) + " |",
        "| --- |" + " --- |" * len(budgets),
    ]
    for label in [*(o for o in ORACLES if o in r["rows"]), *_labels({name: r})]:
        md.append(f"| {label} | " + " | ".join(_cell(r, label, b) for b in budgets) + " |")
    if DEFAULT_POLICY in r["rows"] and any(o in r["rows"] for o in ORACLES):
        oracle = [max(r["rows"][o][str(b)] for o in ORACLES if o in r["rows"]) for b in budgets]
        rel = [
            r["rows"][DEFAULT_POLICY][str(b)] / o if o else float("nan")
            for b, o in zip(budgets, oracle, strict=True)
        ]
        md.append(f"| {DEFAULT_POLICY} / better oracle | " + " | ".join(f"{x:.3f}" for x in rel) + " |")
        ranks = [rank_at(r, DEFAULT_POLICY, b) for b in budgets]
        md.append(f"| {DEFAULT_POLICY}'s rank among the rows | " + " | ".join(ranks) + " |")
    if "api" in r:
        md += [
            "",
            f"Through the public API ({DEFAULT_POLICY}): "
            + ", ".join(
                f"{float(b):.0%} {v['accuracy']:.3f} ({v['differ']} of {r['n']} differ from the table)"
                for b, v in r["api"].items()
            ),
        ]
    return md + [""]


def rank_at(r: dict, label: str, b) -> str:
    """``label``'s rank at budget ``b`` among the policy rows (oracles left out; ties share the best rank)."""
    accs = [r["rows"][x][str(b)] for x in _labels({"": r})]
    mine = r["rows"][label][str(b)]
    return f"{1 + sum(a > mine + 1e-12 for a in accs)} of {len(accs)}"


def render(results: dict, budgets, command: str, split: str, seconds: float, previous: str = "") -> list[str]:
    md = [f"# Zoo: accuracy against KV budget (split {split})", "", f"Command: `{command}`", ""]
    for name, r in results.items():
        md += member_table(name, r, budgets)
    dropped = [n for n, r in results.items() if "dropped" in r]
    evicted = [n for n, r in results.items() if r.get("eviction_trained")]
    head = "| row | " + " | ".join(f"{b:.0%}" for b in budgets) + " |"
    rule = "| --- |" + " --- |" * len(budgets)
    md += ["## Worst member (lowest accuracy relative to full)", ""]
    md += [
        f"Left out: eviction-trained members ({', '.join(evicted) or 'none'}), dropped text tasks "
        f"({', '.join(dropped) or 'none'}) and model-bound cells.",
        "",
        head,
        rule,
    ]
    scored = {n: r for n, r in results.items() if counts(r)}
    for label in _labels(scored):
        w = worst_member(results, label, budgets)
        md.append(
            f"| {label} | " + " | ".join(f"{w[str(b)][0]:.3f} ({w[str(b)][1]})" for b in budgets) + " |"
        )
    if previous and previous in _labels(scored):
        md += protocol_table(scored, budgets, previous)
    md += [
        "",
        "Ranking (the tuning protocol's score: the worst member's relative accuracy averaged over the "
        "budgets that are not model-bound; ties by the mean over members):",
        "",
        "| rank | row | worst member | mean |",
        "| --- | --- | --- | --- |",
    ]
    for i, (label, worst, mean) in enumerate(rank_configs(results, budgets), 1):
        md.append(f"| {i} | {label} | {worst:.3f} | {mean:.3f} |")
    return md + ["", f"Wall time: {seconds:.0f} s"]


def protocol_table(results: dict, budgets, previous: str) -> list[str]:
    """Per member that counts and budget, the default's accuracy minus ``previous``'s (points; a drop of more
    than 1 point fails); model-bound cells are shown but do not fail."""
    new = DEFAULT_POLICY if DEFAULT_POLICY in _labels(results) else "vlcache (defaults)"
    md = ["", f"Protocol check: `{new}` minus `{previous}` (accuracy points; fails below -1):", ""]
    md += [
        "| member | " + " | ".join(f"{b:.0%}" for b in budgets) + " | holds |",
        "| --- |" + " --- |" * (len(budgets) + 1),
    ]
    for name, r in results.items():
        diffs = [100 * (r["rows"][new][str(b)] - r["rows"][previous][str(b)]) for b in budgets]
        live = [d for d, b in zip(diffs, budgets, strict=True) if not model_bound(r, b)]
        holds = "yes" if not live or min(live) >= -1.0 - 1e-9 else "no"
        cells = [
            f"{d:+.1f}{BOUND_MARK if model_bound(r, b) else ''}" for d, b in zip(diffs, budgets, strict=True)
        ]
        md.append(f"| {name} | " + " | ".join(cells) + f" | {holds} |")
    return md


def plot(results: dict, budgets, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if r.get("rows")]
    if not names:
        return
    cols = min(3, len(names) + 1)
    rows = (len(names) + 1 + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    xs = [b * 100 for b in budgets]
    colour = {
        label: f"C{i % 10}" for i, label in enumerate([*ORACLES, *_labels({n: results[n] for n in names})])
    }
    for ax, name in zip(axes.flat, names, strict=False):
        r = results[name]
        for label in [*(o for o in ORACLES if o in r["rows"]), *_labels({name: r})]:
            style = "--" if label in ORACLES else "-"
            ys = [r["rows"][label][str(b)] / r["full"] if r["full"] else 0 for b in budgets]
            ax.plot(xs, ys, style, marker="o", label=label, color=colour.get(label))
        title = name + (f" ({EVICTION_MARK})" if r.get("eviction_trained") else "")
        ax.set_title(f"{title}, n={r['n']}", fontsize=9)
    ax = axes.flat[len(names)]
    for label in _labels({n: results[n] for n in names}):
        w = worst_member(results, label, budgets)
        ax.plot(xs, [w[str(b)][0] for b in budgets], marker="o", label=label, color=colour[label])
    ax.set_title("worst member (counting members)", fontsize=9)
    for ax in list(axes.flat)[: len(names) + 1]:
        ax.set_xscale("log")
        ax.set_xlabel("KV budget (%)")
        ax.set_ylabel("accuracy / full")
        ax.set_ylim(0, 1.05)
    for ax in list(axes.flat)[len(names) + 1 :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
