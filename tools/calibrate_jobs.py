"""``vlkv calibrate --jobs N``: the prompts' chunks measured by N worker processes, the table merged in the
parent exactly as one process builds it.

Each worker (``spawn``, one torch thread) loads the model once and takes chunks from a shared queue: the
same chunks as one process (``calibrate.chunk_spans``), each prefilled and teacher-forced by the same
``measure_chunk``, so every prompt's agreement and KL per (candidate, budget) are the same numbers. A worker
sends them back per prompt; the parent adds them to its ``Calibration`` in prompt order, so the table's sums
are the same floats in the same order as one process's (the profile's ``table`` and ``entries``
bit-identical). Screening (``--screen``) is a sync point: every worker measures the screening prompts'
chunks, the parent computes ``survivors`` from those prompts alone, then hands out the rest with them.

The parent shows one progress bar over the prompts. A worker's error (or a worker that dies) stops every
worker and raises ``WorkerError`` naming the prompts and the cause; no worker outlives the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import traceback

from vlkv.tools.jobs import one_thread_env
from vlkv.tools.progress import Progress

POLL_S = 0.5


class WorkerError(RuntimeError):
    """A calibration worker failed (its prompts and error in the message)."""


class _PerPrompt:
    """``measure_chunk``'s ``out`` in a worker: each prompt's ``{(candidate, budget): (agreement, kl)}`` in
    the order measured, to be added in the parent."""

    def __init__(self) -> None:
        self.trace: list[dict] = []

    def add(self, key, agreement: float, kl: float) -> None:
        self.trace[-1][key] = (agreement, kl)


def _worker(rank, model_dir, prompts, dtype, budgets, tokens, max_prompts, tasks, results) -> None:
    import torch

    torch.set_num_threads(1)
    from vlkv.common.config import Limits, ModelConfig
    from vlkv.common.model.loading import load_model, load_processor
    from vlkv.common.model.spec import ModelSpec
    from vlkv.tools.calibrate import _examples, _RenderedTask, measure_chunk
    from vlkv.tools.calibrate_prompts import read_prompts
    from vlkv.tools.eval.evaluation import prepare

    span, parent = None, os.getppid()
    try:
        requests, _ = read_prompts(prompts)
        requests = requests[:max_prompts] if max_prompts else requests
        model = load_model(ModelConfig(path=model_dir, dtype=dtype))
        processor = load_processor(model_dir)
        if rank == 0:
            results.put(("spec", ModelSpec.from_model(model, processor.tokenizer).fingerprint))
        while (task := _next(tasks, parent)) is not None:
            index, start, end, active = task
            span = (start, end)
            examples = list(_examples(requests[start:end], processor, Limits()))
            prepared = prepare(
                model, processor, examples, progress=False, task=_RenderedTask, next_attention=False
            )
            out = _PerPrompt()
            measure_chunk(model, prepared, budgets, tokens, out, active)
            results.put(("chunk", index, out.trace))
    except Exception as err:  # reported to the parent, which stops every worker
        where = (
            (f"prompt {span[1]}" if span[1] - span[0] == 1 else f"prompts {span[0] + 1}-{span[1]}")
            if span
            else "start-up (reading the prompts, loading the model)"
        )
        cause = "".join(traceback.format_exception_only(type(err), err)).strip()
        print(f"calibrate worker {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        results.put(("error", f"calibrate worker {rank} failed at {where}: {cause}"))


def _next(tasks, parent: int):
    """The next task, or None at the end or once the parent is gone (so a killed parent leaves no worker)."""
    while True:
        try:
            return tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                return None


class _Pool:
    """The workers and their two Manager queues; ``close`` stops and joins every one."""

    def __init__(self, jobs: int, args: tuple) -> None:
        ctx = mp.get_context("spawn")
        self.manager = ctx.Manager()
        self.tasks, self.results = self.manager.Queue(), self.manager.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(rank, *args, self.tasks, self.results), daemon=True)
            for rank in range(jobs)
        ]
        with one_thread_env():
            for p in self.procs:
                p.start()

    def get(self):
        """The next message; WorkerError when a worker died without one."""
        while True:
            try:
                return self.results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
                if dead:
                    i, code = dead[0]
                    raise WorkerError(
                        f"calibrate worker {i} exited with code {code} without a result"
                    ) from None

    def close(self, finished: bool) -> None:
        """``finished``: every worker was sent its end and exits on its own; otherwise stop them now."""
        for p in self.procs:
            p.join(timeout=30 if finished else 0)
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.manager.shutdown()


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
    from vlkv.tools.calibrate import survivors

    total = sum(end - start for phase in phases for start, end in phase)
    jobs = max(1, min(jobs, max(len(phase) for phase in phases)))
    pool = _Pool(jobs, (model_dir, prompts, dtype, tuple(budgets), tokens, max_prompts))
    bar = Progress(total=total, desc="calibrate", unit="prompt")
    fingerprint, active, finished = "", None, False
    try:
        for n, phase in enumerate(phases):
            if n:
                active = survivors(result.rows(), budgets, keep)
            for index, (start, end) in enumerate(phase):
                pool.tasks.put((index, start, end, active))
            done: dict[int, list[dict]] = {}
            while len(done) < len(phase):
                message = pool.get()
                if message[0] == "error":
                    raise WorkerError(message[1])
                if message[0] == "spec":
                    fingerprint = message[1]
                    continue
                _, index, per_prompt = message
                done[index] = per_prompt
                bar.update(len(per_prompt))
            for index in range(len(phase)):
                for scores in done[index]:
                    if result.trace is not None:
                        result.trace.append({})
                    for key, (agreement, kl) in scores.items():
                        result.add(key, agreement, kl)
        for _ in pool.procs:
            pool.tasks.put(None)
        while not fingerprint:  # worker 0 sends it once loaded; it always has by now unless it failed
            message = pool.get()
            if message[0] == "error":
                raise WorkerError(message[1])
            fingerprint = message[1] if message[0] == "spec" else fingerprint
        finished = True
    finally:
        bar.close()
        pool.close(finished)
    return active, fingerprint
