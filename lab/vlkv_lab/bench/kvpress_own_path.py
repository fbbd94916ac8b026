"""kvpress's own entry point beside the shared prefill that ``vlkv bench kvpress`` uses, on text-suite prompts.

Needs kvpress's hook to work, so transformers < 5.3: run it in the kvpress venv::

    bash lab/vlkv_lab/bench/kvpress_venv.sh
    .venv-kvpress/bin/python -m vlkv_lab.bench.kvpress_own_path [--model DIR] [--budget 0.05]

For every press and both modes it compares the positions kvpress's own ``with press(model):
model.model(ids, past_key_values=cache)`` keeps (read off the compressed cache; for AdaKV-style presses
``module.masked_key_indices``) with those ``kvpress_presses.PressHook`` records in one shared prefill
(``context`` mode: ids = the context; ``prompt`` mode: the whole prompt), per layer and KV head; and, in
``context`` mode, the answer of kvpress's own pipeline (``KVPressTextGenerationPipeline``) with the answer
``kvpress_suite.run`` decodes. Both sides run on the same model and attention implementation (eager; sdpa
for the AdaKV-style presses, which assert it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ADA = {"AdaKV(SnapKV)", "CriticalAdaKV(SnapKV)"}


def own_kept(kvpress, model, press, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer the ``[H_kv, n]`` positions kvpress's own hook keeps of ``ids`` (one prefill)."""
    from transformers import DynamicCache
    from vlkv.common.model.cache_kwarg import cache_arg

    from vlkv_lab.eval.kvpress_presses import kept_mask

    full, comp = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.inference_mode():
        model.model(input_ids=ids[None], **cache_arg(model.model, full))
        with press(model):
            model.model(input_ids=ids[None], **cache_arg(model.model, comp))
    out = []
    for layer, attn in enumerate(model.model.layers):
        masked = getattr(attn.self_attn, "masked_key_indices", None)
        k = full.layers[layer].keys[0]
        if masked is not None:
            keep = torch.ones(k.shape[0], k.shape[1], dtype=torch.bool)
            keep[masked[1], masked[2]] = False
            attn.self_attn.masked_key_indices = None
        else:
            keep = kept_mask(k, comp.layers[layer].keys[0])
        out.append(keep)
    return out


def compare(kvpress, model, tokenizer, prompt, names, budget: float) -> list[dict]:
    from transformers import pipeline

    from vlkv_lab.eval.kvpress_presses import PRESSES, compression_ratio
    from vlkv_lab.eval.kvpress_suite import _jobs, _prefill, run, split_ids
    from vlkv_lab.zoo.text_suite import MAX_NEW_TOKENS, is_correct

    ctx, qst = split_ids(tokenizer, prompt)
    ids, c = torch.cat([ctx, qst]), len(ctx)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    rows = []
    for name in names:
        attention = "sdpa" if name in ADA else "eager"
        model.config._attn_implementation = attention
        jobs = _jobs(kvpress, [name], [budget], ["context", "prompt"])
        _prefill(model, ids, jobs, c, attention)
        row = {"press": name, "budget": budget, "attention": attention}
        for job in jobs:
            press = PRESSES[name](kvpress, compression_ratio(budget))
            theirs = own_kept(kvpress, model, press, ids[:c] if job.mode == "context" else ids)
            same = [bool(torch.equal(a, b)) for a, b in zip(job.kept, theirs, strict=True)]
            inter = sum(int((a & b).sum()) for a, b in zip(job.kept, theirs, strict=True))
            union = sum(int((a | b).sum()) for a, b in zip(job.kept, theirs, strict=True))
            row[job.mode] = {
                "identical_layers": sum(same),
                "layers": len(same),
                "jaccard": inter / max(union, 1),
            }
        press = PRESSES[name](kvpress, compression_ratio(budget))
        context = prompt.item.context + "\n\n"
        answer = pipe(context, question=prompt.item.question, press=press, max_new_tokens=MAX_NEW_TOKENS)[
            "answer"
        ]
        (mine,) = [
            r
            for r in run(
                model,
                tokenizer,
                [prompt],
                is_correct,
                [budget],
                [name],
                ["context"],
                MAX_NEW_TOKENS,
                kvpress=kvpress,
                progress=False,
                attention=attention,
            )
            if r["press"] == name
        ]
        row["pipeline_answer"], row["shared_prefill_answer"] = answer, mine["answer"]
        row["same_answer"] = answer.strip() == mine["answer"].strip()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import kvpress
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    from vlkv_lab.bench.kvpress_text import causal_view, text_prompts
    from vlkv_lab.eval.kvpress_presses import DEFAULT_PRESSES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/vlkv/models/smollm2-text"))
    p.add_argument("--task", default="needle")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--presses", default=",".join(DEFAULT_PRESSES))
    p.add_argument("--out", type=Path, default=Path("out/bench_kvpress/own_path.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    llava = LlavaForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
    model, tokenizer = causal_view(llava), AutoTokenizer.from_pretrained(args.model)
    (prompt,) = text_prompts(tokenizer, [args.task], [args.length], "heldout", 1, 0)
    rows = compare(kvpress, model, tokenizer, prompt, args.presses.split(","), args.budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5", "rows": rows},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
