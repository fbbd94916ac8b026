"""The real-text suite's rows in ``vlkv eval zoo``: SmolLM2-135M-Instruct on ``lab/vlkv_lab/zoo/text_suite.py``.

Each (task, length) is a row group of its own, scored like a member (``TextTask`` has the member interface
``evaluation.prepare`` and ``zoo_scoring`` read). The model is the text-only wrapper
(``smollm2.text_checkpoint()``, served as any user's LLaVA checkpoint) in bfloat16 (``VLKV_TEXT_DTYPE``: another
dtype, below); prompts are one-turn,
text-only chats (no image). A task whose full-cache accuracy is below ``MIN_FULL`` is dropped: the tables
name it and leave it out of every score.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.progress import Progress
from vlkv.deploy.progress import progress as track

from vlkv_lab.eval.evaluation import prepare
from vlkv_lab.eval.zoo_scoring import FULL, full_answers, merge, score_rows, wilson
from vlkv_lab.zoo import text_suite as ts

MIN_FULL = 0.9
SCREEN = 5
"""Items per step of the full-cache pass (a task the model cannot do stops after the first)."""
KEEP_BYTES = 3 << 30
"""The first pass's prefills kept for the rows, up to this many bytes: whole while they fit (50 items at 1K
tokens in bfloat16), then each without its queries (``Prepared.keep_stats``: the statistics the rows read
computed, the queries freed; 50 items at 2K take ~2.4 GB so); the items after them are prefilled again for
the rows."""
WEIGHT = 20
"""``vlkv eval zoo``'s bar: steps of one example of a SmolLM2-135M member or one 1K text item (2K: twice as
many), against 1 for a toy member's (CPU seconds here, 2026-11-27: 4-7.5 and 6-9, 15-17 at 2K, against
0.2-0.5: ~0.1-0.2 s a step throughout, so the ETA holds from the toys to the text)."""
DTYPE_ENV = "VLKV_TEXT_DTYPE"
"""The text model's dtype, ``bfloat16`` unless this variable names another: on a CPU without native bfloat16
(no AVX-512 BF16 / AMX) a bfloat16 matmul runs ~46x slower than float32 (AMD EPYC without AVX-512, 2026-11-28:
3.7 s against 0.08 s for 1024 x 576 x 1536, one thread), so a text run there takes hours instead of minutes.
Figures of different dtypes are not comparable cell by cell: each text result records its ``dtype``, and one
protocol run's files should share it. Pool workers inherit it with the environment."""
DTYPES = ("bfloat16", "float32", "float16")
TEXT_LENGTHS = (1024, 2048)
"""The default run's lengths; 4,096 behind ``--text-lengths``."""


class Steps:
    """A view of the run's bar that counts ``weight`` steps for each one it is told of (an example's share of
    the ETA by its cost)."""

    def __init__(self, bar: Progress, weight: int) -> None:
        self.bar, self.weight = bar, weight

    def update(self, n: int = 1) -> None:
        self.bar.update(n * self.weight)

    def set_postfix(self, text: str) -> None:
        self.bar.set_postfix(text)


def text_weight(length: int) -> int:
    """``Steps`` weight of one text item of ``length`` tokens."""
    return WEIGHT * max(1, round(length / 1024))


@dataclass(frozen=True)
class TextTask:
    """One text task at one length, in the zoo member interface's shape."""

    task: str
    length: int
    tokenizer: object = None
    eviction_trained: bool = False
    max_new_tokens: int = ts.MAX_NEW_TOKENS

    @property
    def name(self) -> str:
        return f"text {self.task} {self.length // 1024}K"

    @property
    def geometry(self) -> str:
        return (
            f"SmolLM2-135M-Instruct (30 layers, GQA 9/3), text only, {self.length}-token prompts: "
            f"RULER-style `{self.task}`"
        )

    def make_examples(self, n: int, seed: int = 0, split: str = "heldout") -> list[ts.TextItem]:
        return ts.items(self.task, self.length, split, n, seed, tokenizer=self.tokenizer)

    def is_correct(self, text: str, item: ts.TextItem) -> bool:
        return ts.is_correct(text, item)

    def prompt_text(self, processor, item: ts.TextItem) -> str:
        return ts.render(item, processor)


def text_dtype() -> str:
    """``DTYPE_ENV``'s dtype, ``bfloat16`` when unset; a ValueError naming the choices otherwise."""
    dtype = os.environ.get(DTYPE_ENV, "").strip() or "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"{DTYPE_ENV}={dtype!r}: the text model's dtype must be one of {', '.join(DTYPES)}")
    return dtype


def load_text_model():
    from vlkv_lab.zoo.smollm2 import text_checkpoint

    path = str(text_checkpoint())
    return load_model(ModelConfig(path=path, dtype=text_dtype())), load_processor(path)


def run_text(tasks, lengths, *args, **kwargs):
    """Yields ``(name, result)`` per (task, length) as each finishes, on one loaded text model: ``run_item``
    for each (``args``/``kwargs``: ``run_item``'s after the task and length); ``result`` as
    ``zoo.run_member``'s (before ``zoo_report.finalize``), with ``dropped`` for a task the model cannot do."""
    model, processor = load_text_model()
    for task, length in text_items(tasks, lengths):
        yield run_item(model, processor, task, length, *args, **kwargs)
    del model
    gc.collect()


def text_items(tasks, lengths) -> list[tuple[str, int]]:
    """The suite's (task, length) row groups in the order ``run_text`` runs them (and the tables list them)."""
    return [(task, length) for length in lengths for task in tasks]


def text_name(task: str, length: int) -> str:
    """The tables' name of ``task`` at ``length`` tokens (``TextTask.name``)."""
    return TextTask(task, length).name


def run_item(
    model,
    processor,
    task: str,
    length: int,
    n: int,
    seed: int,
    split: str,
    configs,
    budgets,
    chunk: int = 25,
    oracle: bool = True,
    bar: Progress | None = None,
) -> tuple[str, dict]:
    """``(name, result)`` of one (task, length) on the loaded text model: one of ``run_text``'s, which
    ``vlkv eval zoo --jobs N`` runs as a work item of its own (``deploy/pool.py``). bar: the run's one bar,
    told of ``text_weight(length)`` steps for each of ``run_task``'s."""
    t = TextTask(task, length, processor.tokenizer, max_new_tokens=ts.max_new_tokens(task))
    steps = None if bar is None else Steps(bar, text_weight(length))
    if steps is not None:
        steps.set_postfix(t.name)
    return t.name, run_task(model, processor, t, n, seed, split, configs, budgets, chunk, oracle, bar=steps)


def run_task(
    model,
    processor,
    t: TextTask,
    n,
    seed,
    split,
    configs,
    budgets,
    chunk,
    oracle,
    screen: int = SCREEN,
    bar: Progress | Steps | None = None,
) -> dict:
    """Two passes. First the full cache alone, ``screen`` items at a time: the task is dropped as soon as its
    full-cache accuracy cannot reach ``MIN_FULL`` (the Wilson interval's upper end over the items so far is
    below it, or more items are wrong than ``MIN_FULL`` of all of them allows), or when it ends below it; no row is run for a dropped task. Then, chunk by chunk, every row and
    the oracles (from the first pass's full-cache answers), on the first pass's prefills while they fit in
    ``KEEP_BYTES`` (whole, or once they would not fit, as ``Prepared.keep_stats`` leaves them: a task
    dropped before that computes no row's statistics), on new ones after. bar: the run's one
    progress bar, two steps an item (its prefill, its rows; a dropped task's rest at once); its own bars
    when None."""
    items = t.make_examples(n, seed, split)
    result = {"eviction_trained": False, "real_decoder": True, "geometry": t.geometry, "dtype": text_dtype()}
    ids: list = []
    right: dict = {}
    ms: list[int] = []
    kept: list = []
    room = KEEP_BYTES
    slim = False
    first = track(
        _parts(items, screen), desc=f"{t.name} full cache", unit=f"{screen} items", disable=bar is not None
    )
    for part in first:
        prepared = prepare(model, processor, part, progress=False, task=t, next_attention=False, counter=bar)
        ms += [p.m for p in prepared]
        part_ids, full = full_answers(model, processor, prepared, t.max_new_tokens)
        ids += part_ids
        merge(right, full)
        for i, p in enumerate(prepared):  # a prefix of the items, while they fit
            if len(kept) != len(ids) - len(prepared) + i:
                continue
            if _nbytes(p) > room and not slim:  # from now on kept without their queries
                slim = True
                for k in kept:
                    k.keep_stats(configs, budgets, oracle)
                room = KEEP_BYTES - sum(_nbytes(k) for k in kept)
            if _nbytes(p, slim) <= room:
                if slim:
                    p.keep_stats(configs, budgets, oracle)
                kept.append(p)
                room -= _nbytes(p)
        seen = right[FULL]["1.0"]
        if wilson(sum(seen), len(seen))[1] < MIN_FULL:
            result["dropped"] = f"full cache {sum(seen)} of {len(seen)} right: cannot reach {MIN_FULL}"
            break
        best = (sum(seen) + len(items) - len(seen)) / len(items)
        if best < MIN_FULL - 1e-9:  # below MIN_FULL whatever the rest gives
            result["dropped"] = f"full cache {len(seen) - sum(seen)} wrong of {len(items)}: below {MIN_FULL}"
            break
        del prepared
    seen = right[FULL]["1.0"]
    if "dropped" not in result and sum(seen) / len(seen) < MIN_FULL:
        result["dropped"] = f"full cache {sum(seen) / len(seen):.3f} < {MIN_FULL}"
    if "dropped" in result:
        if bar is not None:  # the items not prefilled, and no item's rows
            bar.update(2 * len(items) - len(seen))
        return result | {"hits": right, "m": sum(ms) / len(ms)}
    done = 0
    rows = track(_parts(items, chunk), desc=f"{t.name} rows", unit=f"{chunk} items", disable=bar is not None)
    for part in rows:
        reuse = kept[done : done + len(part)]
        prepared = reuse + (
            prepare(model, processor, part[len(reuse) :], progress=False, task=t, next_attention=False)
            if len(reuse) < len(part)
            else []
        )
        part_ids = ids[done : done + len(part)]
        kept[done : done + len(reuse)] = [None] * len(reuse)  # freed once scored
        done += len(part)
        merge(
            right,
            score_rows(model, processor, prepared, part_ids, configs, budgets, t.max_new_tokens, oracle),
        )
        if bar is not None:
            bar.update(len(part))
        del prepared, reuse
        gc.collect()
    return result | {"hits": right, "m": sum(ms) / len(ms)}


def _nbytes(p, slim: bool = False) -> int:
    """Bytes of a prefill's tensors; ``slim``: as kept (``Prepared.keep_stats``: no queries)."""
    tensors = [*([] if slim else getattr(p, "q", [])), *getattr(p, "keys", []), *getattr(p, "values", [])]
    return sum(x.numel() * x.element_size() for x in tensors)


def _parts(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
