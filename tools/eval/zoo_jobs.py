"""``vlkv eval --zoo --jobs N``: the run's work items in N worker processes, one torch thread each.

``run_items`` starts ``jobs`` spawned processes (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``) that take the items off one queue in the order given (the caller puts the
longest first) and run each with ``runner(item, spec, bar)``, a module-level function (pickled by name).
Everything a worker says comes back on one queue: an item started, steps done (the parent's one bar counts
them), an item's result (``done(item, result)`` in the parent), or an item's error.

The pool is its own rather than ``concurrent.futures.ProcessPoolExecutor``: a failed item has to stop the
items still running at once (the executor cannot end a running call without its private process table), and
one queue carries both the bar's steps and the results. A failure, a worker that dies (killed, out of
memory) or Ctrl-C terminates every worker before ``run_items`` returns or raises; workers ignore SIGINT (the
parent ends them) and end themselves if the parent goes away.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vlkv.tools.jobs import one_thread_env, parse_jobs
from vlkv.tools.progress import Progress

__all__ = ["JobFailed", "parse_jobs", "run_items"]

POLL_S = 0.5


class JobFailed(RuntimeError):
    """An item failed in its worker (``error``: its traceback, or how the worker died)."""

    def __init__(self, item: str, error: str) -> None:
        super().__init__(f"{item} failed: {error}")
        self.item, self.error = item, error


class _QueueBar:
    """A worker's view of the parent's bar: ``update(n)`` sends the steps."""

    def __init__(self, out, wid: int) -> None:
        self.out, self.wid = out, wid

    def update(self, n: int = 1) -> None:
        if n:
            self.out.put(("steps", self.wid, n))

    def set_postfix(self, text: str) -> None:  # the parent names the items in flight
        pass


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _worker(wid: int, items: Sequence, spec: Any, runner: Callable, todo, out, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    bar = _QueueBar(out, wid)
    while (i := todo.get()) is not None:
        out.put(("start", wid, i))
        try:
            result = runner(items[i], spec, bar)
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops the run
            import traceback

            out.put(("error", wid, (i, traceback.format_exc())))
            return
        out.put(("done", wid, (i, result)))


def run_items(
    items: Sequence,
    order: Sequence[int],
    spec: Any,
    runner: Callable,
    jobs: int,
    bar: Progress,
    done: Callable[[Any, Any], None],
    label: Callable[[Any], str] = str,
) -> None:
    """Runs ``items[i]`` for ``i`` in ``order`` on ``jobs`` workers; ``done(item, result)`` in the parent as
    each finishes; ``bar`` counts the steps workers report and names the items in flight. Raises
    ``JobFailed`` (every worker ended) when an item fails or a worker dies."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    todo, out = ctx.Queue(), ctx.Queue()
    for i in order:
        todo.put(i)
    for _ in range(jobs):
        todo.put(None)
    procs = [
        ctx.Process(
            target=_worker,
            args=(w, list(items), spec, runner, todo, out, os.getpid()),
            daemon=True,
            name=f"vlkv-zoo-{w}",
        )
        for w in range(jobs)
    ]
    running: dict[int, int] = {}  # worker -> item
    left = len(order)
    try:
        with one_thread_env():
            for p in procs:
                p.start()
        while left:
            for w, p in enumerate(procs):  # killed (out of memory, a signal): no message comes
                if p.exitcode not in (None, 0):
                    what = label(items[running[w]]) if w in running else f"worker {w}"
                    raise JobFailed(what, f"its worker exited with code {p.exitcode}")
            try:
                kind, wid, body = out.get(timeout=POLL_S)
            except queue.Empty:
                if all(p.exitcode == 0 for p in procs):
                    raise JobFailed("the run", f"every worker ended with {left} items left") from None
                bar.update(0)
                continue
            if kind == "steps":
                bar.update(body)
            elif kind == "start":
                running[wid] = body
            elif kind == "error":
                raise JobFailed(label(items[body[0]]), body[1])
            else:
                running.pop(wid, None)
                left -= 1
                done(items[body[0]], body[1])
            bar.set_postfix(", ".join(label(items[i]) for i in running.values()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        out.cancel_join_thread()
        todo.cancel_join_thread()
