"""What vlkv needs of each decoder family, one entry per family (the ``model_type`` of ``text_config``).

vlkv drives the model's own transformers modules (its embedding module with any embedding scale, its decoder
layers with their q/k norms and attention scaling, its final norm, its rotary embedding module); what differs
between families and vlkv must know is here:

- how a step's rotary position embeddings are obtained for each layer: one call for every layer (Llama,
  Mistral, Qwen2) or one per layer type (Gemma 3's ``rotary_emb(x, position_ids, layer_type)``, whose sliding
  and global layers rotate with different bases);
- each layer's sliding window ``W`` (0: the layer reads the whole prompt). A query at position ``p`` of a
  sliding layer reads keys ``p - W + 1 .. p`` (transformers' ``sliding_window_overlay``), so at prefill the
  layer needs at most its last ``W - 1`` prompt positions and in decode the last ``W`` entries of its cache;
- what a family's config may set that vlkv cannot serve (refused at start-up, never at the first step).

A family not listed here is refused by :func:`family_of` with a ConfigError naming it; ``ModelSpec`` calls it,
so the gateway, both workers and ``vlkv serve`` refuse before they serve anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vlkv.common.errors import ConfigError

SLIDING = "sliding_attention"


def _no_windows(text) -> tuple[int, ...]:
    return (0,) * int(text.num_hidden_layers)


def _uniform_window(text) -> tuple[int, ...]:
    """Mistral: ``sliding_window`` (None: off) applies to every layer."""
    return (int(getattr(text, "sliding_window", None) or 0),) * int(text.num_hidden_layers)


def _typed_windows(text) -> tuple[int, ...]:
    """Qwen2, Gemma 3: ``layer_types[l] == "sliding_attention"`` layers have ``sliding_window``."""
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers))
    window = int(getattr(text, "sliding_window", None) or 0)
    return tuple(window if t == SLIDING else 0 for t in types[: int(text.num_hidden_layers)])


def _gemma3_unsupported(text) -> list[str]:
    missing = []
    if getattr(text, "attn_logit_softcapping", None):
        missing.append("attention logit softcapping (attn_logit_softcapping) in the paged decode attention")
    if getattr(text, "final_logit_softcapping", None):
        missing.append("final logit softcapping (final_logit_softcapping) after the LM head")
    if getattr(text, "use_bidirectional_attention", False):
        missing.append("bidirectional attention (use_bidirectional_attention)")
    return missing


def _nothing_unsupported(text) -> list[str]:
    return []


@dataclass(frozen=True, slots=True)
class LayerRope:
    """One layer's rotary embedding: the model's own module, called as that layer's forward calls it
    (``layer_type`` None: ``rotary_emb(x, position_ids=...)``; else Gemma 3's ``rotary_emb(x, ids, type)``).
    ``rope_type`` and ``attention_scaling`` are what the module applies for that layer."""

    module: object
    layer_type: str | None = None

    def __call__(self, x, position_ids):
        if self.layer_type is None:
            return self.module(x, position_ids=position_ids)
        return self.module(x, position_ids, self.layer_type)

    @property
    def rope_type(self) -> str:
        kind = getattr(self.module, "rope_type", "default")
        return kind.get(self.layer_type, "?") if isinstance(kind, dict) else str(kind)

    @property
    def attention_scaling(self) -> float:
        if self.layer_type is None:
            return float(getattr(self.module, "attention_scaling", 1.0))
        return float(getattr(self.module, f"{self.layer_type}_attention_scaling", 1.0))

    @property
    def key(self) -> str:
        """Layers with the same key take the same position embeddings."""
        return self.layer_type or ""


@dataclass(frozen=True, slots=True)
class Family:
    """One decoder family. ``rope_per_layer_type``: its rotary module takes a layer type (Gemma 3)."""

    name: str
    windows: Callable[[object], tuple[int, ...]]
    rope_per_layer_type: bool = False
    unsupported: Callable[[object], list[str]] = _nothing_unsupported

    def layer_ropes(self, lm) -> list[LayerRope]:
        """Per layer of ``lm`` (the decoder stack) its rotary embedding (:class:`LayerRope`)."""
        layers = len(lm.layers)
        if not self.rope_per_layer_type:
            return [LayerRope(lm.rotary_emb)] * layers
        return [LayerRope(lm.rotary_emb, t) for t in list(lm.config.layer_types)[:layers]]

    def position_embeddings(self, lm, hidden, positions) -> list:
        """Per layer of ``lm`` (the decoder stack), the ``position_embeddings`` its layer takes for tokens at
        ``positions`` ``[B, T]``; ``hidden`` ``[B, T, hidden]`` gives the dtype and device. From the model's
        own rotary module, called once (or once per layer type)."""
        ropes = self.layer_ropes(lm)
        by_key = {}
        for rope in ropes:
            if rope.key not in by_key:
                by_key[rope.key] = rope(hidden, positions)
        return [by_key[rope.key] for rope in ropes]

    def mask_functions(self, text) -> list[Callable]:
        """Per layer the mask function of its attention (transformers' own: ``mask(b, h, q_idx, kv_idx)``,
        on absolute positions, broadcasting over index tensors): causal, and within its window for a sliding
        layer, as the model's own masks (``create_causal_mask`` / ``create_sliding_window_causal_mask``)."""
        from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

        return [
            sliding_window_causal_mask_function(w) if w else causal_mask_function for w in self.windows(text)
        ]


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", _no_windows),  # also Vicuna, Yi (model_type "llama")
        Family("mistral", _uniform_window),
        Family("qwen2", _typed_windows),
        Family("gemma3_text", _typed_windows, rope_per_layer_type=True, unsupported=_gemma3_unsupported),
    )
}


def family_of(text) -> Family:
    """The :class:`Family` of a decoder config (``config.text_config``); ConfigError naming the family and what
    vlkv is missing for it when it cannot be served."""
    name = str(getattr(text, "model_type", "") or "")
    family = FAMILIES.get(name)
    if family is None:
        raise ConfigError(
            f"decoder family {name!r} is not supported: vlkv has no entry for it in common/model/families.py "
            f"(how its layers take rotary position embeddings, which layers slide and by how much); "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    missing = family.unsupported(text)
    if missing:
        raise ConfigError(
            f"decoder family {name!r} with this config is not supported: vlkv lacks {'; '.join(missing)}"
        )
    windows = family.windows(text)
    if len(windows) != int(text.num_hidden_layers) or any(w < 0 or w == 1 for w in windows):
        raise ConfigError(f"decoder family {name!r}: sliding windows {windows} do not fit its layers")
    return family


def sliding_windows(text) -> tuple[int, ...]:
    """Per layer its sliding window ``W`` (0: reads the whole prompt); ConfigError as :func:`family_of`."""
    return family_of(text).windows(text)
