"""Rows and tables of the kvpress text-suite run (95% Wilson intervals: ``zoo_scoring.wilson``, the zoo's).

A record (``kvpress_suite.run``) is one answer; a row is one (method, mode, task, length, budget) cell:
``{system, method, mode, task, length, budget, compression_ratio, kept_fraction, n, correct, accuracy, ci95,
errors, error}``. ``budget`` is vlkv's kept fraction (the key vlkv's own rows use), ``compression_ratio``
kvpress's (the fraction removed, ``1 - budget``), ``kept_fraction`` the measured share of the whole
prompt's K/V entries kept (in ``context`` mode the uncompressed question is counted). ``merge`` puts vlkv's
rows beside them on the shared key (task, length, budget).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from vlkv_lab.eval.zoo_scoring import wilson


def cell_key(row: dict) -> tuple[str, int, float]:
    """The key vlkv's rows and kvpress's share."""
    return (row["task"], int(row["length"]), round(float(row["budget"]), 6))


def aggregate(records: Iterable[dict], system: str = "kvpress") -> list[dict]:
    """One row per (method, mode, task, length, budget) from per-answer records; a method's ``all`` task
    pools every task of a length."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        for task in (r["task"], "all"):
            cells[(r["press"], r["mode"], task, int(r["length"]), round(float(r["budget"]), 6))].append(r)
    rows = []
    for (method, mode, task, length, budget), rs in sorted(cells.items(), key=lambda kv: _order(kv[0])):
        ok = [r for r in rs if not r.get("error")]
        correct = sum(bool(r["correct"]) for r in ok)
        kept = [r["kept_tokens"] / r["cache_tokens"] for r in ok if r.get("cache_tokens")]
        rows.append(
            {
                "system": system,
                "method": method,
                "mode": mode,
                "task": task,
                "length": length,
                "budget": budget,
                "compression_ratio": round(1.0 - budget, 6),
                "kept_fraction": sum(kept) / len(kept) if kept else math.nan,
                "n": len(ok),
                "correct": correct,
                "accuracy": correct / len(ok) if ok else math.nan,
                "ci95": list(wilson(correct, len(ok))),
                "errors": len(rs) - len(ok),
                "error": next((r["error"] for r in rs if r.get("error")), ""),
            }
        )
    return rows


def _order(key: tuple) -> tuple:
    method, mode, task, length, budget = key
    return (length, task == "all", task, mode != "full", mode, method, budget)


def merge(kvpress_rows: Iterable[dict], vlkv_rows: Iterable[dict]) -> dict[tuple, dict[str, dict]]:
    """``{(task, length, budget): {label: row}}`` with kvpress's rows labelled ``kvpress <method> (<mode>)``
    and vlkv's ``vlkv <method or policy>``. Two rows with one label in one cell are an error."""
    out: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row, system in [(r, "kvpress") for r in kvpress_rows] + [(r, "vlkv") for r in vlkv_rows]:
        method = row.get("method", row.get("policy"))
        label = f"{system} {method}" + (
            f" ({row['mode']})" if row.get("mode") and system == "kvpress" else ""
        )
        cell = out[cell_key(row)]
        if label in cell:
            raise ValueError(f"two rows for {label} at {cell_key(row)}")
        cell[label] = row
    return dict(out)


def vlkv_rows(zoo_results: dict, first: dict[tuple[str, int], int] | None = None) -> list[dict]:
    """vlkv's rows from ``vlkv eval zoo``'s ``results`` (its text tasks, named ``text <task> <K>K``, with
    per-item ``hits``), in this module's row shape, with the ``all`` task pooling a length's tasks (for the
    labels every task has: a dropped task has only ``full``). ``error``: why a task was dropped. first:
    per (task, length) score only the first n items (the suite's items are deterministic, so those are
    the very prompts kvpress answered)."""
    cells: dict[tuple, list[bool]] = {}
    dropped: dict[tuple, str] = {}
    tasks: dict[int, set[str]] = {}
    for name, r in zoo_results.items():
        parts = name.split()
        if len(parts) != 3 or parts[0] != "text" or not parts[2].endswith("K") or "hits" not in r:
            continue
        task, length = parts[1], int(parts[2][:-1]) * 1024
        cut = (first or {}).get((task, length))
        tasks.setdefault(length, set()).add(task)
        for label, by_budget in r["hits"].items():
            for b, hits in by_budget.items():
                cells[(label, task, length, round(float(b), 6))] = list(
                    hits[:cut] if cut is not None else hits
                )
        if r.get("dropped"):
            dropped[(task, length)] = r["dropped"]
    for (label, _task, length, budget), hits in list(cells.items()):  # "all": only labels every task has
        if all((label, t, length, budget) in cells for t in tasks[length]):
            cells.setdefault((label, "all", length, budget), []).extend(hits)
    rows = []
    for (label, task, length, budget), hits in cells.items():
        n, correct = len(hits), sum(bool(h) for h in hits)
        rows.append(
            {
                "system": "vlkv",
                "method": label,
                "mode": "full" if label == "full" else "prompt",
                "task": task,
                "length": length,
                "budget": budget,
                "n": n,
                "correct": correct,
                "accuracy": correct / n if n else math.nan,
                "ci95": list(wilson(correct, n)),
                "kept_fraction": math.nan,
                "errors": 0,
                "error": dropped.get((task, length), ""),
            }
        )
    return rows


def markdown(rows: list[dict], budgets: Iterable[float]) -> str:
    """One table per (length, task): a row per (method, mode), a column per budget, each cell the accuracy,
    its 95% Wilson interval and n; the ``full`` row's accuracy is repeated in every column."""
    budgets = [round(b, 6) for b in budgets]
    by_table: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        by_table[(r["length"], r["task"])][(r["method"], r["mode"], r["budget"])] = r
    out = []
    for (length, task), cells in sorted(
        by_table.items(), key=lambda kv: (kv[0][0], kv[0][1] == "all", kv[0][1])
    ):
        out += [f"#### {task}, {length} tokens", ""]
        dropped = {r["error"] for r in cells.values() if r.get("system") == "vlkv" and r.get("error")}
        out += [f"`vlkv eval zoo` dropped this task: {d}.\n" for d in sorted(dropped)]
        out.append("| method (mode) | " + " | ".join(f"{b:.0%} kept" for b in budgets) + " |")
        out.append("| --- |" + " --- |" * len(budgets))
        methods = list(dict.fromkeys((m, mode) for m, mode, _ in cells))
        for method, mode in methods:
            full = cells.get((method, mode, 1.0)) if mode == "full" else None
            line = [f"{method} ({mode})"]
            for b in budgets:
                r = full or cells.get((method, mode, b))
                line.append(_cell(r))
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if r["n"] == 0:
        return f"error: {r['error'][:60]}"
    lo, hi = r["ci95"]
    kept = "" if r["mode"] in ("full", "prompt") else f", kept {r['kept_fraction']:.1%}"
    return f"{r['accuracy']:.2f} [{lo:.2f}, {hi:.2f}] n={r['n']}{kept}"
