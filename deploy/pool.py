"""The tools' one worker pool (``vlkv eval zoo --jobs N``, ``vlkv calibrate --jobs N``).

``Pool(jobs, work, setup, spec)`` starts ``jobs`` spawned processes of one torch thread each
(``OMP_NUM_THREADS=1`` at spawn, ``torch.set_num_threads(1)``). Each runs ``setup(spec)`` once (calibrate
loads its model there; without ``setup`` the state is ``spec``), then ``work(item, state, bar)`` for every
item it is handed. ``Pool.run(items)`` is one batch: the parent hands the next item to whichever worker is
free, in the order given, and returns the results in that order (``on_result(i, result)`` as each comes);
``Pool.run(items, to=workers)`` sends an item to the worker named for it (calibrate's re-rank chunks to the
worker that kept their prefills), ``pool.placed`` says which worker ran each item of the last batch.
The workers stay up between batches, so a second batch (calibrate's prompts after its screening) finds the
model loaded. Everything a worker says comes back to the parent: steps for the parent's one bar
(``bar.update(n)`` in ``work``), a result, or an error. The parent's bar names the items in flight.

``InProcess`` is ``Pool``'s interface in the calling process (``--jobs 1``): the same ``setup`` and ``work``,
the items in order, an item's error raised as itself.

Each worker talks to the parent over a pipe of its own (no semaphores in the parent, no queue a killed
worker could leave locked). A failed item, a failed ``setup`` or a worker that dies (killed, out of memory)
raises ``WorkerFailed`` naming the worker, the item and the cause, after every worker has been stopped.
Stopping is SIGTERM, which a worker turns into ``SystemExit``, so its exit handlers run: a worker's
multiprocessing locks (tqdm makes one) are released, and the resource tracker prints no "leaked semaphore";
one still alive ``STOP_S`` later is killed. Workers ignore SIGINT (Ctrl-C reaches the parent, which stops
them) and stop themselves when the parent goes away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from vlkv.deploy.progress import Progress

POLL_S = 0.5
STOP_S = 10.0
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
START_UP = "start-up"
"""What ``WorkerFailed.item`` says for a worker that failed before its first item (``setup``)."""


class WorkerFailed(RuntimeError):
    """An item (or a worker's setup) failed, or a worker died; every worker is stopped by the time it is
    raised. ``item``: the item's label; ``cause``: the error in a line; ``error``: its traceback."""

    def __init__(self, worker: int, item: str, cause: str, error: str = "") -> None:
        super().__init__(f"worker {worker} failed at {item}: {cause}")
        self.worker, self.item, self.cause, self.error = worker, item, cause, error or cause


@contextlib.contextmanager
def one_thread_env():
    """Children inherit the environment at spawn: one OpenMP/BLAS thread from their first import."""
    saved = {k: os.environ.get(k) for k in THREAD_ENV}
    os.environ.update({k: "1" for k in THREAD_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _PipeBar:
    """A worker's view of the parent's bar: ``update(n)`` sends the steps."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def update(self, n: int = 1) -> None:
        if n:
            self.conn.send(("steps", n))

    def set_postfix(self, text: str) -> None:  # the parent names the items in flight
        pass


def _stop(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the exit handlers run undisturbed
    raise SystemExit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)  # as the parent would: exit handlers run
    time.sleep(STOP_S)
    os._exit(1)


def _failure(err: BaseException) -> tuple[str, str]:
    return "".join(traceback.format_exception_only(type(err), err)).strip(), traceback.format_exc()


def _worker(conn, work: Callable, setup: Callable | None, spec: Any, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    import torch

    torch.set_num_threads(1)
    i = None
    try:
        state = setup(spec) if setup is not None else spec
        bar = _PipeBar(conn)
        conn.send(("ready",))
        while (task := conn.recv()) is not None:
            i, item = task
            result = work(item, state, bar)
            conn.send(("done", i, result))
            i = None
    except EOFError:  # the parent closed its end: nothing more to do
        return
    except Exception as err:  # reported to the parent, which stops every worker
        conn.send(("error", i, *_failure(err)))
    finally:  # exiting now: a SIGTERM must not cut the exit handlers short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Pool:
    """``jobs`` workers running ``work`` after ``setup``; ``close`` (or the ``with`` block's end) stops every
    one. ``bar``: the parent's progress bar; ``label(item)``: an item's name in the bar and in errors."""

    def __init__(
        self,
        jobs: int,
        work: Callable,
        setup: Callable | None = None,
        spec: Any = None,
        bar: Progress | None = None,
        label: Callable[[Any], str] = str,
    ) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.bar, self.label = bar, label
        self.conns, self.procs = [], []
        self.ready: set[int] = set()  # set up (its setup done)
        self.flight: dict[int, int] = {}  # worker -> the index of its item in the batch
        self.placed: list[int] = []  # the last batch's worker per item
        try:
            with one_thread_env():
                for _ in range(jobs):
                    mine, theirs = ctx.Pipe()
                    self.conns.append(mine)
                    self.procs.append(
                        ctx.Process(
                            target=_worker, args=(theirs, work, setup, spec, os.getpid()), daemon=True
                        )
                    )
                    self.procs[-1].start()
                    theirs.close()  # the worker's end only in the worker: its exit reads as EOF here
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self,
        items: Sequence,
        on_result: Callable[[int, Any], None] | None = None,
        to: Sequence[int | None] | None = None,
    ) -> list:
        """Every item on the workers, handed out in order; their results in that order. ``to``: per item the
        worker that must run it (one that kept what the item needs in its state), None for any; a worker
        takes the first item left that it may run. ``placed`` then says which worker ran each item. Raises
        ``WorkerFailed`` (every worker stopped) when an item fails or a worker dies."""
        results: dict[int, Any] = {}
        to = list(to) if to is not None else [None] * len(items)
        if len(to) != len(items) or any(w is not None and not 0 <= w < len(self.procs) for w in to):
            raise ValueError(f"to: one worker in 0..{len(self.procs) - 1} or None per item, got {to}")
        todo = list(range(len(items)))
        self.placed = [0] * len(items)
        try:
            for w in range(len(self.procs)):
                self._hand(w, todo, items, to)
            while len(results) < len(items):
                ready = wait(self.conns + [p.sentinel for p in self.procs], timeout=POLL_S)
                for w, conn in enumerate(self.conns):
                    if conn not in ready and self.procs[w].sentinel not in ready:
                        continue
                    while (message := self._receive(w, items)) is not None:
                        if message[0] == "ready":
                            self.ready.add(w)
                        elif message[0] == "steps":
                            if self.bar is not None:
                                self.bar.update(message[1])
                        else:
                            _, i, result = message
                            del self.flight[w]
                            results[i] = result
                            if on_result is not None:
                                on_result(i, result)
                            self._hand(w, todo, items, to)
                if self.bar is not None:
                    self.bar.update(0)
                    self.bar.set_postfix(", ".join(self.label(items[i]) for i in self.flight.values()))
        except BaseException:
            self.close()
            raise
        return [results[i] for i in range(len(items))]

    def _hand(self, w: int, todo: list[int], items, to: list[int | None]) -> None:
        """Worker ``w``'s next item: the first one left that any worker or ``w`` itself may run."""
        for n, i in enumerate(todo):
            if to[i] is None or to[i] == w:
                del todo[n]
                self.conns[w].send((i, items[i]))
                self.flight[w] = i
                self.placed[i] = w
                return

    def _receive(self, w: int, items) -> tuple | None:
        """Worker ``w``'s next message; None when it has none yet; ``WorkerFailed`` for an error or a death."""
        conn, proc = self.conns[w], self.procs[w]
        where = START_UP if w not in self.ready else "no item (idle)"
        where = self.label(items[self.flight[w]]) if w in self.flight else where
        try:
            if conn.poll():
                message = conn.recv()
                if message[0] != "error":
                    return message
                _, i, cause, error = message
                self.flight.pop(w, None)
                self.ready.add(w)  # it exits on its own
                raise WorkerFailed(w, self.label(items[i]) if i is not None else START_UP, cause, error)
            if proc.is_alive():
                return None
        except EOFError:  # its end closed: it is exiting or gone
            pass
        proc.join(STOP_S)
        raise WorkerFailed(w, where, f"its worker exited with code {proc.exitcode}")

    def close(self) -> None:
        """Idle workers are told to end and exit on their own; busy ones get SIGTERM (a clean exit); any
        still alive ``STOP_S`` later is killed."""
        for w, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True)):
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            if w in self.flight or w not in self.ready:
                proc.terminate()
        self.flight.clear()
        for proc in self.procs:
            proc.join(STOP_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


class InProcess:
    """``Pool``'s interface without workers: ``setup(spec)`` now, then ``work(item, state, bar)`` for every
    item in this process, in order (``jobs`` is taken for the signature and must be 1)."""

    def __init__(
        self,
        jobs: int,
        work: Callable,
        setup: Callable | None = None,
        spec: Any = None,
        bar: Progress | None = None,
        label: Callable[[Any], str] = str,
    ) -> None:
        if jobs != 1:
            raise ValueError(f"InProcess runs one job, got {jobs}")
        self.work, self.bar, self.label = work, bar, label
        self.state = setup(spec) if setup is not None else spec
        self.placed: list[int] = []

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(
        self,
        items: Sequence,
        on_result: Callable[[int, Any], None] | None = None,
        to: Sequence[int | None] | None = None,
    ) -> list:
        """Every item here, in order; their results in that order (``to``: as ``Pool.run``'s, 0 or None)."""
        if to is not None and any(w not in (0, None) for w in to):
            raise ValueError(f"InProcess has worker 0 only, got {list(to)}")
        self.placed = [0] * len(items)
        results = []
        for i, item in enumerate(items):
            if self.bar is not None:
                self.bar.set_postfix(self.label(item))
            results.append(self.work(item, self.state, self.bar if self.bar is not None else _NoBar()))
            if on_result is not None:
                on_result(i, results[-1])
        return results


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass
