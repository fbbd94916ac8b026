"""Greedy decoding of many compressed caches of one prompt at once, each with its own kept positions.

The caches of one prompt (every press x budget of one mode) are stacked into one batch: per layer the
full prefill's K/V gathered at each row's kept positions, padded to the layer's longest row, with a
boolean ``[B, H_kv, L]`` mask of the real entries. Presses keep different numbers of positions per layer
(PyramidKV) and per KV head (AdaKV, CriticalAdaKV), so the mask is per layer, row and head; a registered
attention function (``MASKED_ATTENTION``) applies it, as kvpress's own decoding patch does for AdaKV
(which instead overwrites masked keys with a key whose attention underflows to zero). Tokens appended
after the compressed prefix (the question in ``context`` mode, the answer) are always visible, causally.
Kept keys keep their RoPE positions; new tokens continue from the prompt's length, as kvpress's pipeline
does (``position_ids = arange(context_length, ...)``).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.models.llama.modeling_llama import repeat_kv
from vlkv.common.model.cache_kwarg import cache_arg

MASKED_ATTENTION = "vlkv_kvpress_masked"


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention over a padded compressed prefix: ``module.kvpress_keep`` ``[B, H_kv, L0]``."""
    keep = module.kvpress_keep
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    l0 = keep.shape[-1]
    new = torch.ones(q_len, kv_len - l0, dtype=torch.bool).tril(kv_len - l0 - q_len)
    allowed = torch.cat(
        [keep[:, :, None, :].expand(-1, -1, q_len, -1), new.expand(b, keep.shape[1], -1, -1)], dim=-1
    )
    allowed = allowed.repeat_interleave(module.num_key_value_groups, dim=1)  # [B, H, q, kv]
    k = repeat_kv(key, module.num_key_value_groups)
    v = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), None


AttentionInterface.register(MASKED_ATTENTION, _masked_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(MASKED_ATTENTION, sdpa_mask)  # unused: the function builds its own


def stack_caches(keys: list[torch.Tensor], values: list[torch.Tensor], rows: list[list[torch.Tensor]]):
    """Per layer the padded ``[B, H_kv, L, D]`` K and V and the ``[B, H_kv, L]`` mask of ``rows``
    (per row, per layer a kept mask ``[H_kv, n]`` over the first n positions of ``keys[l]`` ``[H_kv, m, D]``)."""
    out = []
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        masks = [r[layer] for r in rows]
        h, n = masks[0].shape
        length = max(int(m.sum(-1).max()) for m in masks)
        kk = k.new_zeros(len(rows), h, length, k.shape[-1])
        vv = torch.zeros_like(kk)
        keep = torch.zeros(len(rows), h, length, dtype=torch.bool)
        for i, m in enumerate(masks):
            for head in range(h):
                idx = m[head].nonzero().flatten()
                kk[i, head, : len(idx)] = k[head, :n][idx]
                vv[i, head, : len(idx)] = v[head, :n][idx]
                keep[i, head, : len(idx)] = True
        out.append((kk, vv, keep))
    return out


@torch.inference_mode()
def greedy(model, stacked, first_ids: torch.Tensor, start: int, max_new_tokens: int, eos: set[int]):
    """Decode every row of ``stacked`` (``stack_caches``) greedily.

    first_ids: ``[B, q]`` the tokens to run first (the question in ``context`` mode, whose last logits give
    the first answer token; in ``prompt`` mode ``[B, 1]`` the prefill's first token, already an answer
    token). start: the position of ``first_ids[:, 0]``. Returns per row the answer's token ids."""
    b, q = first_ids.shape
    cache = DynamicCache(config=model.config)
    layers = model.model.layers
    for i, (kk, vv, keep) in enumerate(stacked):
        cache.update(kk, vv, i)
        layers[i].self_attn.kvpress_keep = keep
    saved = model.config._attn_implementation
    model.config._attn_implementation = MASKED_ATTENTION
    try:
        answers = [[] for _ in range(b)] if q > 1 else [[int(t)] for t in first_ids[:, 0]]
        done = torch.zeros(b, dtype=torch.bool) if q > 1 else _ended(answers, eos)
        ids, pos, steps = first_ids, start, len(answers[0])
        while not bool(done.all()) and steps < max_new_tokens:
            positions = torch.arange(pos, pos + ids.shape[1]).expand(b, -1)
            logits = model(
                input_ids=ids,
                position_ids=positions,
                **cache_arg(model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
            nxt = logits.logits[:, -1].argmax(-1)
            pos += ids.shape[1]
            for r in range(b):
                if not done[r]:
                    answers[r].append(int(nxt[r]))
            done = _ended(answers, eos)
            ids, steps = nxt[:, None], steps + 1
    finally:
        model.config._attn_implementation = saved
        for layer in layers:
            layer.self_attn.kvpress_keep = None
    return answers


def _ended(answers: list[list[int]], eos: set[int]) -> torch.Tensor:
    return torch.tensor([bool(a) and a[-1] in eos for a in answers])
