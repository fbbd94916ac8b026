"""Teacher forcing of one prompt's compressed caches in a single forward (``vlkv calibrate``'s candidates).

The decode core feeds one token per step (``InProcessEngine.teacher_force``): for N forced tokens, N
steps, each gathering every cache's paged blocks again. The forced tokens are known in advance (the full
cache's greedy answer), so here all of them run in one forward through the same layers as the decode
step (``decode_worker/model_runner.py``: embeddings, rotary positions continuing from the prompt's
length, each layer with the ``vlkv_decode`` attention hook, the final norm, the LM head): per layer the
caches' kept K/V, padded to the longest with a mask of the real entries, and the forced tokens' own K/V,
each forced token attending to its cache's kept positions and, causally, to the forced tokens up to its
own. That is the decode step's arithmetic on the same inputs (the softmax over the same keys), in one
batched matmul instead of N; only the order of floating-point sums differs.

``forced_logprobs`` yields, per cache, the log-softmax of the next-token logits after each forced token.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.loading import language_model


class _Forced:
    """The ``vlkv_decode`` object of one forward: ``update`` keeps the forced tokens' K/V, ``attend``
    attends over the kept prefix (masked) and the forced tokens (causal)."""

    def __init__(self, caches: list[CompactKV]) -> None:
        self.prefix = []
        for layer in range(len(caches[0].keys)):
            ks = [c.keys[layer] for c in caches]
            h, _, d = ks[0].shape
            length = max(k.shape[1] for k in ks)
            kk = ks[0].new_zeros(len(caches), h, length, d)
            vv = torch.zeros_like(kk)
            keep = torch.zeros(len(caches), length, dtype=torch.bool)
            for i, c in enumerate(caches):
                n = c.keys[layer].shape[1]
                kk[i, :, :n], vv[i, :, :n], keep[i, :n] = c.keys[layer], c.values[layer], True
            self.prefix.append((kk, vv, keep))
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key, value)
        return key, value

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query ``[B, H, T, D]`` -> output ``[B, T, H, D]``."""
        k0, v0, keep = self.prefix[layer_idx]
        kn, vn = self.new.pop(layer_idx)
        b, h, t, _ = query.shape
        group = h // k0.shape[1]
        # fp32 throughout, as the decode step's paged attention computes (new K/V rounded to the pool's dtype)
        k = torch.cat([k0, kn.to(k0.dtype)], 2).float().repeat_interleave(group, 1)
        v = torch.cat([v0, vn.to(v0.dtype)], 2).float().repeat_interleave(group, 1)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = torch.cat([keep[:, None, :].expand(-1, t, -1), causal.expand(b, -1, -1)], -1)
        scores = torch.matmul(query.float() * scaling, k.transpose(2, 3))
        scores.masked_fill_(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).to(query.dtype).transpose(1, 2)


@torch.inference_mode()
def forced_logprobs(
    model, caches: list[CompactKV], tokens: list[list[int]], rows_per_head: int = 16
) -> Iterator[tuple[int, torch.Tensor]]:
    """Per cache ``i``, ``(i, logq)``: ``logq`` ``[len(tokens[i]), vocab]`` fp32, row ``g`` the log-softmax of
    the next-token logits after feeding ``tokens[i][: g + 1]`` over cache ``i`` (token 0 at position
    ``prompt_length``, as the decode core feeds the prefill's token). The LM head runs ``rows_per_head``
    caches at a time."""
    lm = language_model(model)
    t = max(len(x) for x in tokens)
    ids = torch.tensor([x + [x[-1]] * (t - len(x)) for x in tokens])  # padding after a row's end is unseen
    positions = torch.tensor([c.prompt_length for c in caches])[:, None] + torch.arange(t)
    forced = _Forced(caches)
    hidden = lm.embed_tokens(ids)
    layers = lm.layers[: len(caches[0].keys)]
    step = {  # what the decode step passes every layer, with this forward's object as cache and hook
        "attention_mask": None,
        "position_ids": positions,
        "position_embeddings": lm.rotary_emb(hidden, position_ids=positions),
        "use_cache": True,
        "vlkv_decode": forced,
        **cache_arg(layers[0], forced),
    }
    for layer in layers:
        hidden = layer(hidden, **step)
    hidden = lm.norm(hidden)
    for at in range(0, len(caches), rows_per_head):
        logq = torch.log_softmax(model.lm_head(hidden[at : at + rows_per_head]).float(), -1)
        for r in range(logq.shape[0]):
            yield at + r, logq[r, : len(tokens[at + r])]
