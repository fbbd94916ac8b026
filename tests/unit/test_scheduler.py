"""The pure decode scheduler on tiny fake pools: exact block ids, preemption and resumption order (no model,
no torch)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from vlkv.decode_worker.block_manager import BlockManager, SequenceBlocks
from vlkv.decode_worker.scheduler import Scheduler


@dataclass(eq=False)
class Seq:
    name: str
    blocks: SequenceBlocks
    lengths: list[int]
    arrival: int = field(default=0)


def _seqs(pool: BlockManager, sched: Scheduler, *lengths: list[int]) -> list[Seq]:
    out = []
    for i, n in enumerate(lengths):
        seq = Seq("ABCDEFG"[i], pool.allocate(n, 0), list(n))
        sched.add(seq)
        out.append(seq)
    return out


def _step(plan) -> None:
    """What the caller does after the model step: every stepped sequence cached one more token."""
    for seq in plan.running:
        seq.lengths = [n + 1 for n in seq.lengths]


def test_block_manager_and_scheduler_import_without_torch():
    code = (
        "import sys, vlkv.decode_worker.block_manager, vlkv.decode_worker.scheduler; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_waiting_join_fcfs_up_to_max_batch_and_grow_a_block_when_full():
    pool = BlockManager(8, 2)
    sched = Scheduler(pool, max_batch=2)
    a, b, c = _seqs(pool, sched, [2, 1], [1, 1], [2, 2])
    assert (a.blocks.tables, b.blocks.tables, c.blocks.tables) == ([[0], [1]], [[2], [3]], [[4], [5]])
    plan = sched.schedule()
    assert plan.running == [a, b] and list(sched.waiting) == [c]
    assert a.blocks.tables == [[0, 6], [1]] and b.blocks.tables == [[2], [3]]  # only a's full layer grows
    assert not (plan.swapped_in or plan.swapped_out or plan.failed)
    _step(plan)
    sched.finish(b)  # finished: its blocks come back at once
    assert pool.num_free == 3 and sched.running == [a]
    plan = sched.schedule()
    assert plan.running == [a, c] and pool.num_free == 0
    assert a.blocks.tables == [[0, 6], [1, 2]] and c.blocks.tables == [[4, 3], [5, 7]]  # oldest first


def test_newest_is_preempted_and_waiting_sequences_wait_behind_it():
    pool = BlockManager(7, 2)
    sched = Scheduler(pool, max_batch=3, swap_bytes=100, token_bytes=3)
    a, b, c, d = _seqs(pool, sched, [2], [2], [2], [1])
    plan = sched.schedule()
    assert plan.running == [a, b, c] and [s.blocks.tables for s in (a, b, c)] == [
        [[0, 4]],
        [[1, 5]],
        [[2, 6]],
    ]
    _step(plan)
    _step(sched.schedule())  # 3 tokens in 4 slots: nothing to take
    plan = sched.schedule()  # 4 tokens each, the pool is empty: the newest (c) goes to host memory
    assert plan.running == [a, b] and plan.swapped_out == [(c, [[2, 6]])] and not plan.failed
    assert a.blocks.tables == [[0, 4, 2]] and b.blocks.tables == [[1, 5, 6]]  # c's blocks, reused
    assert c.blocks.tables == [[]] and sched.swapped == [c] and sched.preemptions == 1
    assert sched.swap_used == 4 * 3 and list(sched.waiting) == [d]  # d waits: c goes first
    _step(plan)
    sched.finish(a)
    plan = sched.schedule()  # c resumes (its 4 tokens + room for the next), then d joins
    assert plan.swapped_in == [(c, [[0, 4, 2]])] and c.blocks.tables == [[0, 4, 2]]
    assert plan.running == [b, c, d] and not sched.swapped and not sched.waiting and sched.swap_used == 0
    assert d.blocks.tables == [[3]] and pool.num_free == 0


def test_preempted_sequences_resume_oldest_first():
    pool = BlockManager(4, 2)
    sched = Scheduler(pool, max_batch=8, swap_bytes=100, token_bytes=1)
    a, b, c = _seqs(pool, sched, [2], [2], [2])
    plan = sched.schedule()  # a takes the last block; b needs one: c is preempted
    assert plan.running == [a, b] and plan.swapped_out == [(c, [[2]])]
    assert a.blocks.tables == [[0, 3]] and b.blocks.tables == [[1, 2]]
    _step(plan)
    _step(sched.schedule())
    plan = sched.schedule()  # a needs a block again: b, the newest running, goes
    assert plan.running == [a] and plan.swapped_out == [(b, [[1, 2]])] and a.blocks.tables == [[0, 3, 1]]
    assert sched.swapped == [b, c] and sched.preemptions == 2  # kept in arrival order
    _step(plan)
    e = Seq("E", pool.allocate([0], 0), [0])
    sched.add(e)
    sched.finish(a)
    plan = sched.schedule()  # b (older) resumes into 3 blocks; c does not fit in the 1 left, e waits
    assert plan.swapped_in == [(b, [[0, 3, 1]])] and plan.running == [b]
    assert sched.swapped == [c] and list(sched.waiting) == [e] and pool.num_free == 1


def test_no_swap_space_fails_the_preempted_sequence_and_frees_its_blocks():
    pool = BlockManager(4, 2)
    sched = Scheduler(pool, max_batch=8, swap_bytes=2, token_bytes=1)
    a, b, c = _seqs(pool, sched, [2], [2], [2])
    plan = sched.schedule()  # c's 2 tokens would fit in 2 bytes of swap
    assert plan.swapped_out == [(c, [[2]])] and sched.swap_used == 2
    _step(plan)
    _step(sched.schedule())
    plan = sched.schedule()  # b's 4 tokens do not fit beside c's: it fails instead
    assert plan.failed == [b] and not plan.swapped_out and plan.running == [a]
    assert b not in sched.swapped and b.blocks.tables == [[]] and sched.preemptions == 2
    sched.finish(b)  # the caller ending it again is harmless: nothing left to free
    sched.finish(a)
    assert pool.num_free == 4 and sched.has_work  # c still waits to resume
    plan = sched.schedule()
    assert plan.swapped_in == [(c, [[0, 3]])] and plan.running == [c]  # a's blocks, in a's order
    sched.finish(c)
    assert pool.num_free == 4 and not sched.has_work


def test_finish_removes_a_sequence_from_any_queue():
    pool = BlockManager(4, 2)
    sched = Scheduler(pool, max_batch=1)
    a, b = _seqs(pool, sched, [1], [1])
    sched.schedule()
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.finish(b)
    sched.finish(a)
    assert not sched.has_work and pool.num_free == 4
