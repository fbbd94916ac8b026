"""A decode worker keeping a finished sequence's cache for its conversation's next turn (``retention.py``):
a turn continued on the kept cache decodes exactly as the sequence would have gone on, with or without
positions dropped and fed again; kept blocks are room that any admission or growth takes back; what must not
be kept is not; a turn that does not fit the kept cache is refused with its blocks freed."""

from __future__ import annotations

import grpc
import pytest
import torch
from fake_runner import FakeRunner
from vlkv.common.errors import VlkvError
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import AdmissionPolicy, BlockManager
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.retention import RetainedCaches, continued_sequence
from vlkv.decode_worker.sequence import FinishReason, Sequence

PROMPT = 20  # the first turn's prompt positions
LENGTHS = [9, 5]  # its compact cache per layer


def _core(num_blocks: int = 64, policy: AdmissionPolicy | None = None, **kw) -> DecodeCore:
    blocks, cache = BlockManager(num_blocks, 4, policy), KVCache(num_blocks, 4, num_kv_heads=2, head_dim=3)
    return DecodeCore(FakeRunner(cache), blocks, cache, max_batch=8, **kw)


def _first_turn(core: DecodeCore, max_new: int, key: str = "k") -> Sequence:
    """A sequence on a seeded compact cache, decoded to its end."""
    blocks = core.blocks.allocate(LENGTHS, 0)
    g = torch.Generator().manual_seed(0)
    for table, n in zip(blocks.tables, LENGTHS, strict=True):
        core.cache.write(
            table, torch.randint(0, 9, (2, n, 3), generator=g).float(), torch.randn(2, n, 3, generator=g)
        )
    seq = Sequence("r1", blocks, list(LENGTHS), PROMPT, 3, SamplingConfig(max_new_tokens=max_new))
    seq.usage.prompt_tokens = PROMPT
    seq.retain_key = key
    core.add(seq)
    _drain(core)
    return seq


def _drain(core: DecodeCore) -> None:
    while core.has_work:
        core.step()


def _continue(core: DecodeCore, key: str, keep: int, forced: list[int], max_new: int) -> Sequence:
    entry = core.retained.take(key)
    assert entry is not None
    seq = continued_sequence(
        entry,
        core.blocks,
        request_id="r2",
        keep_positions=keep,
        input_ids=forced,
        sampling=SamplingConfig(max_new_tokens=max_new),
        prompt_tokens=keep + len(forced),
        continued_tokens=len(forced),
        detok=None,
        token_bytes=core.cache.token_bytes,
        full_token_bytes=core.cache.token_bytes,
    )
    core.add(seq)
    _drain(core)
    return seq


@pytest.mark.parametrize("drop", [0, 2, 5])
def test_a_turn_on_the_kept_cache_decodes_as_the_sequence_would_have_gone_on(drop):
    whole = _core()
    straight = _first_turn(whole, 6 + 5, key="")  # never stopped
    assert whole.blocks.num_free == whole.blocks.num_blocks and len(whole.retained) == 0

    core = _core()
    first = _first_turn(core, 6)
    positions = PROMPT + len(first.generated) - 1  # every token but the last went in
    assert first.retained_positions == positions and len(core.retained) == 1
    assert core.retained.held == first_blocks(core) > 0  # kept, not freed
    assert core.blocks.num_free + core.retained.held == core.blocks.num_blocks
    assert first.generated == straight.generated[:6]
    # the next turn's prompt: the positions it keeps, then the rest fed again (the answer's last tokens)
    forced = first.generated[len(first.generated) - 1 - drop :]
    second = _continue(core, "k", positions - drop, forced, 5)
    assert second.generated[len(forced) :] == straight.generated[6:]
    assert second.produced == 5 and second.usage.generated_tokens == 5
    assert second.usage.continued_on == "decode" and second.usage.prompt_tokens == positions - drop + len(
        forced
    )
    assert list(second.usage.layer_budgets) == [n + len(first.generated) for n in LENGTHS]  # the last in too


def first_blocks(core: DecodeCore) -> int:
    return core.blocks.num_blocks - core.blocks.num_free


def test_kept_blocks_are_room_that_admission_and_growth_take_back():
    core = _core(num_blocks=10)
    _first_turn(core, 6)  # 4 + 3 blocks kept
    held = core.retained.held
    assert held == 7 and core.blocks.admit_room() == 10
    assert core.blocks.refusal([30, 2], 0) is None  # 8 + 1 blocks: fits only with the kept ones back
    got = core.blocks.allocate([30, 2], 0)
    assert got is not None and len(core.retained) == 0 and core.retained.given_back == 1
    assert core.retained.take("k") is None
    core.blocks.free(got)
    assert core.blocks.num_free == 10


def test_a_room_check_that_cannot_succeed_gives_back_nothing():
    core = _core(num_blocks=10)
    _first_turn(core, 6)
    assert core.blocks.allocate([40, 40], 0) is None  # 20 blocks: more than free and idle together
    assert len(core.retained) == 1 and core.retained.given_back == 0


def test_the_least_recently_kept_go_back_first_and_the_count_is_bounded():
    core = _core()
    core.retained.max_entries = 2
    for key in ("a", "b", "c"):
        _first_turn(core, 3, key=key)
    assert len(core.retained) == 2 and core.retained.take("a") is None  # the oldest went over the bound
    core.retained.release(1)
    assert core.retained.take("b") is None and core.retained.take("c") is not None


@pytest.mark.parametrize("case", ["cancelled", "no key", "reserve pool", "sliding windows", "re-compression"])
def test_what_must_not_be_kept_is_freed(case):
    policy = AdmissionPolicy(reserve=True) if case == "reserve pool" else None
    core = _core(policy=policy, decode_budget=0.5 if case == "re-compression" else 0.0)
    if case == "sliding windows":  # their rings drop positions
        core.retained = RetainedCaches(BlockManager(8, 4, windows=(4, 0)))
    if case in ("sliding windows", "re-compression"):
        assert not core.retained.enabled
        return
    if case == "cancelled":
        blocks = core.blocks.allocate(LENGTHS, 0)
        seq = Sequence("r", blocks, list(LENGTHS), PROMPT, 3, SamplingConfig(max_new_tokens=8))
        seq.retain_key = "k"
        core.add(seq)
        core.step()
        core.end(seq, FinishReason.CANCELLED)
    else:
        _first_turn(core, 4, key="" if case == "no key" else "k")
    assert len(core.retained) == 0 and core.blocks.num_free == core.blocks.num_blocks


def test_a_turn_that_does_not_fit_the_kept_cache_is_refused_and_its_blocks_freed():
    core = _core()
    first = _first_turn(core, 6)
    positions = first.retained_positions
    for keep, forced, total in (
        (PROMPT - 1, [1], PROMPT),  # would drop a compressed prompt position
        (positions + 1, [1], positions + 2),  # more positions than it holds
        (positions, [], positions),  # nothing to feed
        (positions, [1, 2], positions + 5),  # the prompt does not add up
    ):
        _first_turn(core, 6) if not len(core.retained) else None
        entry = core.retained.take("k")
        with pytest.raises(VlkvError) as err:
            continued_sequence(
                entry,
                core.blocks,
                request_id="x",
                keep_positions=keep,
                input_ids=forced,
                sampling=SamplingConfig(),
                prompt_tokens=total,
                continued_tokens=1,
                detok=None,
                token_bytes=1,
                full_token_bytes=1,
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert core.blocks.num_free == core.blocks.num_blocks


def test_a_turn_that_could_never_finish_in_the_pool_is_refused_and_its_blocks_freed():
    core = _core(num_blocks=16)
    first = _first_turn(core, 6)
    entry = core.retained.take("k")
    with pytest.raises(VlkvError) as err:  # 60 new tokens a layer: 4 x 16 blocks, the pool has 16
        continued_sequence(
            entry,
            core.blocks,
            request_id="x",
            keep_positions=first.retained_positions,
            input_ids=[1],
            sampling=SamplingConfig(max_new_tokens=60),
            prompt_tokens=first.retained_positions + 1,
            continued_tokens=1,
            detok=None,
            token_bytes=1,
            full_token_bytes=1,
        )
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "outgrows" in err.value.message
    assert core.blocks.num_free == core.blocks.num_blocks
