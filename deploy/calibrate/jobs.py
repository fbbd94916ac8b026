"""``vlkv calibrate``'s chunks on the tools' one worker pool (``pool.py``; ``--jobs 1``: ``InProcess``, the same
work in the calling process), the table merged in the parent exactly as one process builds it.

Each worker loads the model once (``_load``, the pool's setup) and runs the chunks it is handed (``_run``):
the same chunks as one process (``calibrate.chunk_phases``), each prefilled and teacher-forced by the same
``measure_chunk``, so every prompt's agreement and KL per (candidate, budget) are the same numbers. A chunk's
result is its prompts' scores; the parent adds them to its ``Calibration`` in prompt order, so the table's
sums are the same floats in the same order as one process's (the profile's ``table`` and ``entries``
bit-identical). Screening (``--screen``) is two batches on the same workers, the model still loaded: the
screening prompts' chunks, then, once the parent has computed ``survivors`` from those prompts alone, the
rest with them. ``--rerank`` is one more batch on the same workers: once the parent has the whole table and
so the rerank set (``calibrate.rerank_set``), the first ``--rerank-prompts`` prompts' chunks go through
``calibrate.rerank_chunk``; each prompt's answer recalls come back in prompt order. Those prompts are not
prefilled again: the worker that measured one keeps its prefill (``calibrate.keep_for_rerank``: the queries
freed, the statistics and draft every candidate read kept) and the parent sends each re-rank chunk to the
worker that kept its first prompt (``Pool.run``'s ``to``); a prompt of the chunk kept elsewhere (a screening
phase cut the chunks differently) is prefilled there, the same numbers (each prompt's prefill is its own).

The parent shows one progress bar over the prompts (the re-ranked ones counted again) and, on stderr at the
end, the CPU seconds the chunks took in the workers per pass. A chunk's error (or a worker that dies) stops
every worker and raises the pool's ``WorkerFailed`` naming the worker, the prompts and the cause.
"""

from __future__ import annotations

import sys
import time

from vlkv.common.config import Limits, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.deploy.calibrate.answers import generation_suffix
from vlkv.deploy.calibrate.measure import (
    _examples,
    _RenderedTask,
    keep_for_rerank,
    measure_chunk,
    rerank_chunk,
    rerank_set,
    survivors,
)
from vlkv.deploy.calibrate.prepared import prepare
from vlkv.deploy.calibrate.prompts import read_prompts
from vlkv.deploy.pool import InProcess, Pool
from vlkv.deploy.progress import Progress

FINGERPRINT = "the model's fingerprint"
"""The item that asks a worker for the loaded model's fingerprint (the profile's ``model``)."""
RERANK = "rerank"
"""An item ``(RERANK, start, end, chosen)``: ``--rerank``'s answer recalls of those prompts."""
KEPT = "kept"
"""A worker's state key: ``{prompt index: Prepared}``, the prefills of the re-ranked prompts it measured,
kept (``calibrate.keep_for_rerank``) until the re-rank pass reads them."""

MEASURE_STEPS = 5
"""The progress bar's steps per measured prompt; a re-ranked prompt is 1. The re-rank pass decodes a few
caches from the measure pass's kept prefill and costs about a fifth of a measured prompt (``smol_codes``,
100 prompts, idle: 886 s CPU for the 100 measured, 71 s for the 40 re-ranked); counted alike, the ETA said
5m53s at 100 of 140 steps of a run that ended 54 s later."""


class _PerPrompt:
    """``measure_chunk``'s ``out`` in a worker: each prompt's ``{(candidate, budget): (agreement, kl, cache)}``
    in the order measured, to be added in the parent."""

    def __init__(self) -> None:
        self.trace: list[dict] = []

    def add(self, key, agreement: float, kl: float, cache: int | None = None) -> None:
        self.trace[-1][key] = (agreement, kl, cache)


def _load(spec: tuple) -> dict:
    """The pool's setup in a worker: the prompts read, the model and processor loaded."""
    model_dir, prompts, dtype, budgets, tokens, max_prompts = spec
    requests, _ = read_prompts(prompts)
    requests = requests[:max_prompts] if max_prompts else requests
    model = load_model(ModelConfig(path=model_dir, dtype=dtype))
    processor = load_processor(model_dir)
    return {
        "model": model,
        "processor": processor,
        "suffix": generation_suffix(processor),
        "requests": requests,
        "budgets": budgets,
        "tokens": tokens,
        KEPT: {},
    }


def _run(item, state: dict, bar) -> tuple[list[dict] | str, float]:
    """One item in a worker: a chunk ``(start, end, active, reranked)``'s scores per prompt in order (the
    prefills of its prompts before ``reranked`` kept for the re-rank pass), a ``RERANK`` chunk's recalls per
    prompt (``{"candidate|budget": recall}``, from the kept prefills; a prompt this worker did not measure
    is prefilled), or the fingerprint; with the CPU seconds it took."""
    model, processor = state["model"], state["processor"]
    cpu = time.process_time()
    if item == FINGERPRINT:
        return ModelSpec.from_model(model, processor.tokenizer).fingerprint, 0.0
    if item[0] == RERANK:
        _, start, end, chosen = item
        requests = state["requests"][start:end]
        kept = [state[KEPT].pop(i, None) for i in range(start, end)]
        recalls = rerank_chunk(
            model, processor, state["suffix"], requests, state["budgets"], state["tokens"], chosen, kept
        )
        bar.update(end - start)  # 1 step a re-ranked prompt
        out = [{f"{label}|{b:g}": v for (label, b), v in one.items()} for one in recalls]
        return out, time.process_time() - cpu
    start, end, active, reranked = item
    examples = list(_examples(state["requests"][start:end], processor, Limits()))
    prepared = prepare(model, processor, examples, progress=False, task=_RenderedTask, next_attention=False)
    out = _PerPrompt()
    measure_chunk(model, prepared, state["budgets"], state["tokens"], out, active)
    for i, p in enumerate(prepared[: max(0, reranked - start)]):
        keep_for_rerank(p)
        state[KEPT][start + i] = p
    bar.update(MEASURE_STEPS * (end - start))
    return out.trace, time.process_time() - cpu


def where(item) -> str:
    """An item's name in the bar and in a failure: ``prompt 3``, ``prompts 9-16``, ``re-rank prompts 1-8``."""
    if item == FINGERPRINT:
        return item
    start, end = item[1:3] if item[0] == RERANK else item[:2]
    name = f"prompt {end}" if end - start == 1 else f"prompts {start + 1}-{end}"
    return f"re-rank {name}" if item[0] == RERANK else name


def run_chunks(
    spec: tuple,
    phases: list[list[tuple[int, int]]],
    result,
    keep: int,
    jobs: int,
    rerank: int = 0,
    rerank_chunks: list[tuple[int, int]] = (),
) -> tuple[dict | None, str, list[dict]]:
    """Measure ``phases`` (the screening chunks, then the rest; one phase without screening) on ``jobs``
    workers (1: in this process), adding every prompt to ``result`` in prompt order; then, with ``rerank``,
    ``rerank_chunks``' answer recalls. ``spec``: (model_dir, prompts, dtype, budgets, tokens, max_prompts).
    Returns the survivors (None without screening), the model's fingerprint and the re-ranked prompts'
    ``{"candidate|budget": recall}`` in prompt order."""
    budgets = spec[3]
    total = MEASURE_STEPS * sum(end - start for phase in phases for start, end in phase)
    total += sum(end - start for start, end in rerank_chunks) if rerank else 0  # 1 each
    jobs = max(1, min(jobs, max(len(phase) for phase in [*phases, rerank_chunks])))
    active, fingerprint, answers, cpu = None, "", [], {"agreement": 0.0, "re-rank": 0.0}
    reranked = rerank_chunks[-1][1] if rerank and rerank_chunks else 0  # the re-ranked prompts: the first
    owner: dict[int, int] = {}  # a kept prompt -> the worker that measured it and keeps its prefill
    with Progress(total=total, desc="calibrate", unit="step") as bar:
        runner = Pool if jobs > 1 else InProcess
        with runner(jobs, _run, _load, spec, bar=bar, label=where) as pool:
            for n, phase in enumerate(phases):
                if n:
                    active = survivors(result.rows(), budgets, keep)
                items = [(start, end, active, reranked) for start, end in phase] + (
                    [] if n else [FINGERPRINT]
                )
                chunks = pool.run(items)
                for (start, end), w in zip(phase, pool.placed, strict=False):  # the fingerprint after them
                    owner.update((i, w) for i in range(start, min(end, reranked)))
                fingerprint = chunks.pop()[0] if not n else fingerprint
                for per_prompt, seconds in chunks:
                    cpu["agreement"] += seconds
                    for scores in per_prompt:
                        if result.trace is not None:
                            result.trace.append({})
                        for key, (agreement, kl, cache) in scores.items():
                            result.add(key, agreement, kl, cache)
            if rerank and rerank_chunks:
                chosen = rerank_set(result.rows(), budgets, rerank)
                items = [(RERANK, a, b, chosen) for a, b in rerank_chunks]
                for recalls, seconds in pool.run(items, to=[owner.get(a) for a, _ in rerank_chunks]):
                    cpu["re-rank"] += seconds
                    answers += recalls
    spent = ", ".join(f"{name} {s:.0f} s" for name, s in cpu.items() if s)
    print(
        f"calibrate: CPU in the chunks ({jobs} worker(s), model loads not counted): {spent}", file=sys.stderr
    )
    return active, fingerprint, answers
