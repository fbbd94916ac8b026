"""The compact KV cache a prefill worker hands to a decode worker.

Keys are stored after RoPE, so a kept token keeps its original position; the decode side only needs
``prompt_length`` (m) to continue positions. Each layer keeps its own number of tokens ``k_l``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class CompactKV:
    """Per-layer K and V of one sequence.

    keys[l], values[l]: ``[H_kv, k_l, D]``, contiguous, one dtype for all layers.
    prompt_length: m, the number of prompt tokens the full cache held.
    first_token: the token sampled by the prefill forward (decode starts by feeding it).
    kept_indices: optional per-layer ``[H_kv, k_l]`` original positions of the kept tokens (diagnostics).
    k_scales, v_scales: set for an int8 cache (``quantize.quantize_compact``): per layer ``[H_kv, D]``
    (per-channel K scales) and ``[H_kv, k_l]`` (per-token V scales), fp16; keys/values are then int8.
    source_dtype: the dtype an int8 cache was quantized from (None when unknown or not quantized).
    qformat: what the bytes of a quantized cache encode: ``int8`` steps or ``fp8`` E4M3 bit patterns
    (``quantize.py``); both are stored as ``torch.int8``.
    prompt_scores: optional per layer ``[k_l]`` fp16, the prompt-time importance of each kept position (the
    attention per covered query row, summed over every head: ``Policy.compress``); a decode worker that
    re-compresses starts its accumulated attention mass from it (header field ``prompt_scores``).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prompt_length: int
    first_token: int = 0
    kept_indices: list[torch.Tensor] | None = field(default=None, repr=False)
    k_scales: list[torch.Tensor] | None = field(default=None, repr=False)
    v_scales: list[torch.Tensor] | None = field(default=None, repr=False)
    source_dtype: torch.dtype | None = None
    qformat: str = "int8"
    prompt_scores: list[torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("keys and values must be non-empty lists of equal length")
        ref = self.keys[0]
        for k, v in zip(self.keys, self.values, strict=True):
            if k.shape != v.shape or k.dim() != 3:
                raise ValueError(
                    f"layer K {tuple(k.shape)} and V {tuple(v.shape)} must both be [H_kv, k_l, D]"
                )
            if k.shape[0] != ref.shape[0] or k.shape[2] != ref.shape[2] or k.dtype != ref.dtype:
                raise ValueError("all layers must share H_kv, D and dtype")
            if not 0 < k.shape[1] <= self.prompt_length:
                raise ValueError(f"layer length {k.shape[1]} outside [1, m={self.prompt_length}]")
        if (self.k_scales is None) != (self.v_scales is None) or (self.k_scales is None) == (
            ref.dtype == torch.int8
        ):
            raise ValueError("an int8 cache needs k_scales and v_scales, a floating-point one neither")
        if self.qformat not in ("int8", "fp8"):
            raise ValueError(f"qformat must be int8 or fp8, got {self.qformat!r}")
        if self.k_scales is not None:
            for k, ks, vs in zip(self.keys, self.k_scales, self.v_scales, strict=True):
                if ks.shape != (k.shape[0], k.shape[2]) or vs.shape != k.shape[:2]:
                    raise ValueError(
                        f"scales {tuple(ks.shape)}, {tuple(vs.shape)} do not fit {tuple(k.shape)}"
                    )
        if self.prompt_scores is not None and [tuple(s.shape) for s in self.prompt_scores] != [
            (n,) for n in self.layer_lengths
        ]:
            raise ValueError("prompt_scores must hold one [k_l] tensor per layer")

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    @property
    def kv_dtype(self) -> str:
        """``int8``, ``fp8`` or ``fp16`` (not quantized: the model's dtype), as ``--kv-dtype`` names them."""
        return self.qformat if self.quantized else "fp16"

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def layer_lengths(self) -> list[int]:
        return [k.shape[1] for k in self.keys]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V, scales included."""
        n = sum(k.numel() * k.element_size() * 2 for k in self.keys)
        if self.quantized:
            n += sum(s.numel() * s.element_size() for s in (*self.k_scales, *self.v_scales))
        return n

    @property
    def full_nbytes(self) -> int:
        """Bytes the uncompressed cache (m tokens in every layer, in the model's dtype) would take."""
        itemsize = (self.source_dtype or self.dtype).itemsize if self.quantized else self.dtype.itemsize
        per_token = self.num_kv_heads * self.head_dim * itemsize * 2
        return per_token * self.prompt_length * self.num_layers

    @property
    def compression_ratio(self) -> float:
        """Realized ratio sum_l k_l / (L * m)."""
        return sum(self.layer_lengths) / (self.num_layers * self.prompt_length)

    def non_finite_part(self) -> str:
        """Where the cache holds NaN or inf (``"layer L keys"``), or ``""``."""
        parts = [[("keys", k), ("values", v)] for k, v in zip(self.keys, self.values, strict=True)]
        if self.quantized:
            for p, ks, vs in zip(parts, self.k_scales, self.v_scales, strict=True):
                p += [("key scales", ks), ("value scales", vs)]
        for layer, layer_parts in enumerate(parts):
            for name, t in layer_parts:
                if not all_finite(t):
                    return f"layer {layer} {name}"
        return ""


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf: its min and max, read in place (an empty tensor is finite)."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())
