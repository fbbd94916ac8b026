"""The oracle ceiling: keep what the full-cache answer itself attends to most (lab only, never served).

For one prefilled example (``evaluation.Prepared``) and the answer the model gives with the full cache,
``answer_attention`` runs one teacher-forced forward of the answer's tokens over the full prompt cache and
returns, per layer and KV head, the attention those answer rows pay to each prompt token (softmax over the
prompt and the answer so far, summed over the answer rows and over the query heads of the KV group):
``[H_kv, m]``. ``oracle_cache`` keeps, per layer and KV head, the top-``k_l`` tokens of that mass
(``CompactKV`` holds a different selection per KV head, with one ``k_l`` per layer), at given per-layer
budgets: the default policy's (``vlkv eval zoo``'s "oracle at the default's budgets") or the oracle's own
(``mass_budgets``: the same total, spread over layers by answer attention mass). It is a ceiling, not a
policy: it reads the answer before choosing.
"""

from __future__ import annotations

import torch
from vlkv.common.compression.windows import binding_windows, fit_windows
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.prompt_cache import prompt_cache
from vlkv.deploy.calibrate.prepared import EVAL_NEW_TOKENS, Prepared, Recorder


@torch.inference_mode()
def answer_attention(model, prep: Prepared, answer_ids: list[int]) -> list[torch.Tensor]:
    """Per layer ``[H_kv, m]`` float32: the answer rows' attention to the prompt, teacher-forced.

    answer_ids: the full-cache generation as ``decode_batch`` returns it (the prefill's token first); the
    rows that produce the answer's tokens take it and every later token but the last as input, at positions
    ``m, m + 1, ...``."""
    inputs = list(answer_ids[:-1]) if len(answer_ids) > 1 else list(answer_ids)
    keys, values, m = prep.keys, prep.values, prep.m
    cache = prompt_cache(model, keys, values)
    device = keys[0].device
    t = len(inputs)
    rec = Recorder()
    model(
        input_ids=torch.tensor([inputs], device=device),
        **cache_arg(model, cache),
        use_cache=True,
        position_ids=torch.arange(m, m + t, device=device)[None],
        vlkv_stats=rec,
    )
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    mask = torch.cat([torch.ones(t, m, dtype=torch.bool, device=device), causal], dim=1)  # [t, m + t]
    out = []
    for layer in range(len(keys)):
        q, k = rec.q[layer].float(), rec.k[layer].float()  # [H, t, D], [H_kv, m + t, D]
        group = q.shape[0] // k.shape[0]
        scores = torch.einsum("htd,hnd->htn", q, k.repeat_interleave(group, 0)) * rec.scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)[..., :m]
        out.append(probs.sum(1).view(k.shape[0], group, m).sum(1))
    return out


def mass_budgets(attention: list[torch.Tensor], total: int) -> list[int]:
    """Per-layer budgets summing to exactly ``total`` (each in ``[1, m]``) that cover the most answer mass.

    Each layer's mass is normalised to 1 (its share of the answer's prompt attention, averaged over its KV
    heads, each head's tokens taken best first); the ``total`` slots go to the largest marginal gains over
    all layers, after one slot per layer. The gains fall within a layer, so this maximises the summed
    coverage."""
    layers, m = len(attention), attention[0].shape[-1]
    if not layers <= total <= layers * m:
        raise ValueError(f"total {total} outside [{layers}, {layers * m}]")
    gains = []
    for att in attention:
        sorted_mass = att.float().sort(dim=-1, descending=True).values
        gains.append((sorted_mass / sorted_mass.sum(-1, keepdim=True).clamp_min(1e-30)).mean(0))  # [m]
    rest = torch.stack([g[1:] for g in gains])  # [L, m - 1]: every slot after each layer's first
    take = rest.flatten().topk(total - layers).indices
    extra = torch.bincount(take // max(1, m - 1), minlength=layers) if m > 1 else torch.zeros(layers)
    return [1 + int(e) for e in extra.tolist()]


def oracle_cache(prep: Prepared, attention: list[torch.Tensor], budgets: list[int]) -> CompactKV:
    """Per layer and KV head the ``budgets[l]`` prompt tokens with the most answer attention; a binding
    sliding-window layer keeps its last positions as the prefill worker keeps them (``windows.fit_windows``: its
    budget cut to its window, the rest to the other layers)."""
    keys_out, values_out, kept = [], [], []
    windows = binding_windows(prep.windows, prep.m, EVAL_NEW_TOKENS)
    budgets, tails = fit_windows(budgets, windows, prep.m)
    for att, k_l, keys, values, tail in zip(attention, budgets, prep.keys, prep.values, tails, strict=True):
        if not 1 <= k_l <= prep.m:
            raise ValueError(f"budget {k_l} outside [1, m={prep.m}]")
        if tail:
            idx = torch.arange(prep.m - k_l, prep.m, device=keys.device).repeat(keys.shape[0], 1)
        else:
            idx = att.topk(k_l, dim=-1).indices.sort(dim=-1).values.to(keys.device)  # [H_kv, k_l]
        gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        keys_out.append(keys.gather(1, gather))
        values_out.append(values.gather(1, gather))
        kept.append(idx)
    return CompactKV(
        keys_out, values_out, prompt_length=prep.m, first_token=prep.first_token, kept_indices=kept
    )
