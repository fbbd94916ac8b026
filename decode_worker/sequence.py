"""One request on the decode worker, from its cache's arrival to its last token: ``Sequence``.

Its state is one ``SequenceStatus``; the finished ones carry their reason::

    WAITING_FOR_KV --(cache whole in its blocks: the receiver's arrive)--> WAITING
    WAITING --(joins the batch)--> RUNNING <--(preempted / resumed)--> SWAPPED
    any --> FINISHED_STOP | FINISHED_EOS | FINISHED_LENGTH | FINISHED_CANCELLED | FINISHED_ERROR

The receiver (``admission.py``) builds a sequence when its header is admitted (blocks taken, K/V still
arriving), the decode core (``core.py``) moves it through the batch and finishes it (stop rules, faults),
and whoever drives the core (``engine.py`` for the server, ``deploy/inprocess.py``) streams what it
produced. ``generated`` starts as ``[first_token]`` (the prefill's token); each step feeds ``generated[-1]``
at position ``prompt_length + len(generated) - 1`` and appends the sampled token.

A follow-up turn decoded on a kept cache (``retention.py``) has ``forced``: the rest of its prompt, which
``generated`` starts with and which its first steps feed (the sampled token is dropped until the last of them
went in); only the tokens after them are produced, streamed and counted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from vlkv.common.errors import VlkvError
from vlkv.common.sampling import SamplingConfig, make_generator
from vlkv.decode_worker.block_manager import SequenceBlocks
from vlkv.decode_worker.detokenizer import IncrementalText
from vlkv.v1 import generate_pb2


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop string
    EOS = "eos"
    LENGTH = "length"  # max_new_tokens
    CANCELLED = "cancelled"  # its caller went away
    ERROR = "error"  # ``Sequence.error`` says why


class SequenceStatus(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"  # admitted: its blocks are taken, its K/V are landing in them
    WAITING = "waiting"  # its cache is whole in the pool; queued for the batch
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted: its K/V in host memory until blocks free
    FINISHED_STOP = "stop"
    FINISHED_EOS = "eos"
    FINISHED_LENGTH = "length"
    FINISHED_CANCELLED = "cancelled"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in _REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASONS.get(self.value)

    @staticmethod
    def finished_with(reason: FinishReason) -> SequenceStatus:
        return SequenceStatus(reason.value)


_REASONS = {r.value: r for r in FinishReason}

# The wire's reasons (``Finished.reason``); a cancelled or failed sequence ends its stream with a status.
FINISH_REASON_PROTO = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
}


def kv_usage(
    lengths: list[int], prompt_length: int, token_bytes: int, full_token_bytes: int, **fields
) -> generate_pb2.Usage:
    """A sequence's usage on arrival: its kept tokens per layer (``lengths``) in bytes of the pool's kv dtype
    (``token_bytes``, scales included), the full cache of ``prompt_length`` tokens in the model's dtype
    (``full_token_bytes`` a token and layer), the realized ratio and per-layer budgets, plus ``fields``."""
    kept, layers = sum(lengths), len(lengths)
    return generate_pb2.Usage(
        kv_bytes_kept=kept * token_bytes,
        kv_bytes_full=layers * prompt_length * full_token_bytes,
        compression_ratio=kept / (layers * prompt_length),
        layer_budgets=lengths,
        **fields,
    )


@dataclass(eq=False)
class Sequence:
    """One sequence: its blocks, per layer cached lengths, the tokens so far, its status and usage."""

    request_id: str
    blocks: SequenceBlocks
    lengths: list[int]  # per layer cached tokens (a sliding layer: those its ring still holds)
    prompt_length: int  # m: the first decode position
    first_token: int
    sampling: SamplingConfig
    eos_token_ids: frozenset[int] = frozenset()
    detok: IncrementalText | None = None  # text and stop strings; None: token ids only
    usage: generate_pb2.Usage = field(default_factory=generate_pb2.Usage)
    status: SequenceStatus = SequenceStatus.WAITING
    error: VlkvError | None = None  # why, when FINISHED_ERROR
    generated: list[int] = field(init=False)  # [first_token, sampled tokens...]
    arrival: int = field(default=0, init=False)  # set by the scheduler
    host_kv: list[tuple[torch.Tensor, ...]] | None = field(default=None, init=False)  # swapped out
    prompt_lengths: list[int] = field(init=False)  # per layer cached tokens on arrival (re-compression)
    attn_mass: torch.Tensor | None = field(default=None, init=False)  # [L, T] accumulated (re-compression)
    evicted: int = field(default=0, init=False)  # tokens dropped by re-compression, all layers
    slid: int = field(default=0, init=False)  # tokens sliding layers' rings dropped, all layers
    retain_key: str = field(default="", init=False)  # keep the cache under this key when it finishes
    retained_positions: int = field(default=0, init=False)  # > 0: it was kept, holding these positions
    forced: list[int] = field(default_factory=list, init=False)  # prompt tokens fed before any is sampled
    full_from: int = field(default=0, init=False)  # every position from here on is cached in every layer

    def __post_init__(self) -> None:
        self.generated = [self.first_token]
        self.full_from = self.prompt_length
        self.prompt_lengths = list(self.lengths)
        self.generator = None if self.sampling.greedy else make_generator(self.sampling.seed + 1)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def produced(self) -> int:
        """Tokens this sequence generated (``generated`` past its ``forced`` prompt tokens)."""
        return len(self.generated) - len(self.forced)

    @property
    def feeding(self) -> bool:
        """Whether its next step still feeds a prompt token (``forced``) rather than a sampled one."""
        return len(self.generated) < len(self.forced)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def finish(self, reason: FinishReason, error: VlkvError | None = None) -> None:
        """Set the final status (once: a finished sequence stays as it finished)."""
        if self.finished:
            return
        self.status = SequenceStatus.finished_with(reason)
        self.error = error
        self.usage.generated_tokens = max(0, self.produced)

    def stop_reason(self, token: int) -> FinishReason | None:
        """The stop rules for ``token``, already the last of ``generated`` and already given to
        ``detok`` unless it is an EOS: EOS, then a stop string, then ``max_new_tokens``."""
        if token in self.eos_token_ids:
            return FinishReason.EOS
        if self.detok is not None and self.detok.stopped:
            return FinishReason.STOP
        if self.produced >= self.sampling.max_new_tokens:
            return FinishReason.LENGTH
        return None
