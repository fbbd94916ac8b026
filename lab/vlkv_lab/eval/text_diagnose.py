"""Where the needle goes under compression (lab diagnostic, training split only; issue #38's text-only prompts).

On SmolLM2-135M-Instruct (the text-only wrapper) and ``text_suite``'s ``needle`` items, per layer and KV
head: the rank of each needle token (the name, "is", each digit of the number) under a policy's scores (the
statistics rows it reads, group-summed and pooled) and under the oracle's answer attention (``oracle.py``),
and the accuracy of given rows at given budgets. A row's params may carry ``"inject": [layers]``: the
policy's selection with the needle's tokens forced into those layers (its lowest-scored kept tokens make
room; the windows are kept as they are), to see which layers the answer needs.

``--decompose NAME JSON`` (a policy and its params, e.g. ``vlcache '{"text_preset": "vlcache_text"}'``) splits
a loss between the layer budgets, the windows and the scores: per budget, the right answers of the policy,
of the policy at the oracle's own layer budgets (``oracle.mass_budgets``, the same total), of the policy's
windows and budgets with the oracle's answer attention as the scores of the rest, and of the oracle at the
policy's budgets and at its own; then per layer the budget, the slots the windows and sinks take
(``fixed``), and in how many items the policy / the oracle at the same budget keep each needle token (in
any KV head).

    python -m vlkv_lab.eval.text_diagnose -n 16 --ranks --budgets 0.02,0.05,0.1 [--rows JSON] [--no-oracle]
    python -m vlkv_lab.eval.text_diagnose -n 16 --budgets 0.01,0.02 --decompose vlcache '{"text_preset": "vlcache_text"}'

``--task`` (default ``needle``) takes any ``text_suite`` task whose answer is one value in the context (the
RULER-style ``niah_single_1`` ...): its roles are then the three tokens before the value (``k-3`` .. ``k-1``,
"is", ":", " " in RULER's needle) and the value's tokens (``v1`` .. ``v9``).
"""

from __future__ import annotations

import argparse
import copy
import json
import re

import torch
from vlkv.common.compression.registry import get_policy, preset_params
from vlkv.common.compression.selection import recent_count
from vlkv.common.handoff.compact_kv import CompactKV

from vlkv_lab.eval.evaluation import policy_stats, prepare
from vlkv_lab.eval.oracle import answer_attention, mass_budgets, oracle_cache
from vlkv_lab.eval.zoo_scoring import full_answers, score_rows
from vlkv_lab.eval.zoo_text import TextTask, load_text_model
from vlkv_lab.zoo import text_suite as ts

ROLES = ("The", "secret", "number", "of", "name", "is", "_", "d1", "d2", "d3", "d4", "d5", ".")


def needle_positions(item, processor) -> dict[str, int]:
    """Token position of each needle role in the rendered prompt (the digits are one token each)."""
    tok = processor.tokenizer
    prompt = ts.render(item, processor)
    enc = tok(prompt, add_special_tokens=False, return_offsets_mapping=True)
    match = re.search(r"The secret number of (\w+) is (\d+)\.", prompt)
    starts = [match.start()]
    for word in ("secret", "number", "of"):
        starts.append(prompt.index(word, starts[-1]))
    starts += [match.start(1), match.start(1) + len(match.group(1)) + 1]
    starts += [match.start(2) - 1] + [match.start(2) + i for i in range(len(match.group(2)))] + [match.end(2)]
    pos = {}
    for role, s in zip(ROLES, starts, strict=False):
        pos[role] = next(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a <= s < b or a > s)
    return pos


VALUE_ROLES = ("k-3", "k-2", "k-1") + tuple(f"v{i}" for i in range(1, 10))
"""``--task`` other than needle: the three tokens before the value (the looked-up key's end, "is", ":") and
the value's tokens (up to 9: a 7-digit number, a short code)."""


def value_positions(item, processor) -> dict[str, int]:
    """Token positions of the value's tokens (``v1`` ...) and the three before it (``k-3`` .. ``k-1``) in the
    rendered prompt, for any task whose answer appears once in the context."""
    prompt = ts.render(item, processor)
    enc = processor.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    start = prompt.index(item.answer, 0, prompt.rindex(item.question))
    end = start + len(item.answer)
    spans = enc["offset_mapping"]
    value = [i for i, (a, b) in enumerate(spans) if a < end and b > start and b > a]
    pos = {f"k-{j}": value[0] - j for j in (3, 2, 1)}
    pos.update({f"v{i + 1}": p for i, p in enumerate(value[:9])})
    return pos


def ranks(scores: torch.Tensor, positions: dict[str, int]) -> dict[str, list[int]]:
    """Per role, its rank (0 = best) in each KV head's scores ``[H_kv, m]``."""
    order = scores.float().argsort(dim=-1, descending=True).argsort(dim=-1)
    return {role: order[:, p].tolist() for role, p in positions.items()}


def injected(prep, policy, budget, layers, pos) -> CompactKV:
    """The policy's cache with the needle's tokens first among its scored tokens in ``layers`` (its windows
    and per-layer budgets as they are)."""
    stats = policy_stats(prep, policy, budget)
    kept = policy.plan(
        stats, prep.keys, prep.values, alpha=budget, m=prep.m, tau=prep.tau, question=prep.question
    )
    tau = policy.observed_tau(prep.m, prep.tau, prep.question)
    out_k, out_v, out_i = [], [], []
    for layer, (idx, keys, values) in enumerate(zip(kept, prep.keys, prep.values, strict=True)):
        if layer in layers and idx.shape[1] < prep.m:
            scores = policy.score(layer, stats[layer], keys, values, prep.m, tau).clone()
            for j in pos.values():
                scores[:, j] = 1e9 - j
            idx = policy.select(scores, idx.shape[1], tau)
        gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        out_k.append(keys.gather(1, gather))
        out_v.append(values.gather(1, gather))
        out_i.append(idx)
    return CompactKV(out_k, out_v, prompt_length=prep.m, first_token=prep.first_token, kept_indices=out_i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--budgets", default="0.02,0.05,0.1")
    ap.add_argument("--rows", default="", help="JSON list of [label, policy, params] (default: a few)")
    ap.add_argument("--ranks", action="store_true", help="print the needle's ranks per layer")
    ap.add_argument("--policy", default="vlcache", help="whose scores --ranks reads")
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--split", default="train", help="train (choosing) or heldout (measuring only)")
    ap.add_argument("--task", default="needle", help="text_suite task (RULER-style ones: the value's tokens)")
    ap.add_argument("--decompose", nargs=2, metavar=("POLICY", "JSON"), help="budgets / windows / scores")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, processor = load_text_model()
    task = TextTask(args.task, 1024, processor.tokenizer, max_new_tokens=ts.max_new_tokens(args.task))
    items = task.make_examples(args.n, 0, args.split)
    prepared = prepare(model, processor, items, progress=False, task=task)
    locate = needle_positions if args.task == "needle" else value_positions
    positions = [locate(it, processor) for it in items]
    ids, full = full_answers(model, processor, prepared, task.max_new_tokens)
    print("full", sum(full["full"]["1.0"]), "of", len(items), flush=True)
    if args.ranks:
        _print_ranks(model, prepared, ids, positions, args.policy)
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.decompose:
        policy = get_policy(args.decompose[0], **json.loads(args.decompose[1]))
        _decompose(model, processor, task, prepared, ids, positions, policy, budgets)
        return
    rows = json.loads(args.rows) if args.rows else [["vlcache", "vlcache", {}], ["snapkv", "snapkv", {}]]
    rows = [[label, name, _expand(params)] for label, name, params in rows]
    plain = [r for r in rows if "inject" not in r[2]]
    right = score_rows(
        model, processor, prepared, ids, plain, budgets, task.max_new_tokens, oracle=not args.no_oracle
    )
    for label, by_b in right.items():
        print(f"{label:50s}", " ".join(f"{sum(by_b[str(b)]):3d}" for b in budgets), flush=True)
    from vlkv_lab.eval.zoo_scoring import _decoder

    decode = _decoder(model, processor, task.max_new_tokens, 600)
    for label, name, params in [r for r in rows if "inject" in r[2]]:
        params = dict(params)
        layers = set(params.pop("inject"))
        policy = get_policy(name, **params)
        line = []
        for b in budgets:
            caches = [injected(p, policy, b, layers, pos) for p, pos in zip(prepared, positions, strict=True)]
            _, answers = decode(caches)
            line.append(sum(task.is_correct(a, it) for a, it in zip(answers, items, strict=True)))
        print(f"{label:50s}", " ".join(f"{x:3d}" for x in line), flush=True)


def _expand(params: dict) -> dict:
    """A row's params; ``"preset": NAME`` stands for that preset's fields, the row's other keys overriding
    them (``{"preset": "vlcache_text", "recent_ratio": 0.0}``)."""
    params = dict(params)
    name = params.pop("preset", "")
    return preset_params(name) | params if name else params


def _caches(prep, policy, budget, att, oracle_budgets=False, oracle_scores=False) -> CompactKV:
    """The policy's cache of one prepared prompt; ``oracle_budgets``: at ``mass_budgets`` of the answer
    attention ``att`` (the policy's total); ``oracle_scores``: the policy's windows and sinks, its other
    slots by ``att`` (no pooling, spans or sharing)."""
    policy = policy.for_prompt(prep.m, prep.tau, budget)
    m, layers = prep.m, len(prep.keys)
    stats = prep.stats(policy.query_start(m, prep.tau, prep.question), 0.01)
    tau = policy.observed_tau(m, prep.tau, prep.question)
    budgets = policy.allocate(stats, budget, m, layers)
    if oracle_budgets:
        budgets = mass_budgets(att, sum(budgets))
    if oracle_scores:
        kept = [
            policy.select(a, k, tau) if k < m else torch.arange(m).repeat(a.shape[0], 1)
            for a, k in zip(att, budgets, strict=True)
        ]
    else:
        fixed = copy.copy(policy)
        fixed.allocate = lambda *_: list(budgets)  # this copy's budgets, whatever its allocator
        kept = fixed.plan(
            stats, prep.keys, prep.values, alpha=budget, m=m, tau=prep.tau, question=prep.question
        )
    out_k, out_v = [], []
    for idx, keys, values in zip(kept, prep.keys, prep.values, strict=True):
        gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        out_k.append(keys.gather(1, gather))
        out_v.append(values.gather(1, gather))
    return CompactKV(out_k, out_v, prompt_length=m, first_token=prep.first_token, kept_indices=kept)


def fixed_slots(policy, k: int, m: int, tau: int) -> int:
    """How many of a layer's ``k`` slots the policy fills before any scored token (its windows and sinks;
    ``selection.keep``'s arithmetic)."""
    recent = recent_count(k, policy.recent_ratio)
    window = policy.post_vision_share(k, m) if policy.post_vision_window else 0
    window = min(tau, window) if 0 < tau < m else 0
    if policy.post_vision_by_score and 0 < window < tau:
        outright = window + min(recent, k - window, m - tau)
    else:
        outright = min(k, window + recent)
    return outright + min(policy.sink_tokens, k - outright)


def _decompose(model, processor, task, prepared, ids, positions, policy, budgets) -> None:
    from vlkv_lab.eval.zoo_scoring import _decode_unique, _decoder

    decode = _decoder(model, processor, task.max_new_tokens, 600)
    att = [answer_attention(model, p, a) for p, a in zip(prepared, ids, strict=True)]
    n, layers = len(prepared), len(prepared[0].keys)
    for b in budgets:
        rows = {
            "policy": [_caches(p, policy, b, a) for p, a in zip(prepared, att, strict=True)],
            "policy, oracle's budgets": [
                _caches(p, policy, b, a, True) for p, a in zip(prepared, att, strict=True)
            ],
            "policy's windows, oracle's scores": [
                _caches(p, policy, b, a, oracle_scores=True) for p, a in zip(prepared, att, strict=True)
            ],
        }
        rows["oracle, policy's budgets"] = [
            oracle_cache(p, a, c.layer_lengths) for p, a, c in zip(prepared, att, rows["policy"], strict=True)
        ]
        rows["oracle, own budgets"] = [
            oracle_cache(p, a, mass_budgets(a, sum(c.layer_lengths)))
            for p, a, c in zip(prepared, att, rows["policy"], strict=True)
        ]
        answers = _decode_unique(decode, [c for caches in rows.values() for c in caches], n)
        print(f"budget {b}: right answers of {n}", flush=True)
        for j, label in enumerate(rows):
            mine = answers[j * n : (j + 1) * n]
            right = sum(p.task.is_correct(t, p.example) for p, t in zip(prepared, mine, strict=True))
            print(f"  {label:40s} {right:3d}", flush=True)
        active = policy.for_prompt(prepared[0].m, prepared[0].tau, b)
        tau = active.observed_tau(prepared[0].m, prepared[0].tau, prepared[0].question)
        roles = [r for r in ("name", "is", "d1", "d2", "d3", "d4", "d5", *VALUE_ROLES) if r in positions[0]]
        print("  layer   k fixed " + " ".join(f"{r:>7s}" for r in roles) + "   (items kept: policy/oracle)")
        for layer in range(layers):
            k = rows["policy"][0].layer_lengths[layer]
            cells = []
            for r in roles:
                pol = sum(
                    int(r in pos and pos[r] in c.kept_indices[layer])
                    for c, pos in zip(rows["policy"], positions, strict=True)
                )
                ora = sum(
                    int(r in pos and pos[r] in c.kept_indices[layer])
                    for c, pos in zip(rows["oracle, policy's budgets"], positions, strict=True)
                )
                cells.append(f"{pol:>3d}/{ora:<3d}")
            fixed = fixed_slots(active, k, prepared[0].m, tau) if k < prepared[0].m else k
            print(f"  {layer:5d} {k:3d} {fixed:5d} " + " ".join(cells), flush=True)


def _print_ranks(model, prepared, ids, positions, policy_name) -> None:
    policy = get_policy(policy_name)
    layers = len(prepared[0].keys)
    pol: list[dict] = [dict() for _ in range(layers)]
    ora: list[dict] = [dict() for _ in range(layers)]
    for prep, answer, pos in zip(prepared, ids, positions, strict=True):
        att = answer_attention(model, prep, answer)
        tau = policy.observed_tau(prep.m, prep.tau, prep.question)
        stats = prep.stats(policy.query_start(prep.m, prep.tau, prep.question), 0.01)
        for layer in range(layers):
            s = policy.score(layer, stats[layer], prep.keys[layer], prep.values[layer], prep.m, tau)
            for role, r in ranks(s, pos).items():
                pol[layer].setdefault(role, []).append(min(r))
            for role, r in ranks(att[layer], pos).items():
                ora[layer].setdefault(role, []).append(min(r))
    print("median rank (best KV head) of each needle token, policy / oracle, per layer")
    roles = list(positions[0])
    print("layer " + " ".join(f"{r:>9s}" for r in roles))
    for layer in range(layers):
        cells = [
            f"{int(torch.tensor(pol[layer][r]).median()):>4d}/{int(torch.tensor(ora[layer][r]).median()):<4d}"
            for r in roles
        ]
        print(f"{layer:5d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
