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
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prompt_length: int
    first_token: int = 0
    kept_indices: list[torch.Tensor] | None = field(default=None, repr=False)

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
        return sum(k.numel() * k.element_size() * 2 for k in self.keys)

    @property
    def full_nbytes(self) -> int:
        """Bytes the uncompressed cache (m tokens in every layer) would take."""
        per_token = self.num_kv_heads * self.head_dim * self.keys[0].element_size() * 2
        return per_token * self.prompt_length * self.num_layers

    @property
    def compression_ratio(self) -> float:
        """Realized ratio sum_l k_l / (L * m)."""
        return sum(self.layer_lengths) / (self.num_layers * self.prompt_length)

    def non_finite_part(self) -> str:
        """Where the cache holds NaN or inf (``"layer L keys"``), or ``""``."""
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            for name, t in (("keys", k), ("values", v)):
                if not all_finite(t):
                    return f"layer {layer} {name}"
        return ""


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf: its min and max, read in place (an empty tensor is finite)."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())
