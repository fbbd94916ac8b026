"""The one full-cache accuracy path of the zoo: the in-process engine that ``vlkv eval zoo`` runs.

    python -m vlkv_lab.zoo.accuracy grid16 -n 300             # a shipped member's held-out accuracy
    python -m vlkv_lab.zoo.accuracy deep8 -n 0 --sparsity 50  # and/or its per-layer attention sparsity

Every example is prefilled by the prefill worker's forward and decoded greedily over its full cache by the
decode worker's core (``lab/vlkv_lab/eval/evaluation.py`` ``prepare`` / ``evaluate``, policy ``full``), then scored
with the member's ``is_correct``: the shipped checkpoints (loaded through ``load_model`` / ``load_processor``,
the serving path's ``from_pretrained``), the training commands' own held-out evaluations and the default
model's alike.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from vlkv.deploy.progress import progress
from vlkv.deploy.synthetic_task import Example

from vlkv_lab.zoo import MEMBERS, member
from vlkv_lab.zoo.interface import Member


def full_cache_answers(
    m: Member, model, processor, examples: list[Example], max_new_tokens: int = 0, chunk: int = 50
) -> list[str]:
    """Greedy full-cache answers of ``model`` to ``examples`` of member ``m`` (up to ``max_new_tokens``, by
    default the member's), in chunks of ``chunk`` examples (each chunk's prefill records are freed before the
    next). The model is left in the mode and attention implementation it came in (training calls this
    between steps)."""
    from vlkv_lab.eval.evaluation import evaluate, prepare

    was_training = model.training
    attn = model.config.text_config._attn_implementation
    model.eval()
    texts: list[str] = []
    parts = [examples[i : i + chunk] for i in range(0, len(examples), chunk)]
    for part in progress(
        parts, desc=f"{m.name} full cache", unit=f"{chunk} examples", disable=len(parts) < 2
    ):
        prepared = prepare(model, processor, part, progress=False, task=m)
        texts += evaluate(model, processor, prepared, "full", 1.0, max_new_tokens or m.max_new_tokens).answers
    model.set_attn_implementation({"text_config": attn})
    model.train(was_training)
    return texts


def full_cache_accuracy(
    m: Member, model, processor, examples: list[Example], max_new_tokens: int = 0
) -> tuple[float, dict[str, float]]:
    """Greedy full-cache accuracy (``full_cache_answers`` scored by ``m.is_correct``), overall and per kind."""
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for ex, text in zip(
        examples, full_cache_answers(m, model, processor, examples, max_new_tokens), strict=True
    ):
        totals[ex.kind] += 1
        hits[ex.kind] += m.is_correct(text, ex)
    return sum(hits.values()) / max(1, len(examples)), {k: hits[k] / totals[k] for k in sorted(totals)}


def load_member(m: Member):
    """The member's shipped checkpoint as any user's: ``(model, processor)``."""
    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model, load_processor

    path = str(m.checkpoint())
    return load_model(ModelConfig(path=path)), load_processor(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("member", choices=MEMBERS)
    p.add_argument("-n", type=int, default=300, help="examples for the accuracy (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=("heldout", "train"), default="heldout")
    p.add_argument("--sparsity", type=int, default=0, help="examples for the per-layer sparsity (0: skip)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (more spin on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    m = member(args.member)
    model, processor = load_member(m)
    out: dict = {"member": m.name, "split": args.split}
    if args.n:
        acc, per_kind = full_cache_accuracy(
            m, model, processor, m.make_examples(args.n, args.seed, args.split)
        )
        out |= {
            "n": args.n,
            "accuracy": round(acc, 4),
            "per_kind": {k: round(v, 4) for k, v in per_kind.items()},
        }
    if args.sparsity:
        from vlkv_lab.zoo.sparsity import layer_sparsities

        gamma = layer_sparsities(model, processor, m.make_examples(args.sparsity, args.seed, args.split))
        out["layer_sparsity"] = {"n": args.sparsity, "p": 0.01, "per_layer": [round(g, 3) for g in gamma]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
