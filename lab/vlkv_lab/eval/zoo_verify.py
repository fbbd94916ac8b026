"""``vlkv eval zoo --verify``: verified compression's rows beside the fixed candidates it chooses from.

Per member and requested budget (the zoo's 1, 2, 5 and 10%) every example is asked again through the
in-process stack (``deploy/inprocess.py``: the gateway's ``prepare_request``, ``PrefillEngine.run`` with the
server's verification defaults ``VerifyConfig()``, the decode worker's core), once with ``verify="floor"`` and
once with ``verify="select"``, as a request that names only its budget (``explicit`` False; ``vlkv generate
--budget B``). The answer is the one decoded from the kept compressed cache, scored by the member's
``is_correct``. Each verifier row records its accuracy, the realized budget (the mean of the kept caches'
``compression_ratio``), the share of requests whose budget was raised, the share that met the floor, the
candidates kept, and how many kept caches are the kept candidate's own cache at the kept budget as the zoo
compresses it (a check of the two paths, ``same``). One engine per mode and member, kept across its chunks:
its ``Ledger`` sees the member's requests in order, as one server would (after ``learn_after`` requests at a
budget its learned candidate order applies).

The fixed candidates (``VERIFY_CANDIDATES``) are scored as the zoo scores its rows (one prefill, ``compress``,
decoded together, ``zoo_scoring.score_rows``): at the zoo's budgets from the zoo's own rows where one is the
same policy (``vlcache`` is the candidate ``default``, ``vlcache before the zoo`` is ``paper``), and at the
budgets ``floor`` raises through (``FRONTIER``: 4, 8, 16%, doubling from 1 and 2%, and the cap, 25%) with the
two oracle rows, so each verifier point is read against every candidate's curve at equal realized budget
(``frontier``: accuracy interpolated linearly in log realized budget; past a curve's last point, that point).
A verifier point holds when it is at or above every candidate's curve there, within ``WITHIN`` (1 point).

Written into a member's result as ``verify`` (``zoo.json``), rendered by ``render`` after the zoo's tables and
plotted by ``plot`` (``zoo_verify.png``: accuracy against realized budget per member).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from vlkv.common.compression.registry import (
    DEFAULT_POLICY,
    CompressionSettings,
    get_policy,
    policy_from_dict,
)
from vlkv.common.compression.verify import VERIFY_CANDIDATES, VerifyConfig
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.inprocess import InProcessEngine

from vlkv_lab.eval.evaluation import compress
from vlkv_lab.eval.zoo_scoring import FULL, ORACLES, full_answers, score_rows, wilson

MODES = ("floor", "select")
LABELS = {mode: f"verify: {mode}" for mode in MODES}
FRONTIER = (0.04, 0.08, 0.16, 0.25)
"""Budgets the fixed candidates and the oracles are also scored at: where ``floor`` raises to (doubling from
1 and 2%; 20% from 5 and 10% lies between 16 and 25) and the default cap."""
WITHIN = 0.01
CONFIG = VerifyConfig()
"""The verification the rows run: the server's defaults (``vlkv serve`` with no ``--verify`` flags); each
mode's engine takes it with its ``mode``."""
ORACLE = "better oracle"
FIELDS = ("hits", "ratio", "raises", "budget", "candidate", "agreement", "floor_met", "same")


def candidate_rows(configs) -> list[tuple[str, str, dict, str]]:
    """``(label, policy, params, zoo row)`` per verification candidate; ``zoo row``: the label of the run's
    ``(label, policy, params)`` row that builds the same policy ("" when none does)."""
    out = []
    for label, d in VERIFY_CANDIDATES:
        built = policy_from_dict(d).to_dict()
        row = next((r for r, p, params in configs if get_policy(p, **params).to_dict() == built), "")
        out.append((label, d["policy"], {k: v for k, v in d.items() if k != "policy"}, row))
    return out


def _question(example) -> str:
    """The text of the example's one user turn (what ``build_request(question=...)`` sends after its images)."""
    return "".join(p["text"] for p in example.messages[-1]["content"] if p.get("type") == "text")


class Verified:
    """One member's verifier rows and the candidates' curves, chunk by chunk (``score``), then ``result``."""

    def __init__(self, model, processor, task, budgets, configs, config: VerifyConfig | None = None) -> None:
        self.model, self.processor, self.task = model, processor, task
        self.budgets = [float(b) for b in budgets]
        self.frontier = [b for b in FRONTIER if b not in self.budgets]
        self.config = config or CONFIG
        self.engines = {
            m: InProcessEngine(model, processor, verify=replace(self.config, mode=m)) for m in MODES
        }
        self.candidates = candidate_rows(configs)
        self.modes: dict = {m: {} for m in MODES}
        self.curves: dict = {}

    def _ask(self, mode: str, budget: float, prepared) -> list:
        """Every example at ``budget`` through the engine of ``mode``: ``(generation, PrefillResult)``."""
        engine = self.engines[mode]
        settings = CompressionSettings(budget=budget, explicit=False, verify=mode)
        sampling = SamplingConfig(max_new_tokens=self.task.max_new_tokens)
        reqs = [
            engine.prepare(
                p.example.images, question=_question(p.example), sampling=sampling, compression=settings
            )
            for p in prepared
        ]
        results: list = []
        run = engine.prefill.run
        engine.prefill.run = lambda req: results.append(run(req)) or results[-1]  # the kept caches' verdicts
        try:
            generations = engine.generate_batch(reqs)
        finally:
            del engine.prefill.run
        return list(zip(generations, results, strict=True))

    def _same(self, prep, verdict, cache) -> bool:
        """Whether the kept cache keeps the positions the zoo's ``compress`` keeps for the kept candidate at the
        kept budget."""
        row = next((c for c in self.candidates if c[0] == verdict.candidate), None)
        if row is None or cache.kept_indices is None:
            return False
        fixed = compress(prep, row[1], verdict.budget, **row[2])
        if fixed.kept_indices is None or fixed.layer_lengths != cache.layer_lengths:
            return False
        return all(
            a.cpu().equal(b.cpu()) for a, b in zip(fixed.kept_indices, cache.kept_indices, strict=True)
        )

    def score(self, prepared, zoo_hits: dict) -> None:
        """One chunk: the verifier rows, then the candidates' and oracles' curves (``zoo_hits``: this chunk's
        zoo rows, ``score_chunk``'s result, read where a candidate is one of them)."""
        for mode in MODES:
            for b in self.budgets:
                cell = self.modes[mode].setdefault(str(b), {f: [] for f in FIELDS})
                for prep, (gen, res) in zip(prepared, self._ask(mode, b, prepared), strict=True):
                    v = res.verdict
                    cell["hits"].append(bool(self.task.is_correct(gen.text, prep.example)))
                    cell["ratio"].append(res.cache.compression_ratio)
                    cell["raises"].append(v.raises)
                    cell["budget"].append(v.budget)
                    cell["candidate"].append(v.candidate)
                    cell["agreement"].append(v.agreement)
                    cell["floor_met"].append(bool(v.floor_met))
                    cell["same"].append(self._same(prep, v, res.cache))
        self._curves(prepared, zoo_hits)

    def _curves(self, prepared, zoo_hits: dict) -> None:
        max_new = self.task.max_new_tokens
        ids, _ = full_answers(self.model, self.processor, prepared, max_new)
        missing = [(label, p, params) for label, p, params, row in self.candidates if not row]
        right: dict = {}
        if missing:
            right |= score_rows(
                self.model, self.processor, prepared, ids, missing, self.budgets, max_new, False
            )
        if self.frontier:
            rows = [(label, p, params) for label, p, params, _ in self.candidates]
            got = score_rows(self.model, self.processor, prepared, ids, rows, self.frontier, max_new, True)
            for label, by_b in got.items():
                right.setdefault(label, {}).update(by_b)
        every = [*self.budgets, *self.frontier]
        for label, policy, params, row in self.candidates:
            curve = self.curves.setdefault(label, {"row": row, "hits": {}, "ratio": {}})
            for b in every:
                hits = zoo_hits[row][str(b)] if row and b in self.budgets else right[label][str(b)]
                curve["hits"].setdefault(str(b), []).extend(bool(h) for h in hits)
                ratios = [compress(p, policy, b, **params).compression_ratio for p in prepared]
                curve["ratio"].setdefault(str(b), []).extend(ratios)
        # the oracles keep the default policy's total (at its per-layer budgets, or spread by answer mass)
        default = [[compress(p, DEFAULT_POLICY, b).compression_ratio for p in prepared] for b in every]
        for oracle in ORACLES:
            curve = self.curves.setdefault(oracle, {"row": oracle, "hits": {}, "ratio": {}})
            for b, ratios in zip(every, default, strict=True):
                hits = zoo_hits[oracle][str(b)] if b in self.budgets else right[oracle][str(b)]
                curve["hits"].setdefault(str(b), []).extend(bool(h) for h in hits)
                curve["ratio"].setdefault(str(b), []).extend(ratios)

    def result(self) -> dict:
        cfg = self.config
        return {
            "config": {"floor": cfg.floor, "max_budget": cfg.max_budget, "draft_tokens": cfg.draft_tokens},
            "learn_after": cfg.learn_after,
            "budgets": self.budgets,
            "frontier": self.frontier,
            "candidates": [label for label, *_ in self.candidates],
            "modes": self.modes,
            "curves": self.curves,
        }


# -- figures ---------------------------------------------------------------------------------------------


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def point(cell: dict) -> dict:
    """A row's figures at one budget: accuracy, n, realized mean budget, share raised (verifier rows)."""
    out = {"accuracy": _mean(cell["hits"]), "n": len(cell["hits"]), "realized": _mean(cell["ratio"])}
    if "raises" in cell:
        out["raised"] = _mean([r > 0 for r in cell["raises"]])
        out["floor_met"] = _mean(cell["floor_met"])
        out["same"] = _mean(cell["same"])
    return out


def as_fixed(v: dict, mode: str, b) -> float:
    """The share of a verifier row's answers scored as the kept candidate's own fixed row scores that example
    at the kept budget (right or wrong alike), over the examples whose kept budget the curves hold; nan when
    none is."""
    cell = v["modes"][mode][str(float(b))]
    same = []
    for i, (label, kept, hit) in enumerate(zip(cell["candidate"], cell["budget"], cell["hits"], strict=True)):
        curves = v["curves"].get(label, {}).get("hits", {})
        key = next((k for k in curves if math.isclose(float(k), kept, rel_tol=1e-6)), None)
        if key is not None:  # the request's budget went through the wire's float32: 0.01 is 0.0099999998
            same.append(curves[key][i] == hit)
    return _mean(same)


def curve(v: dict, label: str) -> list[tuple[float, float, float]]:
    """``(realized, accuracy, requested)`` of a fixed row at every budget it was scored at, by realized budget;
    ``ORACLE``: the better of the two oracle rows at each budget."""
    if label == ORACLE:
        rows = [v["curves"][o] for o in ORACLES if o in v["curves"]]
        if not rows:
            return []
        pts = [
            (_mean(rows[0]["ratio"][b]), max(_mean(r["hits"][b]) for r in rows), float(b))
            for b in rows[0]["hits"]
        ]
    else:
        c = v["curves"][label]
        pts = [(_mean(c["ratio"][b]), _mean(c["hits"][b]), float(b)) for b in c["hits"]]
    return sorted(pts)


def at(points: list[tuple[float, float, float]], x: float) -> tuple[float, bool]:
    """The curve's accuracy at realized budget ``x`` (linear in log budget) and whether ``x`` lies past its
    last point (then the last point's accuracy)."""
    if not points:
        return float("nan"), False
    if x <= points[0][0]:
        return points[0][1], False
    if x >= points[-1][0]:
        return points[-1][1], x > points[-1][0] * (1 + 1e-9)
    for (x0, y0, _), (x1, y1, _) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            t = 0.0 if x1 == x0 else (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0), False
    return points[-1][1], False


def frontier(v: dict, mode: str, b) -> dict:
    """A verifier point against every candidate's curve at its realized budget: per candidate the curve's
    accuracy there, the margin (accuracy minus the best of them) and whether it holds (margin >= -WITHIN)."""
    p = point(v["modes"][mode][str(float(b))])
    fixed, beyond = {}, []
    for label in v["candidates"]:
        fixed[label], past = at(curve(v, label), p["realized"])
        if past:
            beyond.append(label)
    best = max(fixed, key=fixed.get)
    margin = p["accuracy"] - fixed[best]
    return {
        **p,
        "fixed": fixed,
        "best": best,
        "margin": margin,
        "holds": margin >= -WITHIN - 1e-12,
        "beyond": beyond,
    }


def oracle_at(v: dict, b: float) -> float | None:
    """The better oracle's accuracy at requested budget ``b`` (None where it was not scored)."""
    for _, y, requested in curve(v, ORACLE):
        if abs(requested - b) < 1e-12:
            return y
    return None


# -- tables and plot -------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _acc(cell: dict) -> str:
    k, n = sum(cell["hits"]), len(cell["hits"])
    lo, hi = wilson(k, n)
    return f"{k / n:.3f} ({lo:.2f}-{hi:.2f})" if n else "-"


def member_table(name: str, r: dict) -> list[str]:
    v = r["verify"]
    full = r.get("full", float("nan"))
    cfg = v["config"]
    md = [
        f"### {name}",
        "",
        f"n = {r.get('n', '?')}; full cache {full:.3f}. Verifier: floor {cfg['floor']}, cap {cfg['max_budget']:.0%}, "
        f"{cfg['draft_tokens']}-token draft, learned order after {v['learn_after']} requests per budget.",
        "",
        "| requested | row | accuracy (95%) | realized mean budget | raised | floor met | kept cache = the zoo's "
        "compress | scored as that fixed row |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in v["budgets"]:
        for label in v["candidates"]:
            c = v["curves"][label]
            cell = {"hits": c["hits"][str(b)], "ratio": c["ratio"][str(b)]}
            row = f" (row `{c['row']}`)" if c["row"] else ""
            md.append(
                f"| {b:.0%} | candidate {label}{row} | {_acc(cell)} | {_pct(_mean(cell['ratio']))} | - | - | - | - |"
            )
        for o in ORACLES:
            if o in v["curves"]:
                c = v["curves"][o]
                cell = {"hits": c["hits"][str(b)], "ratio": c["ratio"][str(b)]}
                md.append(f"| {b:.0%} | {o} | {_acc(cell)} | {_pct(_mean(cell['ratio']))} | - | - | - | - |")
        for mode in MODES:
            cell = v["modes"][mode][str(b)]
            p = point(cell)
            md.append(
                f"| {b:.0%} | **{LABELS[mode]}** | {_acc(cell)} | {_pct(p['realized'])} | {p['raised']:.0%} | "
                f"{p['floor_met']:.0%} | {p['same']:.0%} | {as_fixed(v, mode, b):.0%} |"
            )
    if v["frontier"]:
        md += ["", "The fixed rows at the budgets floor raises to (accuracy @ realized mean budget):", ""]
        md += ["| row | " + " | ".join(f"{b:.0%}" for b in v["frontier"]) + " |"]
        md += ["| --- |" + " --- |" * len(v["frontier"])]
        for label in [*v["candidates"], *(o for o in ORACLES if o in v["curves"])]:
            c = v["curves"][label]
            cells = [
                f"{_mean(c['hits'][str(b)]):.3f} @ {_pct(_mean(c['ratio'][str(b)]))}" for b in v["frontier"]
            ]
            md.append(f"| {label} | " + " | ".join(cells) + " |")
    md += [
        "",
        f"At equal realized budget: each verifier point against every candidate's curve there (interpolated "
        f"in log budget; `>`: past the curve's last point, read at it); holds: within {100 * WITHIN:.0f} point.",
        "",
        "| requested | row | realized | accuracy | "
        + " | ".join(v["candidates"])
        + " | margin (points) | holds |",
        "| --- | --- | --- | --- |" + " --- |" * len(v["candidates"]) + " --- | --- |",
    ]
    for b in v["budgets"]:
        for mode in MODES:
            f = frontier(v, mode, b)
            cells = [f"{f['fixed'][c]:.3f}{'>' if c in f['beyond'] else ''}" for c in v["candidates"]]
            md.append(
                f"| {b:.0%} | {LABELS[mode]} | {_pct(f['realized'])} | {f['accuracy']:.3f} | "
                + " | ".join(cells)
                + f" | {100 * f['margin']:+.1f} | {'yes' if f['holds'] else 'no'} |"
            )
    wins = {}
    for b in v["budgets"]:
        cands = v["modes"]["floor"][str(b)]["candidate"]
        wins[b] = ", ".join(
            f"{c} {cands.count(c)}" for c in sorted(set(cands), key=lambda c: -cands.count(c))
        )
    md += ["", "Kept by floor: " + "; ".join(f"{b:.0%}: {w}" for b, w in wins.items()) + "."]
    return md + [""]


def summary(results: dict) -> list[dict]:
    """Per member with verifier rows: whether floor holds at every budget, and the 2% question (floor at a
    requested 2% against 0.99 of full, where the better oracle reaches that at 4%)."""
    out = []
    for name, r in results.items():
        v = r.get("verify")
        if not v:
            continue
        full = r.get("full") or float("nan")
        checks = {b: frontier(v, "floor", b) for b in v["budgets"]}
        floor2 = point(v["modes"]["floor"]["0.02"]) if "0.02" in v["modes"]["floor"] else None
        oracle4 = oracle_at(v, 0.04)
        out.append(
            {
                "member": name,
                "eviction_trained": bool(r.get("eviction_trained")),
                "holds": {b: c["holds"] for b, c in checks.items()},
                "margin": {b: c["margin"] for b, c in checks.items()},
                "floor_2": floor2["accuracy"] / full if floor2 else None,
                "floor_2_realized": floor2["realized"] if floor2 else None,
                "oracle_4": oracle4 / full if oracle4 is not None else None,
            }
        )
    return out


def render(results: dict) -> list[str]:
    """The verifier section of ``zoo.md`` (members without verifier rows are left out)."""
    rows = summary(results)
    if not rows:
        return []
    md = ["", "## Verified compression (`--verify`)", ""]
    md += [
        "Answers decoded from the kept compressed cache through the in-process stack (`InProcessEngine(verify="
        "VerifyConfig())`, requests naming only a budget); fixed candidates and oracles as the zoo scores them.",
        "",
    ]
    budgets = list(rows[0]["holds"])
    md += [
        "| member | floor at or above every candidate at equal realized budget: "
        + ", ".join(f"{b:.0%}" for b in budgets)
        + " (margin, points) | floor at 2% / full (realized) | better oracle at 4% / full | 0.99 of full at 2% "
        "where the oracle has it at 4% |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in rows:
        held = ", ".join(f"{'yes' if s['holds'][b] else 'no'} ({100 * s['margin'][b]:+.1f})" for b in budgets)
        f2 = f"{s['floor_2']:.3f} ({_pct(s['floor_2_realized'])})" if s["floor_2"] is not None else "-"
        o4 = f"{s['oracle_4']:.3f}" if s["oracle_4"] is not None else "-"
        if s["oracle_4"] is None or s["floor_2"] is None:
            q = "-"
        elif s["oracle_4"] < 0.99:
            q = "n/a (oracle < 0.99 at 4%)"
        else:
            q = "yes" if s["floor_2"] >= 0.99 else "no"
        mark = " (eviction-trained)" if s["eviction_trained"] else ""
        md.append(f"| {s['member']}{mark} | {held} | {f2} | {o4} | {q} |")
    md.append("")
    for name, r in results.items():
        if r.get("verify"):
            md += member_table(name, r)
    return md


def plot(results: dict, path: Path) -> bool:
    """Accuracy against realized budget per member: a curve per fixed candidate, the better oracle (dashed),
    full (dotted) and the verifier's points; False when no member has verifier rows."""
    names = [n for n, r in results.items() if r.get("verify")]
    if not names:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        r, v = results[name], results[name]["verify"]
        for i, label in enumerate(v["candidates"]):
            pts = curve(v, label)
            ax.plot(
                [100 * x for x, *_ in pts],
                [y for _, y, _ in pts],
                "-",
                marker="o",
                ms=3,
                color=f"C{i}",
                label=f"candidate {label}",
            )
        pts = curve(v, ORACLE)
        if pts:
            ax.plot([100 * x for x, *_ in pts], [y for _, y, _ in pts], "--", color="grey", label=ORACLE)
        if r.get("full") is not None:
            ax.axhline(r["full"], linestyle=":", color="black", linewidth=0.8, label=FULL)
        for mode, marker, colour in (("floor", "*", "red"), ("select", "^", "purple")):
            ps = [(b, point(v["modes"][mode][str(b)])) for b in v["budgets"]]
            ax.scatter(
                [100 * p["realized"] for _, p in ps],
                [p["accuracy"] for _, p in ps],
                marker=marker,
                s=80 if marker == "*" else 40,
                color=colour,
                zorder=5,
                label=LABELS[mode],
            )
            for b, p in ps:
                ax.annotate(
                    f"{b:.0%}",
                    (100 * p["realized"], p["accuracy"]),
                    fontsize=6,
                    xytext=(3, -8),
                    textcoords="offset points",
                    color=colour,
                )
        ax.set_xscale("log")
        ax.set_xlabel("realized KV budget (%)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{name}, n={r.get('n', '?')}", fontsize=9)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
