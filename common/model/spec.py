"""One description of the served model, built once per process from its Hugging Face config.

Everything that needs a fact about the model (how many layers, KV heads and head dim its cache has, its
context, its image token, its end-of-sequence ids, the fingerprint a hand-off is checked against) reads it
from a :class:`ModelSpec` instead of walking the HF config itself. The gateway builds one from the
checkpoint's config files (no weights: ``fingerprint`` is empty there); the workers build one from the
loaded model, which adds the weights' fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
from transformers import AutoConfig, GenerationConfig

from .families import sliding_windows
from .question import TurnLayout

# Elements sampled per parameter by ``model_fingerprint`` (evenly strided, plus the tensor's last element).
FINGERPRINT_SAMPLES = 1024
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

KVLayout = tuple[int, int, int, "torch.dtype | str"]  # (num_layers, num_kv_heads, head_dim, dtype)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the weights, hence of the KV cache
    context: int  # max_position_embeddings: prompt + generated tokens
    vocab_size: int
    image_token_id: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str = ""  # empty when built without weights (the gateway)
    turns: TurnLayout | None = None  # where a prompt's final question starts (``question.py``; workers only)
    windows: tuple[int, ...] = ()  # per layer its sliding window W, 0: none (``families.py``); (): no layer

    @property
    def kv_layout(self) -> KVLayout:
        """What the hand-off checks a cache against: ``(L, H_kv, D, dtype)``."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_per_token_layer(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def from_config(
        cls, config, dtype: torch.dtype, eos_token_ids: list[int] | tuple[int, ...], fingerprint: str = ""
    ) -> ModelSpec:
        """From a LLaVA-family HF config (``config.text_config`` is the decoder); ConfigError for a decoder
        family vlkv cannot serve (``families.family_of``)."""
        text = text_config(config)
        windows = sliding_windows(text)
        heads = int(text.num_attention_heads)
        return cls(
            num_layers=int(text.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            dtype=dtype,
            context=int(getattr(text, "max_position_embeddings", 0) or 0),
            vocab_size=int(getattr(text, "vocab_size", 0) or 0),
            image_token_id=int(
                getattr(config, "image_token_id", None) or getattr(config, "image_token_index", -1)
            ),
            eos_token_ids=tuple(eos_token_ids),
            fingerprint=fingerprint,
            windows=windows if any(windows) else (),
        )

    @classmethod
    def from_checkpoint(cls, path: str, dtype: torch.dtype, tokenizer=None) -> ModelSpec:
        """From the files of a local checkpoint, without loading its weights."""
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json
            generation = None
        return cls.from_config(config, dtype, _eos_ids(generation, tokenizer))

    @classmethod
    def from_model(cls, model, tokenizer=None) -> ModelSpec:
        """From a loaded model: its dtype and the fingerprint of its weights (with ``tokenizer``, its
        ``TurnLayout`` too)."""
        dtype = next(model.parameters()).dtype
        eos = _eos_ids(getattr(model, "generation_config", None), tokenizer)
        spec = cls.from_config(model.config, dtype, eos)
        turns = TurnLayout.from_tokenizer(tokenizer) if tokenizer is not None else None
        return dataclasses.replace(spec, fingerprint=model_fingerprint(model, spec), turns=turns)


def text_config(config):
    """The language-model part of a (possibly multimodal, e.g. LLaVA) HF config."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else getattr(config, "text_config", None) or config


def _eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    ids = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))


def model_fingerprint(model, spec: ModelSpec | None = None) -> str:
    """16-hex-digit digest of the KV layout, vocab size and a strided sample of every parameter.

    Hashes every parameter's name, shape and dtype plus ``FINGERPRINT_SAMPLES`` evenly strided
    elements of it (gathered on the parameter's device, so a 7B model moves ~2 MB to the host and
    hashes in well under a second). Tradeoff: an edit that touches only unsampled elements (say one
    row of one matrix) keeps the fingerprint; any fine-tune, re-quantization, dtype cast, checkpoint
    swap or layout change alters it. Hashing all 14 GB would be exact but take tens of seconds.
    """
    if spec is None:
        spec = ModelSpec.from_config(model.config, next(model.parameters()).dtype, ())
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{spec.num_layers}/{spec.num_kv_heads}/{spec.head_dim}/{spec.dtype}/{spec.vocab_size}".encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"|{name}:{tuple(p.shape)}:{p.dtype}".encode())
            flat = p.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = torch.cat([flat[::step][:FINGERPRINT_SAMPLES], flat[-1:]]).cpu().contiguous()
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
