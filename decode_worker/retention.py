"""Finished sequences a decode worker keeps for a conversation's next turn, and the turn decoded on one.

A ``Decode`` call with a ``retain_key`` (a ``continue`` turn, unverified) asks the worker to keep the
sequence's cache when it finishes: its blocks stay as they are, idle, under that key (``RetainedCaches``).
The cache then holds the turn's compact prompt and every token it decoded but the last (a token enters the
cache when the next step feeds it), at positions ``0 .. positions-1``; from ``full_from`` (the first turn's
prompt length) on, every position is there in every layer, so those can be dropped from the end.

The next turn's ``Decode`` names the key in ``continue_from``: ``continued_sequence`` takes the entry, drops
its positions from ``keep_positions`` on (where the new prompt stops agreeing with what the cache holds: the
chat template may render the answer otherwise than it was sampled), and builds a sequence holding the rest of
the new prompt (``Sequence.forced``). ``DecodeCore.feed`` runs those tokens over the kept cache in one forward
(``common/model/forced.append_tokens``, the prefill worker's continuation pass) and samples the first token; in
a quantized pool (or with no room for them at once) the sequence's first steps feed them one at a time instead.
Nothing is prefilled on a prefill worker or handed off.

Bounds: the pool itself. Kept blocks are idle (``BlockManager.idle``): an admission, a resume or a step's
growth that needs them takes them back, least recently kept first, so keeping never refuses a request nor
preempts one; and at most ``max_entries`` are kept. Not kept: a cancelled or failed sequence, a pool that
reserves new tokens at admission, sliding-window layers (their rings drop positions) and decode-phase
re-compression (it drops them too).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import grpc
from vlkv.common.errors import VlkvError
from vlkv.common.reuse import RETAINED_KEY
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import BlockManager, RefusalKind, SequenceBlocks
from vlkv.decode_worker.detokenizer import IncrementalText
from vlkv.decode_worker.sequence import FinishReason, Sequence, SequenceStatus, kv_usage

__all__ = ["RETAINED_KEY", "Retained", "RetainedCaches", "continued_sequence"]
MAX_RETAINED = 1024  # kept caches a worker holds at most (their blocks are bounded by the pool)
_KEPT_REASONS = (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH)


@dataclass
class Retained:
    """One kept cache: its blocks and per-layer lengths, the positions it holds, and what its usage needs."""

    key: str
    blocks: SequenceBlocks
    lengths: list[int]
    positions: int  # positions 0 .. positions-1 are in the cache
    full_from: int  # every position from here on is in every layer (the first turn's prompt length)
    prompt_tokens: int  # the turn's prompt
    eos_token_ids: frozenset[int]
    policy: str
    vision_tokens: int


class RetainedCaches:
    """Kept caches by key, least recently kept first; the pool's ``idle`` holder (``block_manager.py``)."""

    def __init__(self, blocks: BlockManager, max_entries: int = MAX_RETAINED, enabled: bool = True) -> None:
        self.blocks = blocks
        self.max_entries = max_entries
        self.enabled = enabled and not blocks.windows and not blocks.policy.reserve
        self._entries: OrderedDict[str, Retained] = OrderedDict()
        self._held = 0
        self.kept = 0  # since start
        self.continued = 0
        self.given_back = 0  # entries whose blocks went back to the pool unused
        blocks.idle = self

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held(self) -> int:
        return self._held

    def keeps(self, seq: Sequence) -> bool:
        """Whether ``seq``, finishing now, is kept (asked to be, and a kind of cache this pool can keep)."""
        return (
            self.enabled
            and bool(seq.retain_key)
            and seq.finish_reason in _KEPT_REASONS
            and seq.host_kv is None
            and seq.blocks.num_blocks > 0
            and seq.evicted == 0
            and seq.slid == 0
        )

    def keep(self, seq: Sequence) -> None:
        """Take ``seq``'s blocks (it finished; ``keeps`` said so) under its key; its ``retained_positions``
        say what it holds."""
        positions = seq.prompt_length + len(seq.generated) - 1
        entry = Retained(
            seq.retain_key,
            seq.blocks,  # the blocks are the entry's now
            list(seq.lengths),
            positions,
            min(seq.full_from, seq.prompt_length),
            seq.usage.prompt_tokens,
            seq.eos_token_ids,
            seq.usage.policy,
            seq.usage.vision_tokens,
        )
        seq.blocks = SequenceBlocks([[] for _ in entry.blocks.tables])
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self._give_back(old)
        self._entries[entry.key] = entry
        self._held += entry.blocks.num_blocks
        seq.retained_positions = positions
        self.kept += 1
        while len(self._entries) > self.max_entries:
            self._give_back(self._entries.popitem(last=False)[1])

    def take(self, key: str) -> Retained | None:
        """The entry kept under ``key``, no longer kept (its blocks are the caller's), or None."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._held -= entry.blocks.num_blocks
        return entry

    def release(self, need: int) -> int:
        """Give back the least recently kept entries' blocks until ``need`` went back (or none is left)."""
        freed = 0
        while freed < need and self._entries:
            entry = self._entries.popitem(last=False)[1]
            freed += entry.blocks.num_blocks
            self._give_back(entry)
        return freed

    def clear(self) -> None:
        self.release(self._held + 1)

    def _give_back(self, entry: Retained) -> None:
        self._held -= entry.blocks.num_blocks
        self.given_back += 1
        self.blocks.free(entry.blocks)


def continued_sequence(
    entry: Retained,
    blocks: BlockManager,
    *,
    request_id: str,
    keep_positions: int,
    input_ids: list[int],
    sampling: SamplingConfig,
    prompt_tokens: int,
    continued_tokens: int,
    detok: IncrementalText | None,
    token_bytes: int,
    full_token_bytes: int,
) -> Sequence:
    """A follow-up turn's sequence on ``entry`` (taken: its blocks are the sequence's now, or back in the
    pool if this raises): positions from ``keep_positions`` on dropped, ``input_ids`` to feed before the
    first sampled token. VlkvError: INVALID_ARGUMENT for positions the cache cannot drop or a prompt that
    does not add up; FAILED_PRECONDITION for a turn that could never finish in this pool (its new tokens and
    ``max_new_tokens`` outgrow the whole of it: the caller serves it the usual way). ``token_bytes``: one cached token of one layer in the pool; ``full_token_bytes``: the
    same in the model's dtype (the usage's full-cache bytes)."""
    drop = entry.positions - keep_positions
    problem = ""
    if not input_ids:
        problem = "a continued turn needs at least one new prompt token"
    elif not entry.full_from <= keep_positions <= entry.positions:
        problem = (
            f"keep_positions {keep_positions} is outside the kept cache's droppable range "
            f"[{entry.full_from}, {entry.positions}]"
        )
    elif prompt_tokens != keep_positions + len(input_ids):
        problem = f"prompt_tokens {prompt_tokens} is not keep_positions + len(input_ids)"
    elif any(n < drop for n in entry.lengths):
        problem = "the kept cache holds fewer positions than it says"
    if problem:
        blocks.free(entry.blocks)
        raise VlkvError(problem, grpc.StatusCode.INVALID_ARGUMENT)
    lengths = [n - drop for n in entry.lengths]
    seq_blocks = entry.blocks
    for layer, n in enumerate(lengths):
        blocks.shrink(seq_blocks, layer, n)
    f = len(input_ids)
    usage = kv_usage(
        [n + f for n in lengths],  # the new tokens are kept whole, as the prefill worker's continuation
        prompt_tokens,
        token_bytes,
        full_token_bytes,
        prompt_tokens=prompt_tokens,
        vision_tokens=entry.vision_tokens,
        policy=entry.policy,
        continued_tokens=continued_tokens,
        cached_prompt_tokens=keep_positions,
        continued_on="decode",
    )
    seq = Sequence(
        request_id=request_id,
        blocks=seq_blocks,
        lengths=lengths,
        prompt_length=keep_positions,
        first_token=input_ids[0],
        sampling=sampling,
        eos_token_ids=entry.eos_token_ids,
        detok=detok,
        usage=usage,
        status=SequenceStatus.WAITING,
    )
    seq.forced = list(input_ids)
    seq.full_from = entry.full_from
    refused = blocks.refusal([n + f for n in lengths], max(1, sampling.max_new_tokens))
    if refused is not None and refused.kind is RefusalKind.NEVER_FITS:  # it could never finish here
        blocks.free(seq_blocks)
        raise VlkvError(
            f"the continued turn outgrows this worker's pool: {refused.message}",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    return seq
