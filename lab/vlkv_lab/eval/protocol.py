"""``vlkv eval protocol FILES --out DIR``: the tuning protocol (v2.2) recomputed from saved results.

Reads ``vlkv eval zoo --ablation`` outputs (``zoo.json`` / ``zoo_ablation.json``; several files are merged
per split and member, so rows and members run apart add up: ``protocol_rules.load``), decides the text
dimension (``text_preset``, on the real-text tasks) and then the image dimension (every other option)
(``protocol_kinds.py``; the rules are ``protocol_rules.py``'s, v2's), and writes both dimensions' tables
(scores, leave-one-member-out folds, held-out before / after) and verdicts to ``DIR/protocol.md`` and
``DIR/protocol.json``. No model is run.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlkv_lab.eval.protocol_kinds import Dimension, decide_kinds, is_text
from vlkv_lab.eval.protocol_rules import (
    BUDGETS,
    MAX_DROP,
    accuracies,
    drops,
    is_real,
    load,
    points,
)
from vlkv_lab.eval.zoo_report import model_bound

VERSION = "2.2"
"""v2.2 (2026-11-28): v2.1 with the tie rule of ``protocol_ties.py``."""
TITLES = {"text": "Text-only prompts: `text_preset`", "image": "Image prompts: every other option"}


def verdict(dim: Dimension) -> str:
    if dim.note:
        return dim.note
    d = dim.decision
    if d.adopted:
        extra = f' (`text_preset="{dim.preset}"`)' if dim.preset else ""
        return f"`{d.choice.label}` **adopted**{extra}"
    return f"`{d.choice.label}` **not adopted**: " + "; ".join(d.reasons)


def _members_line(dim: Dimension, train: dict) -> str:
    real = [n for n in dim.members if is_real(n, train[n])]
    line = f"Members: {', '.join(dim.members) or 'none'}; real: {', '.join(real) or 'none'}."
    if dim.kind == "image" and dim.members:
        line += (
            " The text tasks take part: no text preset was adopted, so an image option also changes text-only "
            "prompts."
            if dim.texts_judge
            else " The text tasks are left out: the adopted text preset compresses text-only prompts."
        )
    return line + f" Candidates: {', '.join(f'`{x}`' for x in dim.labels) or 'none'}."


def _scores(dim: Dimension) -> list[str]:
    md = [
        "### Scores on the training splits",
        "",
        "| candidate | score (every member) | real members (decoder, text) | the others | mean over members "
        "| changed answers | changed budgets |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, w, a, b, c in dim.choice.table:
        mark = " (chosen)" if label == dim.choice.label else (" (current)" if label == dim.current else "")
        answers, budgets = dim.choice.changes.get(label, (None, None))
        shown = ["-" if v is None else str(v) for v in (answers, budgets)]
        md.append(f"| {label}{mark} | {w:.3f} | {a:.3f} | {b:.3f} | {c:.3f} | {shown[0]} | {shown[1]} |")
    md.append("")
    md.append(
        "Ties (v2.2): among candidates equal on the scores, fewer changed answers (training examples, against "
        "the current default), then fewer changed budgets (the resolved policy), then the table's order."
    )
    if dim.choice.not_comparable:
        md.append(
            "Not comparable (no per-example hits for a tied row): "
            + ", ".join(dim.choice.not_comparable)
            + "; left out of the changed answers."
        )
    return md + [""]


def _folds(dim: Dimension, heldout: dict, budgets) -> list[str]:
    d, pct = dim.decision, " / ".join(f"{b:.0%}" for b in budgets)
    md = [
        f"### Leave-one-member-out (held-out, {pct}; points against `{d.current}`; fails below -{MAX_DROP:g}; "
        "`*`: model-bound, not checked)",
        "",
        "| left out | choice on the others | choice held-out | current held-out | points | holds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in d.folds:
        mine = f.accuracy.get(f.choice, [None] * len(budgets))
        base = f.accuracy.get(d.current, [None] * len(budgets))
        ok = "yes" if f.holds else ("not measured" if not f.measured else "no")
        r = heldout.get(f.left_out, {"rows": {}})
        bound = [bool(r.get("rows")) and model_bound(r, b) for b in budgets]
        diffs = drops(r, f.choice, d.current, budgets, every_budget=True) if f.measured else f.diffs
        md.append(
            f"| {f.left_out} | {f.choice} | {accuracies(mine)} | {accuracies(base)} | {points(diffs, bound)} "
            f"| {ok} |"
        )
    return md + [""]


def _shown(dim: Dimension, name: str) -> bool:
    """The held-out members a dimension's before / after table shows: the text tasks for the text
    dimension; for the image one every member, the text tasks only while they take part."""
    return is_text(name) if dim.kind == "text" else dim.texts_judge or not is_text(name)


def _heldout(dim: Dimension, heldout: dict, budgets) -> list[str]:
    label, pct = dim.choice.label, " / ".join(f"{b:.0%}" for b in budgets)
    md = [
        f"### Held-out: `{label}` against `{dim.current}` ({pct})",
        "",
        "| member | current | choice | points (`*`: model-bound, not checked unless real) |",
        "| --- | --- | --- | --- |",
    ]
    for name, r in heldout.items():
        rows = r.get("rows", {})
        if dim.current not in rows or not _shown(dim, name):
            continue
        mark = (
            " (eviction-trained)" if r.get("eviction_trained") else (" (dropped)" if "dropped" in r else "")
        )
        cur = [rows[dim.current].get(str(b)) for b in budgets]
        new = [rows.get(label, {}).get(str(b)) for b in budgets]
        diffs = drops(r, label, dim.current, budgets, every_budget=True)
        bound = [model_bound(r, b) for b in budgets]
        md.append(
            f"| {name}{mark} (n={r.get('n')}, full {r.get('full', 0):.3f}) | {accuracies(cur)} | "
            f"{accuracies(new)} | {points(diffs, bound)} |"
        )
    return md + [""]


def _image_check(dim: Dimension) -> list[str]:
    md = [
        "### Image members: the text-preset rows against the current default (held-out, per example)",
        "",
    ]
    rows = [(m, x, v) for m, by in dim.image_check.items() for x, v in by.items()]
    if not rows:
        return md + ["No image member in these files: not measured.", ""]
    md += ["| image member | row | answers |", "| --- | --- | --- |"]
    md += [f"| {m} | {x} | {v} |" for m, x, v in rows]
    return md + [""]


def render_dimension(dim: Dimension, train: dict, heldout: dict, budgets=BUDGETS) -> list[str]:
    md = [f"## {TITLES[dim.kind]}", "", _members_line(dim, train), ""]
    if dim.choice is not None:
        md += _scores(dim)
    if dim.decision is not None:
        md += _folds(dim, heldout, budgets)
    if dim.choice is not None:
        md += _heldout(dim, heldout, budgets)
    if dim.kind == "text":
        md += _image_check(dim)
    return md + [f"**Verdict ({dim.kind})**: {verdict(dim)}.", ""]


def render(text: Dimension, image: Dimension, train: dict, heldout: dict, command: str, budgets=BUDGETS):
    md = [f"# Tuning protocol v{VERSION} (per prompt kind)", "", f"Command: `{command}`", ""]
    return (
        md
        + render_dimension(text, train, heldout, budgets)
        + render_dimension(image, train, heldout, budgets)
    )


def summary(dim: Dimension) -> dict:
    d = dim.decision
    out = {
        "members": dim.members,
        "candidates": dim.labels,
        "current": dim.current,
        "decided": d is not None,
        "note": dim.note,
        "choice": dim.choice.label if dim.choice else None,
        "adopted": dim.adopted,
        "verdict": verdict(dim),
        "reasons": d.reasons if d else [],
        "folds": [
            {"left_out": f.left_out, "choice": f.choice, "points": f.diffs, "holds": f.holds} for f in d.folds
        ]
        if d
        else [],
        "heldout_points": d.checks if d else {},
        "table": dim.choice.table if dim.choice else [],
        "changes": dim.choice.changes if dim.choice else {},
        "not_comparable": dim.choice.not_comparable if dim.choice else [],
    }
    if dim.kind == "text":
        out |= {"preset": dim.preset, "image_check": dim.image_check}
    else:
        out["text_tasks_judge"] = dim.texts_judge
    return out


def run_protocol(args) -> int:
    paths = args.protocol
    try:
        data = load(paths)
    except ValueError as e:
        raise SystemExit(f"vlkv eval protocol: {e}") from None
    train, heldout = data.get("train", {}), data.get("heldout", {})
    if not train:
        raise SystemExit("vlkv eval protocol: no training-split results among " + ", ".join(paths))
    text, image = decide_kinds(train, heldout)
    command = "vlkv eval protocol " + " ".join(str(p) for p in paths)
    md = render(text, image, train, heldout, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "protocol.md").write_text("\n".join(md) + "\n")
    result = {"version": VERSION, "text": summary(text), "image": summary(image)}
    (out / "protocol.json").write_text(json.dumps(result, indent=1))
    print("\n".join(md))
    print(f"wrote {out / 'protocol.md'} and protocol.json")
    return 0
