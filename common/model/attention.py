"""vlkv's attention function, registered with transformers' attention interface.

The model code stays untouched: the language model is switched to the ``"vlkv"`` implementation, which
behaves exactly like SDPA unless the forward call carries one of two keyword arguments that transformers
passes down to every attention call:

- ``vlkv_stats``: an object with ``observe(layer_idx, query, key, scaling)``; the prefill worker uses it to
  collect post-vision attention statistics from the post-RoPE Q and K of every layer.
- ``vlkv_decode``: an object with ``attend(layer_idx, query, scaling) -> [B, 1, H, D]``; the decode worker
  uses it to run paged attention over each sequence's per-layer block table. The same object is passed as
  ``past_key_values`` so that the new token's K and V are appended to the pool first.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "vlkv"


def vlkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [B, H, q_len, D]; key, value: [B, H_kv, kv_len, D] (post-RoPE)."""
    decode = kwargs.pop("vlkv_decode", None)
    stats = kwargs.pop("vlkv_stats", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if decode is not None:
        return decode.attend(module.layer_idx, query, scaling), None
    if stats is not None:
        stats.observe(module.layer_idx, query, key, scaling)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


def register() -> str:
    """Register the ``"vlkv"`` attention implementation (idempotent) and return its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, vlkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def use_vlkv_attention(model) -> None:
    """Switch the language model of a LLaVA model to the vlkv attention function."""
    register()
    model.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})
