"""``vlkv calibrate --jobs N``: the prompts' chunks measured on the tools' one worker pool (``pool.py``), the
table merged in the parent exactly as one process builds it.

Each worker loads the model once (``_load``, the pool's setup) and measures the chunks it is handed
(``_measure``): the same chunks as one process (``calibrate.chunk_phases``), each prefilled and teacher-forced
by the same ``measure_chunk``, so every prompt's agreement and KL per (candidate, budget) are the same
numbers. A chunk's result is its prompts' scores; the parent adds them to its ``Calibration`` in prompt order,
so the table's sums are the same floats in the same order as one process's (the profile's ``table`` and
``entries`` bit-identical). Screening (``--screen``) is two batches on the same workers, the model still
loaded: the screening prompts' chunks, then, once the parent has computed ``survivors`` from those prompts
alone, the rest with them.

The parent shows one progress bar over the prompts. A chunk's error (or a worker that dies) stops every worker
and raises the pool's ``WorkerFailed`` naming the worker, the prompts and the cause.
"""

from __future__ import annotations

from vlkv.common.config import Limits, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.tools.calibrate import _examples, _RenderedTask, measure_chunk, survivors
from vlkv.tools.calibrate_prompts import read_prompts
from vlkv.tools.eval.evaluation import prepare
from vlkv.tools.pool import Pool
from vlkv.tools.progress import Progress

FINGERPRINT = "the model's fingerprint"
"""The item that asks a worker for the loaded model's fingerprint (the profile's ``model``)."""


class _PerPrompt:
    """``measure_chunk``'s ``out`` in a worker: each prompt's ``{(candidate, budget): (agreement, kl)}`` in
    the order measured, to be added in the parent."""

    def __init__(self) -> None:
        self.trace: list[dict] = []

    def add(self, key, agreement: float, kl: float) -> None:
        self.trace[-1][key] = (agreement, kl)


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
        "requests": requests,
        "budgets": budgets,
        "tokens": tokens,
    }


def _measure(item, state: dict, bar) -> list[dict] | str:
    """One chunk ``(start, end, active)`` in a worker: its prompts' scores in order (or the fingerprint)."""
    model, processor = state["model"], state["processor"]
    if item == FINGERPRINT:
        return ModelSpec.from_model(model, processor.tokenizer).fingerprint
    start, end, active = item
    examples = list(_examples(state["requests"][start:end], processor, Limits()))
    prepared = prepare(model, processor, examples, progress=False, task=_RenderedTask, next_attention=False)
    out = _PerPrompt()
    measure_chunk(model, prepared, state["budgets"], state["tokens"], out, active)
    bar.update(end - start)
    return out.trace


def where(item) -> str:
    """An item's name in the bar and in a failure: ``prompt 3``, ``prompts 9-16``."""
    if item == FINGERPRINT:
        return item
    start, end = item[:2]
    return f"prompt {end}" if end - start == 1 else f"prompts {start + 1}-{end}"


def measure_in_workers(
    model_dir: str,
    prompts: str,
    dtype: str,
    budgets,
    tokens: int,
    max_prompts: int,
    phases: list[list[tuple[int, int]]],
    result,
    keep: int,
    jobs: int,
) -> tuple[dict | None, str]:
    """Measure ``phases`` (the screening chunks, then the rest; one phase without screening) in ``jobs``
    workers, adding every prompt to ``result`` in prompt order. Returns the survivors (None without
    screening) and the model's fingerprint."""
    total = sum(end - start for phase in phases for start, end in phase)
    jobs = max(1, min(jobs, max(len(phase) for phase in phases)))
    spec = (model_dir, prompts, dtype, tuple(budgets), tokens, max_prompts)
    active, fingerprint = None, ""
    with (
        Progress(total=total, desc="calibrate", unit="prompt") as bar,
        Pool(jobs, _measure, _load, spec, bar=bar, label=where) as pool,
    ):
        for n, phase in enumerate(phases):
            if n:
                active = survivors(result.rows(), budgets, keep)
            chunks = pool.run([(start, end, active) for start, end in phase] + ([] if n else [FINGERPRINT]))
            fingerprint = chunks.pop() if not n else fingerprint
            for per_prompt in chunks:
                for scores in per_prompt:
                    if result.trace is not None:
                        result.trace.append({})
                    for key, (agreement, kl) in scores.items():
                        result.add(key, agreement, kl)
    return active, fingerprint
