"""Loading LLaVA-family checkpoints from a local directory through transformers.

Supports ``LlavaForConditionalGeneration`` and ``LlavaNextForConditionalGeneration`` checkpoints in the
layout of ``llava-hf/...`` repositories (GQA and MHA language backbones). Nothing is fetched from a hub.
"""

from __future__ import annotations

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
