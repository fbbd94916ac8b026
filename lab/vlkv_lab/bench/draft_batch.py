"""The drafts of requests in flight, one at a time against one batch (``prefill_worker/draft_batch.py``): the
part of ``vlkv bench verify-cost`` that measures what ``--prefill-concurrency`` buys. Per prompt group, the first
``batch`` prompts are prefilled once; their 16-step greedy drafts run one after another (``run_draft``) and
together (``run_drafts``), alternated ``repeats`` times in one run; the table gives each way's draft time per
request and the ratio."""

from __future__ import annotations

import time


def draft_batch_rows(engine, prompts, batch: int, steps: int = 16, repeats: int = 2) -> list[dict]:
    from vlkv.prefill_worker.draft_queries import run_draft, run_drafts

    eos = engine.spec.eos_token_ids
    rows = []
    for group in dict.fromkeys(p.group for p in prompts):
        items = []
        for p in [p for p in prompts if p.group == group][:batch]:
            logits, keys, values = engine.prefill.forward(
                engine.prepare(list(p.images), p.prompt, question=p.question)
            )
            items.append((keys, values, int(logits.argmax()), steps))
        serial = together = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k, v, f, s in items:
                run_draft(engine.model, k, v, f, s, eos, logprobs=True)
            t1 = time.perf_counter()
            run_drafts(engine.model, items, eos, logprobs=True)
            serial, together = serial + t1 - t0, together + time.perf_counter() - t1
        n = len(items) * repeats
        rows.append(
            dict(group=group, batch=len(items), serial_ms=1000 * serial / n, batched_ms=1000 * together / n,
                 speedup=serial / together if together else float("nan"))
        )  # fmt: skip
    return rows


def draft_batch_table(rows: list[dict]) -> str:
    lines = [
        "| prompts | drafts | ms per draft, one at a time | ms per draft, one batch | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['batch']} | {r['serial_ms']:.0f} | {r['batched_ms']:.0f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines)
