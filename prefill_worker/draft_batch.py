"""The drafts of the requests in flight on one prefill worker, stepped as one batch.

With ``--prefill-concurrency N`` a prefill worker runs up to N requests at once. Each one's greedy draft over
its full cache (verification's reference, lookahead's queries: ``draft_queries.py``) is a run of batch-1
decode steps, each reading every weight of the model; :class:`DraftBatcher` runs the drafts that are waiting
together (``draft_queries.run_drafts``: one forward per step for all of them). Nothing waits on purpose: the
drafting thread takes whatever is queued when it is free, so a request alone is drafted at once and under load
the drafts that queued behind a running batch go together in the next one (continuous batching, as a decode
worker batches its sequences).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future

from vlkv.prefill_worker.draft_queries import Draft, run_drafts

_STOP = object()


class DraftBatcher:
    def __init__(self, model, eos: Iterable[int], max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.eos = tuple(eos)
        self.max_batch = max_batch
        self.batches = 0  # batches drafted
        self.drafted = 0  # drafts, all batches together
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="vlkv-draft", daemon=True)
        self._thread.start()

    def draft(self, keys, values, first: int, steps: int) -> Draft:
        """The draft of one prompt (its log-probabilities kept), drafted with whatever else is waiting."""
        done: Future = Future()
        self._queue.put(((keys, values, int(first), int(steps)), done))
        return done.result()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._queue.put(_STOP)
                    break
                batch.append(more)
            try:
                drafts = run_drafts(self.model, [args for args, _ in batch], self.eos, logprobs=True)
            except BaseException as exc:  # noqa: BLE001 - every waiting request gets the error, the thread lives
                for _, done in batch:
                    done.set_exception(exc)
                continue
            self.batches += 1
            self.drafted += len(batch)
            for (_, done), draft in zip(batch, drafts, strict=True):
                done.set_result(draft)
