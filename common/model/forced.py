"""Tokens fed over compressed caches in one forward, through the decode step's own layers (the
``vlkv_decode`` attention hook): ``ForcedAttention`` attends each forced token to its cache's kept positions
(masked) and, causally, to the forced tokens up to its own; ``forced_hidden`` runs the language model's layers
with it (embeddings, rotary positions continuing from each cache's prompt length, the final norm).

Used where the tokens are known in advance: the verifier's teacher forcing (``prefill_worker/teacher_force.py``)
and a conversation's follow-up appended to a kept compact cache (``append_tokens``: on the prefill worker's
kept cache, ``prefill_worker/continuation.py``, and on the decode worker's own, ``decode_worker/retention.py``).
It is the decode step's arithmetic on the same inputs (one softmax over the same keys), in one batched matmul
instead of one step per token; only the order of floating-point sums differs.
"""

from __future__ import annotations

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.families import family_of
from vlkv.common.model.loading import language_model

__all__ = ["AppendingAttention", "ForcedAttention", "append_tokens", "forced_hidden", "model_windows"]


class ForcedAttention:
    """The ``vlkv_decode`` object of one forward: ``update`` keeps the forced tokens' K/V, ``attend``
    attends over the kept prefix (masked) and the forced tokens (causal).

    Per layer the caches are sorted by their kept length and cut into ``groups`` groups of about equal
    count, each padded to its own longest (a layer of a 10% cache can keep 30x the tokens of a 2% one:
    padded to one length, most of the work was on padding)."""

    def __init__(self, caches: list[CompactKV], groups: int = 4, windows: tuple[int, ...] = ()) -> None:
        self.windows = windows  # per layer its sliding window (such a layer's prefix: its last positions)
        self.dtype = caches[0].keys[0].dtype  # the pool's: the forced tokens' K/V are rounded to it
        self.prefix: list[list[tuple]] = []
        for layer in range(len(caches[0].keys)):
            h, _, d = caches[0].keys[layer].shape
            device = caches[0].keys[layer].device
            lengths = torch.tensor([c.keys[layer].shape[1] for c in caches])
            parts = []
            for idx in torch.tensor_split(torch.argsort(lengths, stable=True), min(groups, len(caches))):
                length = int(lengths[idx].max())
                kk = torch.zeros(len(idx), h, length, d, device=device)  # fp32: read so by every forced token
                vv = torch.zeros_like(kk)
                keep = torch.zeros(len(idx), length, dtype=torch.bool, device=device)
                for r, i in enumerate(idx.tolist()):
                    n = int(lengths[i])
                    kk[r, :, :n], vv[r, :, :n] = caches[i].keys[layer], caches[i].values[layer]
                    keep[r, :n] = True
                parts.append((idx.to(device), kk, vv, keep))
            self.prefix.append(parts)
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key, value)
        return key, value

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query ``[B, H, T, D]`` -> output ``[B, T, H, D]``. The ``H / Hkv`` query heads that share a KV head
        are one ``[group * T]`` block of rows against that head's keys (the keys are not repeated per query
        head); the kept prefix and the forced tokens are scored apart and share one softmax."""
        kn, vn = self.new.pop(layer_idx)
        b, h, t, d = query.shape
        hkv = kn.shape[1]
        # fp32 throughout, as the decode step's paged attention computes (new K/V rounded to the pool's dtype)
        kn, vn = kn.to(self.dtype).float(), vn.to(self.dtype).float()
        q = (query.float() * scaling).reshape(b, hkv, (h // hkv) * t, d)
        window = self.windows[layer_idx] if self.windows else 0
        rows = torch.arange(t, device=query.device)
        causal = rows[None, :] <= rows[:, None]
        if window > 0:  # forced token g reads the forced tokens after g - W
            causal &= rows[None, :] > rows[:, None] - window
        causal = causal.repeat(h // hkv, 1)
        out = torch.empty_like(q)
        for idx, k0, v0, keep in self.prefix[layer_idx]:
            qi, kni, vni = q[idx], kn[idx], vn[idx]
            prefix = torch.matmul(qi, k0.transpose(2, 3))  # [b, Hkv, group * T, L]
            prefix.masked_fill_(~self._visible(keep, window, t, h // hkv), float("-inf"))
            own = torch.matmul(qi, kni.transpose(2, 3)).masked_fill_(~causal, float("-inf"))
            probs = torch.softmax(torch.cat([prefix, own], -1), dim=-1)
            length = k0.shape[2]
            out[idx] = torch.matmul(probs[..., :length], v0) + torch.matmul(probs[..., length:], vni)
        return out.reshape(b, h, t, d).to(query.dtype).transpose(1, 2)

    @staticmethod
    def _visible(keep: torch.Tensor, window: int, t: int, group: int) -> torch.Tensor:
        """``[b, 1, group * T or 1, L]``: which kept prefix entries each forced row reads. A sliding layer's
        ``n`` kept entries are its last prompt positions, so forced token ``g`` (at ``m + g``) reads entry ``j``
        when ``j > n + g - W`` (the query at ``p`` reads keys after ``p - W``)."""
        if window <= 0:
            return keep[:, None, None, :]
        n = keep.sum(-1)  # [b]
        j = torch.arange(keep.shape[-1], device=keep.device)
        g = torch.arange(t, device=keep.device)
        seen = keep[:, None, :] & (j[None, None, :] > (n[:, None, None] + g[None, :, None] - window))
        return seen.repeat(1, group, 1)[:, None]  # rows are (query head of the group, forced token)


def forced_hidden(
    model, caches: list[CompactKV], tokens: list[list[int]], forced: ForcedAttention
) -> torch.Tensor:
    """The final-norm hidden states ``[len(caches), T, hidden]`` of ``tokens`` fed over ``caches`` (token 0 of
    row ``i`` at position ``caches[i].prompt_length``), through ``forced`` (a ``ForcedAttention`` over the caches)."""
    lm = language_model(model)
    t = max(len(x) for x in tokens)
    ids = torch.tensor([x + [x[-1]] * (t - len(x)) for x in tokens])  # padding after a row's end is unseen
    positions = torch.tensor([c.prompt_length for c in caches])[:, None] + torch.arange(t)
    family = family_of(lm.config)
    hidden = lm.embed_tokens(ids.to(lm.embed_tokens.weight.device))
    layers = lm.layers[: len(caches[0].keys)]
    step = {  # what the decode step passes every layer, with this forward's object as cache and hook
        "attention_mask": None,
        "position_ids": positions,
        "use_cache": True,
        "vlkv_decode": forced,
        **cache_arg(layers[0], forced),
    }
    rope = family.position_embeddings(lm, hidden, positions)
    for layer, position_embeddings in zip(layers, rope, strict=False):
        hidden = layer(hidden, position_embeddings=position_embeddings, **step)
    return lm.norm(hidden)


def model_windows(model) -> tuple[int, ...]:
    """Per layer the sliding window the model's attention reads (() when none has one)."""
    lm = language_model(model)
    windows = family_of(lm.config).windows(lm.config)
    return tuple(windows) if any(windows) else ()


class AppendingAttention(ForcedAttention):
    """``ForcedAttention`` over one cache that also keeps the new tokens' K/V of every layer."""

    def __init__(self, cache: CompactKV, windows: tuple[int, ...]) -> None:
        super().__init__([cache], 1, windows)
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.kept[layer_idx] = (key, value)
        return super().update(key, value, layer_idx)


@torch.inference_mode()
def append_tokens(
    model, cache: CompactKV, tokens: list[int], cut: tuple[int, ...] = ()
) -> tuple[CompactKV, torch.Tensor]:
    """``cache`` with ``tokens`` appended (their K/V computed over it at positions ``prompt_length ..``), and
    the next-token logits ``[vocab]`` (fp32) after the last. ``cut``: per layer a binding sliding window
    (0: none): such a layer keeps its last ``W - 1`` positions, as at prefill."""
    forced = AppendingAttention(cache, model_windows(model))
    hidden = forced_hidden(model, [cache], [list(tokens)], forced)
    logits = model.lm_head(hidden[:, -1:]).float()[0, -1]
    keys, values = [], []
    for layer, (k_old, v_old) in enumerate(zip(cache.keys, cache.values, strict=True)):
        k_new, v_new = forced.kept[layer]  # [1, H_kv, T, D]
        k = torch.cat([k_old, k_new[0].to(k_old.dtype)], dim=1)
        v = torch.cat([v_old, v_new[0].to(v_old.dtype)], dim=1)
        w = cut[layer] if cut else 0
        if w > 0 and k.shape[1] > w - 1:
            k, v = k[:, -(w - 1) :], v[:, -(w - 1) :]
        keys.append(k.contiguous())
        values.append(v.contiguous())
    out = CompactKV(keys, values, prompt_length=cache.prompt_length + len(tokens))
    return out, logits
