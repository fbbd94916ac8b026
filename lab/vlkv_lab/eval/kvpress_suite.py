"""NVIDIA kvpress's presses on the real-text suite beside vlkv's policies (``vlkv bench kvpress --suite text``).

Per prompt: one eager prefill of the whole prompt on the text decoder, during which every (press, budget,
mode) compresses the inputs kvpress's hook would see (``kvpress_presses.PressHook``); then all of one mode's
caches are decoded greedily as one batch (``kvpress_decode``), and one more row with the full cache. Budgets
are vlkv's kept fractions; each press gets ``compression_ratio = 1 - budget`` (kvpress's ratio is the
fraction removed) and each record carries the fraction of the whole prompt's cache it actually kept (in
``context`` mode the question is kept whole, so that is more than the budget). ``run`` returns one record per
(prompt, press, budget, mode); ``kvpress_report`` turns them into rows with Wilson intervals.

Prompts: a :class:`Prompt` is the rendered chat prompt and the question's text inside it. The context is
everything before the question's last occurrence, the question everything from there (the question plus
the template's tail), each tokenized alone, as kvpress's pipeline splits and tokenizes; ``prompt`` mode uses
the same ids, so both modes share the prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.deploy.progress import progress as track

from vlkv_lab.eval.kvpress_decode import greedy, stack_caches
from vlkv_lab.eval.kvpress_presses import MODES, PRESSES, Job, PressHook, compression_ratio


@dataclass
class Prompt:
    """One question: ``text`` the rendered prompt (chat template applied), ``question`` its question's
    text (found in ``text``), ``item`` whatever ``is_correct`` needs, ``task``/``length`` its keys."""

    task: str
    length: int
    text: str
    question: str
    item: Any = None


def split_ids(tokenizer, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids, question ids), each tokenized alone without special tokens (kvpress's pipeline)."""
    at = prompt.text.rfind(prompt.question)
    if at <= 0:
        raise ValueError(f"the question is not inside the prompt: {prompt.question!r}")
    ctx = tokenizer.encode(prompt.text[:at], add_special_tokens=False)
    qst = tokenizer.encode(prompt.text[at:], add_special_tokens=False)
    return torch.tensor(ctx), torch.tensor(qst)


def load_kvpress_module():
    """kvpress, imported by ``lab/vlkv_lab/bench/kvpress.py``'s loader (a private ``--no-deps`` install beside a
    newer transformers) or from the environment (``.venv-kvpress``)."""
    from vlkv_lab.bench.kvpress import load_kvpress

    kvpress, note = load_kvpress("auto")
    if kvpress is None:
        raise RuntimeError(note)
    return kvpress, note


def _jobs(kvpress, presses: Sequence[str], budgets: Sequence[float], modes: Sequence[str]) -> list[Job]:
    return [
        Job(name, b, mode, PRESSES[name](kvpress, compression_ratio(b)))
        for mode in modes
        for name in presses
        for b in budgets
    ]


@torch.inference_mode()
def _prefill(model, ids: torch.Tensor, jobs: list[Job], c: int, attention: str = "eager"):
    cache = DynamicCache(config=model.config)
    hook = PressHook(model, jobs, c)
    saved = model.config._attn_implementation
    model.config._attn_implementation = attention  # eager: ObservedAttention reads the weights
    try:
        logits = model(
            input_ids=ids[None], **cache_arg(model, cache), use_cache=True, logits_to_keep=1
        ).logits
    finally:
        model.config._attn_implementation = saved
        hook.remove()
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    return int(logits[0, -1].argmax()), keys, values


def run(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    is_correct: Callable[[str, Any], bool],
    budgets: Sequence[float],
    presses: Sequence[str],
    modes: Sequence[str] = MODES,
    max_new_tokens: int | Callable[[str], int] = 16,
    kvpress=None,
    progress: bool = True,
    attention: str = "eager",
    sink: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """One record per (prompt, press, budget, mode) and one ``full`` record per prompt:
    ``{task, length, index, press, mode, budget, compression_ratio, kept_tokens, cache_tokens, correct,
    answer, error}`` (``kept_tokens``/``cache_tokens``: K/V entries over every layer and KV head).
    attention: the prefill's attention (eager: ObservedAttention needs its weights; AdaKV-style presses
    are compressed the same either way). sink: called with the records so far after every prompt.
    max_new_tokens: one cap for every prompt, or a function of the prompt's task (RULER's tasks echo their
    longer question before the answer: ``text_suite.max_new_tokens``)."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r} is not one of {MODES}")
    if kvpress is None:
        kvpress, _ = load_kvpress_module()
    eos = {tokenizer.eos_token_id, *_as_list(model.generation_config.eos_token_id)}
    records = []
    for index, prompt in enumerate(track(prompts, desc="kvpress", unit="prompt", disable=not progress)):
        records += _one_prompt(
            model,
            tokenizer,
            kvpress,
            prompt,
            index,
            is_correct,
            budgets,
            presses,
            modes,
            eos,
            max_new_tokens(prompt.task) if callable(max_new_tokens) else max_new_tokens,
            attention,
        )
        if sink is not None:
            sink(records)
    return records


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _one_prompt(
    model, tokenizer, kvpress, prompt, index, is_correct, budgets, presses, modes, eos, max_new, attention
):
    ctx, qst = split_ids(tokenizer, prompt)
    ids = torch.cat([ctx, qst])
    c, m = len(ctx), len(ids)
    jobs = _jobs(kvpress, presses, budgets, modes)
    t0 = time.perf_counter()
    first, keys, values = _prefill(model, ids, jobs, c, attention)
    heads, layers = keys[0].shape[0], len(keys)
    cache_tokens = m * heads * layers
    item_index = getattr(prompt.item, "index", index)
    base = {
        "task": prompt.task,
        "length": prompt.length,
        "index": index,
        "item": item_index,
        "m": m,
        "context": c,
    }
    full_row = [torch.ones(heads, m, dtype=torch.bool)] * layers
    (answer,) = greedy(
        model, stack_caches(keys, values, [full_row]), torch.tensor([[first]]), m, max_new, eos
    )
    text = tokenizer.decode(answer, skip_special_tokens=True)
    out = [
        {
            **base,
            "press": "full",
            "mode": "full",
            "budget": 1.0,
            "compression_ratio": 0.0,
            "kept_tokens": cache_tokens,
            "cache_tokens": cache_tokens,
            "correct": bool(is_correct(text, prompt.item)),
            "answer": text,
            "error": "",
        }
    ]
    for mode in modes:
        mine = [j for j in jobs if j.mode == mode]
        ok = [j for j in mine if not j.error]
        answers = []
        if ok:
            stacked = stack_caches(keys, values, [j.kept for j in ok])
            if mode == "context":
                answers = greedy(model, stacked, qst[None].expand(len(ok), -1), c, max_new, eos)
            else:
                answers = greedy(model, stacked, torch.tensor([[first]] * len(ok)), m, max_new, eos)
        texts = iter(tokenizer.decode(a, skip_special_tokens=True) for a in answers)
        for j in mine:
            text = "" if j.error else next(texts)
            kept = sum(int(k.sum()) for k in j.kept) if not j.error else 0
            if mode == "context" and not j.error:
                kept += (m - c) * heads * layers  # the question, run over the compressed context, kept whole
            out.append(
                {
                    **base,
                    "press": j.name,
                    "mode": mode,
                    "budget": j.budget,
                    "compression_ratio": compression_ratio(j.budget),
                    "kept_tokens": kept,
                    "cache_tokens": cache_tokens,
                    "correct": bool(not j.error and is_correct(text, prompt.item)),
                    "answer": text,
                    "error": j.error,
                }
            )
    out[0]["seconds"] = time.perf_counter() - t0
    return out
