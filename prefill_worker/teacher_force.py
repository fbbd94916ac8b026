"""Teacher forcing of one prompt's compressed caches in a single forward (the verifier's candidates,
``verifier.py``, and ``vlkv calibrate``'s).

The decode core feeds one token per step (``InProcessEngine.teacher_force``): for N forced tokens, N
steps, each gathering every cache's paged blocks again. The forced tokens are known in advance (the full
cache's greedy answer), so here all of them run in one forward through the same layers as the decode
step (``decode_worker/model_runner.py``: embeddings, rotary positions continuing from the prompt's
length, each layer with the ``vlkv_decode`` attention hook, the final norm, the LM head): per layer the
caches' kept K/V, padded to the longest of their length group with a mask of the real entries, and the
forced tokens' own K/V,
each forced token attending to its cache's kept positions and, causally, to the forced tokens up to its
own. That is the decode step's arithmetic on the same inputs (the softmax over the same keys), in one
batched matmul instead of N; only the order of floating-point sums differs.

``forced_logprobs`` yields, per cache, the log-softmax of the next-token logits after each forced token;
``agreement`` scores them against the full cache's own tokens and log-probabilities.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.forced import ForcedAttention, forced_hidden, model_windows


@torch.inference_mode()
def forced_logprobs(
    model, caches: list[CompactKV], tokens: list[list[int]], rows_per_head: int = 16, groups: int = 4
) -> Iterator[tuple[int, torch.Tensor]]:
    """Per cache ``i``, ``(i, logq)``: ``logq`` ``[len(tokens[i]), vocab]`` fp32, row ``g`` the log-softmax of
    the next-token logits after feeding ``tokens[i][: g + 1]`` over cache ``i`` (token 0 at position
    ``prompt_length``, as the decode core feeds the prefill's token). The LM head runs ``rows_per_head``
    caches at a time; ``groups``: ``ForcedAttention``'s length groups per layer (the same distributions with any)."""
    hidden = forced_hidden(model, caches, tokens, ForcedAttention(caches, groups, model_windows(model)))
    for at in range(0, len(caches), rows_per_head):
        logq = torch.log_softmax(model.lm_head(hidden[at : at + rows_per_head]).float(), -1)
        for r in range(logq.shape[0]):
            yield at + r, logq[r, : len(tokens[at + r])]


def agreement(
    model, caches: list[CompactKV], inputs: list[int], targets: list[int], ref_logp: torch.Tensor
) -> list[tuple[float, float]]:
    """Per cache ``(agreement, mean KL)``: ``inputs`` teacher-forced through it, ``targets[g]`` the full
    cache's greedy token after ``inputs[: g + 1]`` and ``ref_logp[g]`` (``[vocab]`` fp32) its log-softmax there.
    Agreement is the share of positions whose greedy token under the compressed cache is the full cache's,
    KL the mean ``KL(p_full || p_compressed)``; ``(1.0, 0.0)`` for every cache when there is nothing to force."""
    if not inputs or not caches:
        return [(1.0, 0.0)] * len(caches)
    target = torch.tensor(targets, device=ref_logp.device)
    out = [(1.0, 0.0)] * len(caches)
    for c, logq in forced_logprobs(model, caches, [list(inputs)] * len(caches)):
        logq = logq.to(ref_logp.device)
        agree = float((logq.argmax(-1) == target).float().mean())
        kl = float((ref_logp.exp() * (ref_logp - logq)).sum(-1).mean())
        out[c] = (agree, kl)
    return out
