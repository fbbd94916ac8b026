"""Where the needle goes under compression (lab diagnostic, training split only; issue #38's text-only prompts).

On SmolLM2-135M-Instruct (the text-only wrapper) and ``text_suite``'s ``needle`` items, per layer and KV
head: the rank of each needle token (the name, "is", each digit of the number) under a policy's scores (the
statistics rows it reads, group-summed and pooled) and under the oracle's answer attention (``oracle.py``),
and the accuracy of given rows at given budgets. A row's params may carry ``"inject": [layers]``: the
policy's selection with the needle's tokens forced into those layers (its lowest-scored kept tokens make
room; the windows are kept as they are), to see which layers the answer needs.

    python -m vlkv.tools.eval.text_diagnose -n 16 --ranks --budgets 0.02,0.05,0.1 [--rows JSON] [--no-oracle]
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from vlkv.common.compression.registry import get_policy
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.tools.eval.evaluation import prepare
from vlkv.tools.eval.oracle import answer_attention
from vlkv.tools.eval.zoo_scoring import full_answers, score_rows
from vlkv.tools.eval.zoo_text import TextTask, load_text_model
from vlkv.tools.zoo import text_suite as ts

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


def ranks(scores: torch.Tensor, positions: dict[str, int]) -> dict[str, list[int]]:
    """Per role, its rank (0 = best) in each KV head's scores ``[H_kv, m]``."""
    order = scores.float().argsort(dim=-1, descending=True).argsort(dim=-1)
    return {role: order[:, p].tolist() for role, p in positions.items()}


def injected(prep, policy, budget, layers, pos) -> CompactKV:
    """The policy's cache with the needle's tokens first among its scored tokens in ``layers`` (its windows
    and per-layer budgets as they are)."""
    stats = prep.stats(policy.query_start(prep.m, prep.tau), 0.01)
    kept = policy.plan(stats, prep.keys, prep.values, alpha=budget, m=prep.m, tau=prep.tau)
    tau = policy.observed_tau(prep.m, prep.tau)
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
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, processor = load_text_model()
    task = TextTask("needle", 1024, processor.tokenizer)
    items = task.make_examples(args.n, 0, args.split)
    prepared = prepare(model, processor, items, progress=False, task=task)
    positions = [needle_positions(it, processor) for it in items]
    ids, full = full_answers(model, processor, prepared, task.max_new_tokens)
    print("full", sum(full["full"]["1.0"]), "of", len(items), flush=True)
    if args.ranks:
        _print_ranks(model, prepared, ids, positions, args.policy)
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = json.loads(args.rows) if args.rows else [["vlcache", "vlcache", {}], ["snapkv", "snapkv", {}]]
    plain = [r for r in rows if "inject" not in r[2]]
    right = score_rows(
        model, processor, prepared, ids, plain, budgets, task.max_new_tokens, oracle=not args.no_oracle
    )
    for label, by_b in right.items():
        print(f"{label:50s}", " ".join(f"{sum(by_b[str(b)]):3d}" for b in budgets), flush=True)
    from vlkv.tools.eval.zoo_scoring import _decoder

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


def _print_ranks(model, prepared, ids, positions, policy_name) -> None:
    policy = get_policy(policy_name)
    layers = len(prepared[0].keys)
    pol: list[dict] = [dict() for _ in range(layers)]
    ora: list[dict] = [dict() for _ in range(layers)]
    for prep, answer, pos in zip(prepared, ids, positions, strict=True):
        att = answer_attention(model, prep, answer)
        tau = policy.observed_tau(prep.m, prep.tau)
        stats = prep.stats(policy.query_start(prep.m, prep.tau), 0.01)
        for layer in range(layers):
            s = policy.score(layer, stats[layer], prep.keys[layer], prep.values[layer], prep.m, tau)
            for role, r in ranks(s, pos).items():
                pol[layer].setdefault(role, []).append(min(r))
            for role, r in ranks(att[layer], pos).items():
                ora[layer].setdefault(role, []).append(min(r))
    print("median rank (best KV head) of each needle token, policy / oracle, per layer")
    print("layer " + " ".join(f"{r:>9s}" for r in ROLES))
    for layer in range(layers):
        cells = [
            f"{int(torch.tensor(pol[layer][r]).median()):>4d}/{int(torch.tensor(ora[layer][r]).median()):<4d}"
            for r in ROLES
        ]
        print(f"{layer:5d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
