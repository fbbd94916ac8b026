"""Held-out full-cache greedy accuracy of a zoo member's shipped checkpoint, loaded as any user's.

    python -m vlkv.tools.zoo.accuracy grid16 -n 300

Loads ``MODEL_DIR`` through ``vlkv.common.model.loading`` (``load_model`` / ``load_processor``, the serving
path's ``from_pretrained``), renders each example with the member's ``prompt_text`` and decodes greedily with
``model.generate`` (full KV cache, ``MAX_NEW_TOKENS``), scoring with the member's ``is_correct``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.tools.progress import progress
from vlkv.tools.zoo import MEMBERS, member


def full_cache_accuracy(name: str, n: int = 300, seed: int = 0, split: str = "heldout") -> tuple[float, dict]:
    """(accuracy, accuracy per kind) of member ``name`` on ``n`` examples of ``split``."""
    m = member(name)
    path = str(m.MODEL_DIR)
    model = load_model(ModelConfig(path=path))
    processor = load_processor(path)
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for ex in progress(m.make_examples(n, seed, split), desc=f"{name} full cache", unit="example"):
        inputs = processor(images=ex.images, text=m.prompt_text(processor, ex), return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=m.MAX_NEW_TOKENS, do_sample=False)
        text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        totals[ex.kind] += 1
        hits[ex.kind] += m.is_correct(text, ex)
    return sum(hits.values()) / max(1, n), {k: hits[k] / totals[k] for k in sorted(totals)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("member", choices=MEMBERS)
    p.add_argument("-n", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=("heldout", "train"), default="heldout")
    p.add_argument("--threads", type=int, default=1, help="torch threads (more spin on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    acc, per_kind = full_cache_accuracy(args.member, args.n, args.seed, args.split)
    print(
        json.dumps(
            {
                "member": args.member,
                "split": args.split,
                "n": args.n,
                "accuracy": round(acc, 4),
                "per_kind": {k: round(v, 4) for k, v in per_kind.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
