"""The prefill step: processor -> LLaVA forward with statistics -> first token -> compact cache.

``PrefillEngine.run`` is synchronous (the server runs it in a worker thread): it turns images + prompt into
model inputs, runs the real forward once over the whole prompt (the vlkv attention function collects the
statistics the chosen policy needs on the way), samples the first token from the last position's logits,
and compresses each layer's post-RoPE K and V into a :class:`CompactKV`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from vlkv.common.compression_params import CompressionConfig
from vlkv.common.errors import InvalidInput
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.attention import use_vlkv_attention
from vlkv.common.request import ModalityMap, prepare_inputs
from vlkv.common.sampling import SamplingConfig, make_generator, sample_token
from vlkv.prefill_worker.stats_collector import StatsCollector


@dataclass
class PrefillResult:
    cache: CompactKV
    modality: ModalityMap
    policy: str
    prefill_ms: float


def context_length(model) -> int:
    return int(model.config.text_config.max_position_embeddings)


class PrefillEngine:
    def __init__(self, model, processor, *, max_prompt_tokens: int = 0) -> None:
        use_vlkv_attention(model)
        self.model = model
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)
        self.num_layers = int(model.config.text_config.num_hidden_layers)
        self.context = context_length(model)
        self.max_prompt_tokens = max_prompt_tokens or self.context
        self.device = next(model.parameters()).device

    def check_length(self, m: int, max_new_tokens: int) -> None:
        if m > self.max_prompt_tokens:
            raise InvalidInput(f"the prompt has {m} tokens, over the limit of {self.max_prompt_tokens}")
        if m + max_new_tokens > self.context:
            raise InvalidInput(
                f"prompt ({m} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
                f"{self.context} tokens"
            )

    @torch.inference_mode()
    def run(
        self, images, prompt: str, sampling: SamplingConfig, compression: CompressionConfig
    ) -> PrefillResult:
        start = time.perf_counter()
        inputs = prepare_inputs(self.processor, images, prompt, self.image_token_id)
        modality = inputs.modality
        m, tau = modality.m, modality.tau
        self.check_length(m, sampling.max_new_tokens)

        policy = compression.build_policy()
        collector = None
        if not compression.is_full and policy.requires_stats:
            collector = StatsCollector(policy.query_start(m, tau), compression.threshold)
        cache = DynamicCache(config=self.model.config.text_config)
        kwargs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.model_kwargs.items()}
        if "pixel_values" in kwargs:
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.model.dtype)
        out = self.model(
            input_ids=inputs.input_ids.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            vlkv_stats=collector,
            **kwargs,
        )
        generator = None if sampling.greedy else make_generator(sampling.seed)
        first = sample_token(out.logits[0, -1].float(), sampling, generator)

        keys = [layer.keys[0] for layer in cache.layers[: self.num_layers]]
        values = [layer.values[0] for layer in cache.layers[: self.num_layers]]
        if compression.is_full:
            ckv = CompactKV([k.contiguous() for k in keys], [v.contiguous() for v in values], m, first)
            name = "full"
        else:
            stats = collector.stats(self.num_layers) if collector is not None else None
            ckv = policy.compress(
                stats, keys, values, alpha=compression.budget, m=m, tau=tau, first_token=first
            )
            name = compression.policy
        return PrefillResult(ckv, modality, name, (time.perf_counter() - start) * 1000)
