"""Which sequences decode in the next step: continuous batching with preemption (no asyncio, no torch).

A sequence arrives with its cache already in the pool (``add``: waiting, first come first served).
``schedule()`` runs before every step and returns a ``SchedulePlan``; it does the block manager's
bookkeeping itself, and leaves the K/V copies the plan names to the caller (they need the tensors):

1. resume: preempted sequences come back, oldest first, while each fits with room for its next token
   (``swapped_in``: write their host K/V into these tables);
2. join: waiting sequences join the running batch up to ``max_batch``, but not while a preempted one is
   still waiting and something runs (preempted sequences go first; the worker never stalls on them);
3. make room: every running sequence, oldest first, takes a block in each layer whose last block is
   full; when the pool is short the newest running sequence is preempted: its blocks are freed
   (``swapped_out``: read its K/V from these tables, before the next step writes the pool), or, when its
   K/V would not fit in ``swap_bytes`` of host memory, it leaves for good (``failed``: the caller ends it
   with RESOURCE_EXHAUSTED).

The caller applies ``swapped_in`` before ``swapped_out`` (a sequence resumed and preempted again in the
same plan is in both), then steps ``running``, then grows each stepped sequence's ``lengths`` by one (and a
sliding layer's ring drops the blocks no later step reads, ``BlockManager.slide``: ``lengths`` count the
entries a sequence holds, which is what a swap copies and a resume allocates). A finished or cancelled
sequence leaves through ``finish``, which frees its blocks.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from vlkv.decode_worker.block_manager import BlockManager, SequenceBlocks


class Schedulable(Protocol):
    """What the scheduler reads and writes on a sequence."""

    blocks: SequenceBlocks  # replaced on resume
    lengths: list[int]  # per layer cached tokens; the caller grows them after each step
    arrival: int  # set by ``Scheduler.add``: preemption takes the newest, resumption the oldest


S = TypeVar("S", bound=Schedulable)
Tables = list[list[int]]  # per layer block ids, as they were when the plan was made


@dataclass
class SchedulePlan(Generic[S]):
    running: list[S] = field(default_factory=list)  # this step's batch, each with room for its token
    swapped_in: list[tuple[S, Tables]] = field(default_factory=list)  # resumed: write host K/V here
    swapped_out: list[tuple[S, Tables]] = field(default_factory=list)  # preempted: copy K/V from here
    failed: list[S] = field(default_factory=list)  # preempted with no swap space left; blocks freed


class Scheduler(Generic[S]):
    """Waiting (deque, FCFS), running (list) and swapped (list, in arrival order) sequences.

    token_bytes: host bytes one cached token of one layer takes when swapped out (K and V);
    swap_bytes: the host memory preempted sequences may hold in all.
    """

    def __init__(
        self, blocks: BlockManager, max_batch: int, swap_bytes: int = 0, token_bytes: int = 0
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.blocks = blocks
        self.max_batch = max_batch
        self.swap_bytes = swap_bytes
        self.token_bytes = token_bytes
        self.preemptions = 0
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self.swapped: list[S] = []
        self._arrivals = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def swap_bytes_of(self, seq: S) -> int:
        return sum(seq.lengths) * self.token_bytes

    @property
    def swap_used(self) -> int:
        """Host bytes held by preempted sequences."""
        return sum(self.swap_bytes_of(s) for s in self.swapped)

    def add(self, seq: S) -> None:
        """Queue a sequence whose cache is in the pool (its blocks taken through the block manager)."""
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def finish(self, seq: S, free: bool = True) -> None:
        """Remove a sequence wherever it is and free its blocks (finished, cancelled, failed); ``free``
        False: its blocks stay taken (the caller keeps them, ``retention.py``)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
        if free and seq.blocks.num_blocks:
            self.blocks.free(seq.blocks)

    def schedule(self) -> SchedulePlan[S]:
        plan: SchedulePlan[S] = SchedulePlan()
        self._resume(plan)
        if not self.swapped or not self.running:
            while len(self.running) < self.max_batch and self.waiting:
                self.running.append(self.waiting.popleft())
        self._make_room(plan)
        plan.running = list(self.running)
        return plan

    def _resume(self, plan: SchedulePlan[S]) -> None:
        while self.swapped and len(self.running) < self.max_batch:
            seq = self.swapped[0]
            blocks = self.blocks.allocate(seq.lengths, 1)
            if blocks is None:
                return
            self.swapped.pop(0)
            seq.blocks = blocks
            self.running.append(seq)
            plan.swapped_in.append((seq, [list(t) for t in blocks.tables]))

    def _make_room(self, plan: SchedulePlan[S]) -> None:
        for seq in sorted(self.running, key=lambda s: s.arrival):
            while seq in self.running and not self.blocks.append(seq.blocks, seq.lengths):
                self._preempt(max(self.running, key=lambda s: s.arrival), plan)

    def _preempt(self, seq: S, plan: SchedulePlan[S]) -> None:
        self.running.remove(seq)
        self.preemptions += 1
        tables = [list(t) for t in seq.blocks.tables]
        fits = self.swap_used + self.swap_bytes_of(seq) <= self.swap_bytes
        self.blocks.free(seq.blocks)
        if not fits:
            plan.failed.append(seq)
            return
        bisect.insort(self.swapped, seq, key=lambda s: s.arrival)
        plan.swapped_out.append((seq, tables))
