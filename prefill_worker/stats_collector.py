"""Collects post-vision attention statistics during the real prefill forward.

Passed to the model as the ``vlkv_stats`` keyword (see ``common/attention.py``): every decoder layer hands
its post-RoPE Q ``[1, H, m, D]`` and K ``[1, H_kv, m, D]`` to ``observe``, which runs the attention-statistics
kernel over the query rows ``q_start .. m-1`` and keeps only its O(rows + m) per-head results.
"""

from __future__ import annotations

import torch
from vlkv.kernels.attention_stats import attention_stats


class StatsCollector:
    def __init__(self, q_start: int, threshold: float) -> None:
        self.q_start = q_start
        self.threshold = threshold
        self.per_layer: dict[int, object] = {}

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        if query.shape[0] != 1:
            raise ValueError("statistics are collected for one sequence at a time")
        self.per_layer[layer_idx] = attention_stats(
            query[0, :, self.q_start :],
            key[0],
            q_start=self.q_start,
            scale=scaling,
            threshold=self.threshold,
        )

    def stats(self, num_layers: int) -> list:
        missing = [i for i in range(num_layers) if i not in self.per_layer]
        if missing:
            raise RuntimeError(f"no attention statistics for layers {missing}")
        return [self.per_layer[i] for i in range(num_layers)]
