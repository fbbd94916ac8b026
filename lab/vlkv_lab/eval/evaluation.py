"""Accuracy of the compression path on the default model's held-out split (``vlkv eval``).

Each example is prefilled once by the prefill worker's forward (``PrefillEngine.forward``, whose observer
records every layer's post-RoPE Q and K on the way); each (policy, budget) then computes its own statistics
from those with the attention-statistics kernel, compresses the cache exactly as the prefill worker does,
and decodes all examples as one batch through the in-process engine (``deploy/inprocess.py``: the decode
worker's paged pool and decode core). The answer's deciding word
comes several tokens after the first, so it is read from decode steps over the compressed cache.

It also measures CacheHitRate (paper section 3.2): per layer, the share of the true top-k tokens of the
first decoding token's attention (over the full cache) that a scoring policy's top-k keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from vlkv.common.compression.registry import get_policy
from vlkv.common.config import DEFAULT_PROMPT_WEIGHT
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import blocks_needed
from vlkv.decode_worker.kv_cache import block_bytes_of
from vlkv.deploy.calibrate.prepared import (  # noqa: F401  (the lab evaluation's names)
    BLOCK_SIZE,
    EVAL_NEW_TOKENS,
    Prepared,
    compress,
    compress_with,
    policy_stats,
    prepare,
)
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.synthetic_task import MAX_NEW_TOKENS


def decode_batch(
    model,
    caches: list[CompactKV],
    max_new_tokens: int,
    eos: set[int],
    *,
    kv_dtype: str = "fp16",
    decode_budget: float = 0.0,
    decode_window: int = 32,
    prompt_weight: float = DEFAULT_PROMPT_WEIGHT,
    min_new_tokens: int = 0,
    stats: dict | None = None,
    batch_invariant: bool = False,
) -> list[list[int]]:
    """Greedy decode of all caches together as one batch through the in-process engine's paged pool and
    decode core; per cache the prefill's token and up to ``max_new_tokens - 1`` more, ending at an EOS.

    ``kv_dtype``/``decode_budget``/``decode_window``/``prompt_weight``: the deployment options
    (``--kv-dtype``, ``--decode-budget``, ``--decode-window``, ``--prompt-weight``). ``min_new_tokens``: long answers: EOS does not end a sequence
    before this many tokens (every sequence decodes ``max(max_new_tokens, min_new_tokens)`` steps, its
    answer is cut at its first EOS from then on), so decode-phase re-compression acts while it answers.
    ``stats``: filled with ``evicted_tokens`` (by re-compression). ``batch_invariant``: each answer is the one
    it would get decoded alone (``PoolConfig.batch_invariant``, as ``vlkv serve --batch-invariant``)."""
    c0 = caches[0]
    steps = max(max_new_tokens, min_new_tokens)
    need = sum(blocks_needed(c.layer_lengths, steps, BLOCK_SIZE) for c in caches)
    engine = InProcessEngine(
        model,
        pool_bytes=need * block_bytes_of(BLOCK_SIZE, c0.num_kv_heads, c0.head_dim, c0.dtype, kv_dtype),
        block_size=BLOCK_SIZE,
        max_batch=len(caches),
        admission="reserve",  # every cache and its new tokens fit at once: one batch, never preempted
        kv_dtype=kv_dtype,
        decode_budget=decode_budget,
        decode_window=decode_window,
        prompt_weight=prompt_weight,
        batch_invariant=batch_invariant,
    )
    outs = engine.decode_caches(
        caches, SamplingConfig(max_new_tokens=steps), set() if min_new_tokens else eos
    )
    if stats is not None:
        stats["evicted_tokens"] = engine.core.evicted_tokens
    if not min_new_tokens:
        return outs
    cut = []
    for out in outs:
        late = [i for i, t in enumerate(out) if t in eos and i >= min_new_tokens - 1]
        cut.append(out[: late[0] + 1] if late else out)
    return cut


def cache_hit_rate(
    prep: Prepared,
    policy_name: str,
    k_ratio: float,
    threshold: float = 0.01,
    truth: list[torch.Tensor] | None = None,
    **params,
) -> list[float]:
    """Per layer: |policy top-k ∩ true top-k| / k, per KV head (true attention summed over its group).

    truth: per layer ``[H, m]`` attention to rank against; default the first decoding token's
    (``prep.next_attention``, paper section 3.2). params: policy parameters (e.g. ``pool_kernel``).
    """
    policy = get_policy(policy_name, **params)
    stats = policy_stats(prep, policy, min(k_ratio, 0.999), threshold)  # the scores at a compressing budget
    k = max(1, math.ceil(k_ratio * prep.m))
    rates = []
    for layer, (keys, values) in enumerate(zip(prep.keys, prep.values, strict=True)):
        scores = policy.score(layer, None if stats is None else stats[layer], keys, values, prep.m, prep.tau)
        att = (prep.next_attention if truth is None else truth)[layer]
        true = att.view(keys.shape[0], -1, prep.m).sum(1)  # [H_kv, m]
        hit = 0.0
        for h in range(keys.shape[0]):
            mine = set(scores[h].float().topk(k).indices.tolist())
            best = set(true[h].topk(k).indices.tolist())
            hit += len(mine & best) / k
        rates.append(hit / keys.shape[0])
    return rates


@dataclass
class EvalResult:
    policy: str
    budget: float
    accuracy: float
    ratio: float
    layer_budget_share: list[float]  # mean k_l / m per layer
    answers: list[str] = field(repr=False, default_factory=list)
    mean_generated: float = 0.0  # tokens per answer, the prefill's included
    evicted_tokens: int = 0  # dropped by decode-phase re-compression, all sequences and layers


def evaluate(
    model,
    processor,
    prepared: list[Prepared],
    policy: str,
    budget: float,
    max_new_tokens: int = MAX_NEW_TOKENS,
    threshold: float = 0.01,
    decode: dict | None = None,
    **params,
):
    """Accuracy of ``policy`` at ``budget``; params go to ``get_policy`` (``allocator``, ``recent_ratio``...),
    ``decode`` to ``decode_batch`` (``kv_dtype``, ``decode_budget``, ``min_new_tokens``...)."""
    caches = [compress(p, policy, budget, threshold, **params) for p in prepared]
    return evaluate_caches(model, processor, prepared, caches, policy, budget, max_new_tokens, decode)


def evaluate_caches(
    model,
    processor,
    prepared: list[Prepared],
    caches: list[CompactKV],
    policy: str,
    budget: float,
    max_new_tokens: int = MAX_NEW_TOKENS,
    decode: dict | None = None,
) -> EvalResult:
    """Decode already compressed caches (one per prepared example) and score the answers."""
    eos = {processor.tokenizer.eos_token_id}
    stats: dict = {}
    outs = decode_batch(model, caches, max_new_tokens, eos, stats=stats, **(decode or {}))
    texts = [processor.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    acc = sum(p.task.is_correct(t, p.example) for t, p in zip(texts, prepared, strict=True)) / len(prepared)
    layers = len(caches[0].keys)
    share = [sum(c.layer_lengths[li] / c.prompt_length for c in caches) / len(caches) for li in range(layers)]
    ratio = sum(c.compression_ratio for c in caches) / len(caches)
    lengths = sum(len(o) for o in outs) / len(outs)
    return EvalResult(policy, budget, acc, ratio, share, texts, lengths, stats.get("evicted_tokens", 0))
