"""Protocol v2.2's tie rule (``common/compression/README.md``, "Protocol v2.2: ties go to the smaller change").

Among candidates the scores cannot separate (``protocol_rules.choose``'s keys all equal), the one that changes
less from the current default wins, before the table's order:

1. **fewer changed answers** (``answer_changes``): training hits, over the members scored and the protocol
   budgets, where the candidate's per-example hit differs from the current default's; the default counts 0.
   A member on which some tied candidate or the default lacks per-example hits at a budget both rows ran (or
   their n differ) is *not comparable*: it is left out of every candidate's count (so the counts stay like for
   like) and named in ``Choice.not_comparable``. A candidate without hits on a comparable member (only one
   outside the tie) counts ``None``, ranked last.
2. **fewer changed budgets** (``budget_changes``): protocol budgets at which the policy that compresses the
   dimension's prompt kind (text-only: ``tau = m``; image: ``tau < m``), resolved from the row's recorded config
   through ``Policy.for_prompt(m, tau, alpha)``, differs from the current default's resolved the same way
   (``to_dict()``, without the routing fields that ``for_prompt`` has already applied). A config that cannot be
   resolved counts as changed at every budget. The recorded ``params`` are read against today's code, so a
   row recorded with ``{}`` ("defaults") resolves to today's defaults.

Declared on 2026-11-28, after held-out seed 4's result and before seed 5 ran; applies to runs from then on.
"""

from __future__ import annotations

from vlkv.common.compression.registry import get_policy

TEXT_PREFIX = "text "
"""Names of the real-text tasks (``zoo_text.TextTask.name``: ``text <task> <length>K``)."""
ROUTING = ("text_preset", "low_budget_preset", "low_budget_below")
"""Fields that pick another policy; ``for_prompt`` has applied them, so the resolved policy's own are inert."""
PROMPT = {"text": (1024, 1024), "image": (1024, 64)}
"""``(m, tau)`` of a prompt of each kind: only ``tau >= m`` (text-only) or not matters to ``for_prompt``."""


def is_text(name: str) -> bool:
    return name.startswith(TEXT_PREFIX)


def configs_of(results: dict) -> dict:
    """The rows' recorded configs (``{label: {"policy": ..., "params": {...}}}``, merged over the files)."""
    return next((r["configs"] for r in results.values() if r.get("configs")), {})


def kind_of(names) -> str:
    """The prompt kind a set of members decides: "text" when every one is a text task, else "image"."""
    names = list(names)
    return "text" if names and all(is_text(n) for n in names) else "image"


def _comparable(r: dict, labels, current: str, budgets) -> bool:
    hits, rows = r.get("hits", {}), r.get("rows", {})
    for b in map(str, budgets):
        ran = [x for x in (current, *labels) if b in rows.get(x, {})]
        if current not in ran:
            continue
        got = [hits.get(x, {}).get(b) for x in ran]
        if any(h is None for h in got) or len({len(h) for h in got}) > 1:
            return False
    return True


def comparable_members(results: dict, names, labels, current: str, budgets) -> tuple[list[str], list[str]]:
    """``(comparable, not_comparable)``: the members of ``names`` on which ``current`` and every one of
    ``labels`` have per-example hits of the same n at each budget both rows ran."""
    ok = [n for n in names if _comparable(results[n], labels, current, budgets)]
    return ok, [n for n in names if n not in ok]


def answer_changes(results: dict, label: str, current: str, names, budgets) -> int | None:
    """Training answers (member, budget, example) where ``label``'s hit differs from ``current``'s, over
    ``names`` (comparable members) and ``budgets`` both rows ran; None when ``label`` lacks hits there."""
    total = 0
    for n in names:
        hits, rows = results[n].get("hits", {}), results[n].get("rows", {})
        for b in map(str, budgets):
            if b not in rows.get(current, {}):
                continue
            mine, base = hits.get(label, {}).get(b), hits.get(current, {}).get(b)
            if mine is None or base is None or len(mine) != len(base):
                return None
            total += sum(bool(x) != bool(y) for x, y in zip(mine, base, strict=True))
    return total


def resolved(config: dict | None, kind: str, alpha: float) -> dict | None:
    """The ``to_dict()`` of the policy that compresses a prompt of ``kind`` at ``alpha`` under the recorded
    ``config`` (``{"policy": name, "params": {...}}``), routing fields dropped; None when it does not build."""
    if not config:
        return None
    params = dict(config.get("params") or {})
    try:
        policy = get_policy(config.get("policy") or "", **params)
        d = policy.for_prompt(*PROMPT[kind], alpha).to_dict()
    except (TypeError, ValueError):
        return None
    return {k: v for k, v in d.items() if k not in ROUTING}


def recorded(config: dict, budgets) -> dict:
    """What a run records as ``config["resolved"]``: ``{kind: {str(budget): resolved(...)}}`` for both prompt
    kinds, so the file keeps the policies the run used whatever the code's defaults become."""
    return {kind: {str(b): resolved(config, kind, b) for b in budgets} for kind in PROMPT}


def _resolved_at(config: dict | None, kind: str, alpha: float) -> dict | None:
    saved = (config or {}).get("resolved", {}).get(kind, {})
    return saved[str(alpha)] if str(alpha) in saved else resolved(config, kind, alpha)


def budget_changes(configs: dict, label: str, current: str, kind: str, budgets) -> int:
    """Budgets at which ``label``'s resolved policy for ``kind`` differs from ``current``'s (unresolvable:
    changed); the policies the run recorded where it did."""
    if label == current:
        return 0
    out = 0
    for b in budgets:
        mine, base = _resolved_at(configs.get(label), kind, b), _resolved_at(configs.get(current), kind, b)
        out += mine is None or base is None or mine != base
    return out


def tie_keys(results: dict, names, labels, pool, current: str, kind: str, budgets):
    """``({label: (changed answers, changed budgets)}, not_comparable)``; the answers over the members where
    ``pool`` (the candidates within the score tie) and ``current`` are comparable."""
    names = list(names)
    ok, skipped = comparable_members(results, names, pool, current, budgets)
    configs = configs_of({n: results[n] for n in names})
    keys = {
        x: (
            answer_changes(results, x, current, ok, budgets),
            budget_changes(configs, x, current, kind, budgets),
        )
        for x in labels
    }
    return keys, skipped
