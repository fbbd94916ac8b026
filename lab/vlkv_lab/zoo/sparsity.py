"""Per-layer post-vision attention sparsity of a zoo member (VL-Cache's gamma_l): how dense each layer reads
the image from the question on (``python -m vlkv_lab.zoo.accuracy MEMBER -n 0 --sparsity 50``)."""

from __future__ import annotations

import torch
from vlkv.deploy.synthetic_task import Example, prompt_text


class _SparsityObserver:
    """``vlkv_stats`` observer: per layer, the share of post-vision attention entries below ``p`` times their
    row's max (``kernels.attention_stats_reference`` -> ``common.compression.stats.layer_sparsity``)."""

    def __init__(self, q_start: int, threshold: float) -> None:
        self.q_start, self.threshold = q_start, threshold
        self.per_layer: dict[int, float] = {}

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        from vlkv.common.compression.stats import layer_sparsity
        from vlkv.kernels.attention_stats_reference import attention_stats_reference

        stats = attention_stats_reference(
            query[0, :, self.q_start :], key[0], q_start=self.q_start, scale=scaling, threshold=self.threshold
        )
        self.per_layer[layer_idx] = layer_sparsity(stats)


def layer_sparsities(model, processor, examples: list[Example], threshold: float = 0.01) -> list[float]:
    """Mean over ``examples`` of each layer's post-vision attention sparsity (VL-Cache's gamma_l: query rows
    after the last vision token, threshold ``p``), from the full prompt's prefill."""
    from vlkv.common.model.attention import use_vlkv_attention
    from vlkv.common.model.inputs import ModalityMap

    use_vlkv_attention(model)
    sums: list[float] = []
    for ex in examples:
        inputs = processor(images=ex.images, text=prompt_text(processor, ex), return_tensors="pt")
        modality = ModalityMap.from_input_ids(inputs["input_ids"], model.config.image_token_id)
        obs = _SparsityObserver(modality.m - modality.tau, threshold)
        with torch.no_grad():
            model(**inputs, vlkv_stats=obs)
        vals = [obs.per_layer[i] for i in range(len(obs.per_layer))]
        sums = [a + b for a, b in zip(sums, vals, strict=True)] if sums else vals
    model.set_attn_implementation({"text_config": "sdpa"})
    return [s / len(examples) for s in sums]
