"""The tuning protocol's rules (v2, ``common/compression/README.md``): scores, choice, folds, adoption.

Computed from saved ``vlkv eval zoo --ablation`` results (``load``), without running a model, over a set of
members and candidate rows (``protocol_kinds.py`` picks them per prompt kind; ``protocol.py`` prints):

- **Members that count**: not eviction-trained, not a dropped text task. The real-decoder members and the
  real-text tasks (SmolLM2) come first, the others second (``choose``).
- **A candidate's score** on a set of members: per budget, the worst member's accuracy relative to its better
  oracle row, model-bound cells (better oracle < 0.9 of full) left out; averaged over the budgets.
- **Choosing** (``choose``): the best score on every member; among the candidates within ``TIE``
  of it (1 point, or two items of the smallest n when that is more: one item is 2 points at n = 50), the best
  score on the real members, then on the others, then the mean relative accuracy over every member; then
  (v2.2, ``protocol_ties.py``) fewer changed answers, then fewer changed budgets against the current default;
  then the table's order.
- **Leave-one-member-out** (``lomo``): per member, the choice on the *other* members' training
  splits, checked on the left-out member's held-out split against the current default: no budget (not
  model-bound) more than ``MAX_DROP`` points below it.
- **Adopting** (``decide``): the choice on every member's training split becomes the default only if every
  fold holds, it is the choice of at least half of the folds (a candidate that wins only when every member
  is seen is tuned to the set), and on the held-out splits it lowers no member that counts by more than
  ``MAX_DROP`` points at a budget that is not model-bound, nor a real-decoder member or text task at any
  budget.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from vlkv.common.compression.registry import DEFAULT_POLICY

from vlkv_lab.eval.lab_policy import VLCACHE_FAMILY
from vlkv_lab.eval.protocol_ties import is_text, kind_of, tie_keys
from vlkv_lab.eval.zoo_report import better_oracle, counts, finalize, model_bound
from vlkv_lab.eval.zoo_scoring import ORACLES

BUDGETS = (0.01, 0.02, 0.05, 0.10)
CURRENT = "vlcache (defaults)"
"""The current default's row in ``--ablation`` runs (``DEFAULT_POLICY``'s label in the plain run)."""
TIE = 0.01
"""Scores on the real members within this of the best (or within ``TIE_ITEMS`` items of the smallest real
member's n, when that is more) go on to the other members' score."""
TIE_ITEMS = 2
"""A difference of two items at n = 50 (4 points) is noise, not a choice."""
MAX_DROP = 1.0
"""Accuracy points a choice may lose against the current default on a held-out member at a budget."""


def load(paths) -> dict[str, dict[str, dict]]:
    """``{split: {member: result}}`` from ``vlkv eval zoo`` JSON files, rows of one member and split merged
    (the per-example hits of a row run twice must agree in n; the later file's are kept). A label whose
    recorded policies (``configs[label]["resolved"]``) differ between two files ran two policies under one
    name, as "vlcache (defaults)" does across a change of the defaults: refused, not merged."""
    out: dict[str, dict[str, dict]] = {}
    configs: dict = {}
    source: dict[str, str] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        split = data.get("split", "heldout")
        for label, config in data.get("configs", {}).items():
            before = configs.get(label, {}).get("resolved")
            if before is not None and config.get("resolved") not in (None, before):
                raise ValueError(
                    f"{path}: the row {label!r} recorded other policies than in {source[label]}: one label, "
                    "two policies (its options or the defaults changed between the runs); give files whose "
                    "rows with one label ran one policy"
                )
            if before is None or config.get("resolved") is not None:  # a record beats a bare config
                configs[label], source[label] = config, path
        for name, r in data["results"].items():
            into = out.setdefault(split, {}).setdefault(name, {k: v for k, v in r.items() if k != "hits"})
            if "dropped" in r:
                into["dropped"] = r["dropped"]
            hits = into.setdefault("hits", {})
            for label, by_b in r.get("hits", {}).items():
                for b, h in by_b.items():
                    old = hits.get(label, {}).get(b)
                    if old is not None and len(old) != len(h):
                        raise ValueError(f"{path}: {name} {label} at {b}: n {len(h)} but {len(old)} before")
                    hits.setdefault(label, {})[b] = h
    for results in out.values():
        for r in results.values():
            finalize(r)
            r.setdefault("configs", configs)
    return out


def is_real(name: str, r: dict) -> bool:
    """A real-decoder member or a real-text task (SmolLM2-135M-Instruct)."""
    return bool(r.get("real_decoder", is_text(name) or "SmolLM2" in r.get("geometry", "")))


def current_label(results: dict) -> str:
    labels = {label for r in results.values() for label in r.get("rows", {})}
    return CURRENT if CURRENT in labels else DEFAULT_POLICY


def oracle_of(r: dict, b) -> float:
    """The better oracle row's accuracy at ``b`` (the full cache's when no oracle was run)."""
    oracle = better_oracle(r, b)
    return r["full"] if oracle is None else oracle


def relative(r: dict, label: str, b) -> float | None:
    """Accuracy relative to the better oracle; None where model-bound or not measured."""
    acc = r.get("rows", {}).get(label, {}).get(str(b))
    if acc is None or model_bound(r, b):
        return None
    oracle = oracle_of(r, b)
    return acc / oracle if oracle else None


def score(results: dict, label: str, names, budgets=BUDGETS) -> float:
    """Per budget the worst of ``names``' relative accuracies (model-bound cells left out), averaged over the
    budgets that have one; nan when none has."""
    worst = []
    for b in budgets:
        rel = [x for n in names if (x := relative(results[n], label, b)) is not None]
        if rel:
            worst.append(min(rel))
    return sum(worst) / len(worst) if worst else float("nan")


def mean_relative(results: dict, label: str, names, budgets=BUDGETS) -> float:
    rel = [x for n in names for b in budgets if (x := relative(results[n], label, b)) is not None]
    return sum(rel) / len(rel) if rel else float("nan")


def counting(results: dict) -> list[str]:
    """Members that count, the real-decoder members and text tasks first."""
    names = [n for n, r in results.items() if counts(r)]
    return sorted(names, key=lambda n: not is_real(n, results[n]))


def candidates(results: dict, names=None) -> list[str]:
    """vlcache's rows (the ``--ablation`` rows whose policy is vlcache; baselines and oracles left out),
    in the table's order, that every member of ``names`` (default: every member that counts) has."""
    names = counting(results) if names is None else list(names)
    if not names:
        return []
    first = results[names[0]]
    configs = first.get("configs", {})
    labels = [x for x in first.get("rows", {}) if x not in ORACLES]
    if configs:
        labels = [x for x in labels if configs.get(x, {}).get("policy") in VLCACHE_FAMILY]
    else:
        labels = [x for x in labels if not x.endswith("(baseline)") and x == x.strip()]
    return [x for x in labels if all(x in results[n].get("rows", {}) for n in names)]


@dataclass
class Choice:
    label: str
    table: list[tuple[str, float, float, float, float]]  # (candidate, every member, real, others, mean)
    changes: dict = field(default_factory=dict)  # v2.2: {candidate: (changed answers, changed budgets)}
    not_comparable: list[str] = field(default_factory=list)  # members left out of the changed answers


def _key(x: float) -> float:
    return -1.0 if math.isnan(x) else x


def choose(results: dict, names, labels, budgets=BUDGETS, kind: str | None = None) -> Choice:
    """The candidate with the best score on every member of ``names`` (the worst member's); among those within
    the tie of it (``TIE``, or ``TIE_ITEMS`` items of the smallest n when that is more), the best score on the
    real members, then on the others, then the best mean; then (v2.2) fewer changed answers, then fewer changed
    budgets for prompts of ``kind`` ("text" / "image"; default: "text" when every member is a text task)
    against the current default (``protocol_ties.py``); then the table's order."""
    real = [n for n in names if is_real(n, results[n])]
    other = [n for n in names if n not in real]
    rows = [
        (
            x,
            score(results, x, names, budgets),
            score(results, x, real, budgets),
            score(results, x, other, budgets),
            mean_relative(results, x, names, budgets),
        )
        for x in labels
    ]
    best = max(_key(row[1]) for row in rows)
    tie = max(TIE, TIE_ITEMS / min(results[n].get("n") or 1 for n in names))
    pool = [row for row in rows if _key(row[1]) >= best - tie - 1e-12]
    kind = kind or kind_of(names)
    changes, skipped = tie_keys(
        results, names, labels, [r[0] for r in pool], current_label(results), kind, budgets
    )

    def smaller(label: str) -> tuple:
        answers, budgets_changed = changes[label]
        return (math.inf if answers is None else answers, budgets_changed)

    ranked = sorted(pool, key=lambda t: (*(-_key(v) for v in t[2:]), *smaller(t[0])))
    rest = sorted(
        (r for r in rows if r not in pool), key=lambda t: (*(-_key(v) for v in t[1:]), *smaller(t[0]))
    )
    return Choice(ranked[0][0], ranked + rest, changes, skipped)


def drops(r: dict, label: str, base: str, budgets=BUDGETS, every_budget: bool = False) -> list:
    """Per budget ``label``'s accuracy minus ``base``'s in points; None where not measured, or model-bound
    (unless ``every_budget``)."""
    out = []
    for b in budgets:
        rows = r.get("rows", {})
        a, c = rows.get(label, {}).get(str(b)), rows.get(base, {}).get(str(b))
        skip = a is None or c is None or (model_bound(r, b) and not every_budget)
        out.append(None if skip else 100 * (a - c))
    return out


def holds(diffs: list) -> bool:
    """No measured budget more than ``MAX_DROP`` points down (None cells are not checked)."""
    return all(d >= -MAX_DROP - 1e-9 for d in diffs if d is not None)


@dataclass
class Fold:
    left_out: str
    choice: str
    diffs: list  # held-out points per budget against the current default (None: model-bound / missing)
    accuracy: dict = field(default_factory=dict)  # {label: [held-out accuracy per budget]}
    measured: bool = True

    @property
    def holds(self) -> bool:
        return self.measured and holds(self.diffs)


def lomo(
    train: dict, heldout: dict, labels, current: str, budgets=BUDGETS, names=None, kind: str | None = None
) -> list[Fold]:
    """One fold per member of ``names`` (default: every member that counts): the choice on the others'
    training splits, checked on its held-out."""
    names = counting(train) if names is None else list(names)
    folds = []
    for left in names:
        pick = choose(train, [n for n in names if n != left], labels, budgets, kind or kind_of(names)).label
        r = heldout.get(left, {})
        rows = r.get("rows", {})
        measured = pick in rows and current in rows
        acc = {x: [rows[x].get(str(b)) for b in budgets] for x in (pick, current) if x in rows}
        diffs = drops(r, pick, current, budgets) if measured else [None] * len(budgets)
        folds.append(Fold(left, pick, diffs, acc, measured))
    return folds


@dataclass
class Decision:
    choice: Choice
    folds: list[Fold]
    current: str
    checks: dict  # {member: [points per budget]} of the choice against the current default, held-out
    adopted: bool
    reasons: list[str]
    names: list[str] = field(default_factory=list)  # the members scored (and left out one at a time)
    labels: list[str] = field(default_factory=list)  # the candidates


def checked_v2(name: str, r: dict) -> bool:
    """Held-out members v2 checks a choice on: those that count, and the real ones (not dropped)."""
    return (counts(r) or is_real(name, r)) and "dropped" not in r


def decide(
    train: dict, heldout: dict, budgets=BUDGETS, names=None, labels=None, checked=checked_v2, kind=None
) -> Decision:
    """v2 over ``names`` (default: every member that counts) and ``labels`` (default: ``candidates``); the
    held-out check covers the held-out members for which ``checked(name, result)`` is true; ``kind``: the
    prompt kind the v2.2 tie rule resolves policies for (default: ``protocol_ties.kind_of(names)``)."""
    names = counting(train) if names is None else list(names)
    labels = candidates(train, names) if labels is None else list(labels)
    if not labels:
        raise ValueError("no candidate row that every member that counts has on the training split")
    current = current_label(train)
    kind = kind or kind_of(names)
    choice = choose(train, names, labels, budgets, kind)
    folds = lomo(train, heldout, labels, current, budgets, names, kind)
    reasons = []
    if choice.label == current:
        reasons.append("the choice is the current default")
    failed = [f.left_out for f in folds if not f.holds]
    if failed:
        reasons.append("folds that do not hold (or were not measured): " + ", ".join(failed))
    wins = sum(f.choice == choice.label for f in folds)
    if 2 * wins < len(folds):
        reasons.append(f"tuned to the set: the choice wins {wins} of {len(folds)} folds")
    checks = {}
    for name, r in heldout.items():
        if not checked(name, r):
            continue
        checks[name] = drops(r, choice.label, current, budgets, every_budget=is_real(name, r))
        if not holds(checks[name]):
            reasons.append(f"held-out {name}: {points(checks[name])}")
    missing = [n for n in names if n not in checks]
    if missing:
        reasons.append("not measured held-out: " + ", ".join(missing))
    return Decision(choice, folds, current, checks, not reasons, reasons, names, labels)


def points(diffs, bound=None) -> str:
    marks = bound or [False] * len(diffs)
    return " / ".join(
        "-" if d is None else f"{d:+.1f}{'*' if b else ''}" for d, b in zip(diffs, marks, strict=True)
    )


def accuracies(xs) -> str:
    return " / ".join("-" if x is None else f"{x:.3f}" for x in xs)
