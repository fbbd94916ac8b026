"""The LLaVA prefill forward with reused image K/V: layer by layer over the model's own HF modules.

On an image-cache hit (``image_reuse.py``) the vision tower is skipped and each decoder layer ``l`` runs only
the rows of its *recomputed set* ``R_l``: every text token and, per image, its earliest ``counts[l]`` tokens
(``counts`` non-increasing with depth, so ``R_l`` is a subset of ``R_{l-1}`` and the hidden states those
rows need were computed by the layer before). The layer's attention sees all m keys: the fresh K/V of
``R_l`` written over the cached K/V of the image's other tokens (post-RoPE keys rotated from the position
they were computed at to the image's position now). Reused rows skip the layer's projections, attention and
MLP. The ``vlkv`` attention function still hands each layer's Q (of ``R_l``) and K (all m) to the
statistics observer; the post-vision rows the statistics need are text, always in ``R_l``.

Each layer runs as the model's own forward runs it: its attention mask and its rotary embedding come from the
decoder family's entry (``common/model/families.py``: ``mask_functions``, causal and, for a sliding layer
of Mistral, Qwen2 or Gemma 3, within its window; ``layer_ropes``, Gemma 3's local or global rotary module
by layer type), the embedding module (with Gemma 3's scale), q/k norms and attention scaling are the model's.

``rotate`` moves cached post-RoPE keys to a new position; it is exact for rotary embeddings that are a pure
rotation by position (``rope_type`` default, linear, llama3; ``attention_scaling == 1``), which
``reuse_supported`` checks for every layer's rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.families import family_of
from vlkv.common.model.loading import language_model

ROTATION_ROPE_TYPES = ("default", "linear", "llama3")


def reuse_supported(model) -> str:
    """Empty if this model's forward can reuse image K/V, else why not."""
    if getattr(model.config, "model_type", "") != "llava":
        return f"model_type {model.config.model_type!r} (only llava)"
    lm = language_model(model)
    for rope in {r.key: r for r in family_of(lm.config).layer_ropes(lm)}.values():
        what = f"rope type {rope.rope_type!r}" + (f" ({rope.layer_type} layers)" if rope.layer_type else "")
        if rope.rope_type not in ROTATION_ROPE_TYPES:
            return f"{what} is not a pure rotation"
        if rope.attention_scaling != 1.0:
            return f"{what} scales its cos/sin by {rope.attention_scaling} (not a pure rotation)"
    return ""


def rotate(keys: torch.Tensor, delta: int, rotary_emb) -> torch.Tensor:
    """Post-RoPE ``keys [..., n, D]`` computed at positions p moved to p + delta (a rotation by delta).
    ``rotary_emb``: the layer's rotary embedding, called ``rotary_emb(x, position_ids=...)`` (a model's
    rotary module, or a ``families.LayerRope``)."""
    if delta == 0:
        return keys
    pos = torch.tensor([[delta]], device=keys.device)
    cos, sin = rotary_emb(keys, position_ids=pos)  # [1, 1, D]
    cos, sin = cos[0].to(torch.float32), sin[0].to(torch.float32)
    k = keys.to(torch.float32)
    half = k.shape[-1] // 2
    rotated_half = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)


def rotate_layers(keys: torch.Tensor | list[torch.Tensor], delta: int, model) -> torch.Tensor:
    """Every layer's cached keys (``[L, H_kv, n, D]`` or a list of ``[H_kv, n, D]``) moved by ``delta``, each
    layer with its own rotary embedding (Gemma 3: its layer type's); layers sharing one are rotated together."""
    stacked = torch.stack(list(keys)) if isinstance(keys, list | tuple) else keys
    if delta == 0:
        return stacked
    lm = language_model(model)
    ropes = family_of(lm.config).layer_ropes(lm)
    out = torch.empty_like(stacked)
    for key in dict.fromkeys(r.key for r in ropes):
        layers = [i for i, r in enumerate(ropes) if r.key == key]
        out[layers] = rotate(stacked[layers], delta, ropes[layers[0]])
    return out


@dataclass
class ReusedImage:
    """One image of the prompt served from the cache: its tokens sit at ``start .. start+n-1`` now."""

    start: int
    features: torch.Tensor  # [n, hidden]
    keys: list[torch.Tensor] | torch.Tensor  # per layer [H_kv, n, D] (or stacked [L, ...]), rotated to start
    values: list[torch.Tensor] | torch.Tensor
    counts: list[int]  # earliest tokens recomputed per layer (non-increasing)

    @property
    def n(self) -> int:
        return int(self.features.shape[0])


class _LayerKV:
    """The ``past_key_values`` a decoder layer sees: ``update`` writes the fresh rows over the layer's full
    ``[1, H_kv, m, D]`` K/V (reused rows pre-filled) and returns them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        self.keys, self.values, self.rows = keys, values, rows

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[:, :, self.rows] = key_states
        self.values[:, :, self.rows] = value_states
        return self.keys, self.values


@torch.inference_mode()
def reuse_forward(
    model, input_ids: torch.Tensor, images: list[ReusedImage], observer=None, logits_to_keep: int = 1
) -> tuple[torch.Tensor, list, list]:
    """Last-position logits ``[vocab]`` (fp32; ``[logits_to_keep, vocab]`` for the last positions when
    more than 1) and every layer's K and V ``[H_kv, m, D]``, with ``images`` reused; ``input_ids [m]``;
    the last ``logits_to_keep`` positions must be text tokens."""
    lm = language_model(model)
    ids = input_ids.reshape(-1).to(lm.embed_tokens.weight.device)
    m = ids.numel()
    device = ids.device
    embeds = lm.embed_tokens(ids)  # [m, hidden]
    text = torch.ones(m, dtype=torch.bool, device=device)
    for img in images:
        text[img.start : img.start + img.n] = False
        embeds[img.start : img.start + img.n] = img.features.to(embeds.dtype)
    if not bool(text[-logits_to_keep:].all()):
        raise ValueError("the prompt must end with a text token to reuse image K/V")
    positions = torch.arange(m, device=device)
    family = family_of(lm.config)
    rope = family.position_embeddings(lm, embeds[None], positions[None])  # per layer (cos, sin) [1, m, D]
    masks = family.mask_functions(lm.config)  # per layer: causal, within its window if it slides
    num_layers = len(lm.layers)
    kv_heads, head_dim = images[0].keys[0].shape[0], images[0].keys[0].shape[-1]
    # every layer's K/V at once: the images' cached rows now, the recomputed rows written by the layers
    k_all = torch.empty((num_layers, 1, kv_heads, m, head_dim), dtype=embeds.dtype, device=device)
    v_all = torch.empty_like(k_all)
    for img in images:
        span = slice(img.start, img.start + img.n)
        k_all[:, 0, :, span] = torch.stack(list(img.keys)) if isinstance(img.keys, list) else img.keys
        v_all[:, 0, :, span] = torch.stack(list(img.values)) if isinstance(img.values, list) else img.values
    hidden = embeds[None]  # rows of the previous layer's recomputed set
    prev_rows = positions
    keys_out, values_out = [], []
    for layer_idx in range(num_layers):
        keep = text.clone()
        for img in images:
            keep[img.start : img.start + img.counts[layer_idx]] = True
        rows = keep.nonzero().flatten()
        if rows.numel() != prev_rows.numel():  # R_l is a subset of R_{l-1}: pick its rows
            sel = torch.searchsorted(prev_rows, rows)
            hidden = hidden[:, sel]
        prev_rows = rows
        k_full, v_full = k_all[layer_idx], v_all[layer_idx]
        mask = masks[layer_idx](0, 0, rows[:, None], positions[None, :])  # on absolute positions
        cos, sin = rope[layer_idx]
        out = lm.layers[layer_idx](
            hidden,
            attention_mask=mask[None, None],
            position_ids=rows[None],
            **cache_arg(lm.layers[layer_idx], _LayerKV(k_full, v_full, rows)),
            use_cache=True,
            position_embeddings=(cos[:, rows], sin[:, rows]),
            vlkv_stats=observer,
        )
        hidden = out[0] if isinstance(out, tuple) else out
        keys_out.append(k_full[0])
        values_out.append(v_full[0])
    logits = model.lm_head(lm.norm(hidden[:, -logits_to_keep:]))[0].float()
    return (logits[-1] if logits_to_keep == 1 else logits), keys_out, values_out
