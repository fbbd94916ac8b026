"""Loading LLaVA-family checkpoints from a local directory through transformers.

Supports ``LlavaForConditionalGeneration`` and ``LlavaNextForConditionalGeneration`` checkpoints in the
layout of ``llava-hf/...`` repositories (GQA and MHA language backbones). Nothing is fetched from a hub.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    AutoConfig,
    AutoProcessor,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    PreTrainedModel,
)
from vlkv.common.config import ModelConfig

MODEL_CLASSES = {
    "llava": LlavaForConditionalGeneration,
    "llava_next": LlavaNextForConditionalGeneration,
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class KVLayout:
    """What one token of KV cache looks like in this model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def kv_layout(model: PreTrainedModel) -> KVLayout:
    text = model.config.text_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KVLayout(
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dtype=model.dtype,
    )


def load_model(cfg: ModelConfig, *, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """Load the checkpoint at ``cfg.path`` in eval mode on ``cfg.device``."""
    hf_config = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
    cls = MODEL_CLASSES.get(hf_config.model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model_type {hf_config.model_type!r} is not supported; expected one of {sorted(MODEL_CLASSES)}"
        )
    model = cls.from_pretrained(
        cfg.path,
        dtype=cfg.torch_dtype,
        local_files_only=True,
        attn_implementation=attn_implementation,
    )
    return model.to(cfg.device).eval()


def load_processor(path: str):
    return AutoProcessor.from_pretrained(path, local_files_only=True)


def language_model(model: PreTrainedModel):
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a LLaVA model."""
    return model.model.language_model
