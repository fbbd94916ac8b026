"""The prefill forward over a cached prefix: a follow-up turn prefills only the tokens after it.

``PrefixReuser.forward`` keys the prompt's full blocks (``common/prefix_key.py``: the ids, the digests this
worker computes of the images' pixel values, never the request's own hashes, the model, the tenant), finds
the longest run the prefix cache holds, and runs the model's own forward over the rest of the prompt with
those K/V as its past (``DynamicCache``): positions, masks (sliding windows too) and rotary embeddings are
the model's, so every family the worker serves takes this path. Images after the cached prefix run through
the vision tower; images inside it do not. Then every full block of the prompt is stored.

The statistics read query rows from ``q_start``: the prefix used ends at or before it (and before the last
token, whose logits are sampled), so a policy that reads the history's rows gets them recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.loading import language_model
from vlkv.common.model.spec import ModelSpec
from vlkv.common.prefix_key import block_keys, image_starts, prefix_seed
from vlkv.common.request import PreparedRequest
from vlkv.common.reuse import ANONYMOUS, image_hashes
from vlkv.prefill_worker.prefix_cache import PrefixCache

SHARED_TENANT = "*"  # the tenant in every key when tenants are configured to share prefixes


@dataclass
class PrefixReport:
    """What the prefix cache did for one request (usage): prompt tokens served from it, blocks stored."""

    cached_tokens: int = 0
    stored_blocks: int = 0


class PrefixReuser:
    def __init__(self, model, spec: ModelSpec, cache: PrefixCache, share_tenants: bool = False) -> None:
        self.model = model
        self.spec = spec
        self.cache = cache
        self.share_tenants = share_tenants
        self.lm = language_model(model)

    @property
    def active(self) -> bool:
        return self.cache.enabled

    def keys_of(self, req: PreparedRequest) -> tuple[list[str], list[int]]:
        """The prompt's block keys and each image's first token (computed once per request: ``forward``
        and ``store`` take them)."""
        pixels = req.model_inputs.get("pixel_values")
        digests = image_hashes(pixels, req.model_inputs.get("image_sizes")) if pixels is not None else []
        ids = req.input_ids.reshape(-1).numpy()
        starts = image_starts(ids, self.spec.image_token_id, req.image_tokens, len(digests))
        tenant = SHARED_TENANT if self.share_tenants else (req.tenant or ANONYMOUS)
        seed = prefix_seed(self.spec.fingerprint, tenant, self.cache.block)
        return block_keys(ids, digests, starts, seed, self.cache.block), starts

    def forward(self, req: PreparedRequest, observer, q_start: int, keyed: tuple[list[str], list[int]]):
        """``(logits, keys, values, PrefixReport)`` from the cached prefix, or None when nothing usable is
        cached (the caller runs its own forward, then ``store``). ``keyed``: ``keys_of(req)``."""
        keys, starts = keyed
        layout = (self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)
        ids = req.input_ids.reshape(-1).tolist()
        blocks = self.cache.lookup(keys, ids, layout, self.spec.dtype)
        m = req.m
        limit = m - 1 if observer is None else min(q_start, m - 1)
        p = min(len(blocks) * self.cache.block, limit)
        spans = req.modality.vision_spans
        for s, e in spans:  # never start inside a run of image tokens
            if s < p < e:
                p = s
        if p <= 0:
            return None
        self.cache.count_hit(p)
        k = torch.cat([b.keys for b in blocks], dim=2)[:, :, :p]  # [L, H_kv, p, D]
        v = torch.cat([b.values for b in blocks], dim=2)[:, :, :p]
        first_image = sum(1 for s in starts if s < p)  # images wholly inside the prefix
        logits, k_out, v_out = self._suffix_forward(req, k, v, p, first_image, observer)
        return logits, k_out, v_out, PrefixReport(cached_tokens=p)

    def store(self, req: PreparedRequest, k_layers: list, v_layers: list, keys: list[str]) -> int:
        return self.cache.insert(keys, req.input_ids.reshape(-1).tolist(), k_layers, v_layers)

    @torch.inference_mode()
    def _suffix_forward(self, req: PreparedRequest, k, v, p: int, first_image: int, observer):
        device = self.lm.embed_tokens.weight.device
        ids = req.input_ids.reshape(1, -1)[:, p:].to(device)
        past = DynamicCache(
            ddp_cache_data=[(k[i][None].to(device), v[i][None].to(device)) for i in range(len(k))]
        )
        embeds = self.lm.embed_tokens(ids)
        if bool((ids == self.spec.image_token_id).any()):
            feats = self._image_features(req, first_image)
            mask = (ids == self.spec.image_token_id)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, torch.cat(feats).to(embeds.dtype))
        out = self.model(
            inputs_embeds=embeds,
            **cache_arg(self.model, past),
            use_cache=True,
            logits_to_keep=1,
            vlkv_stats=observer,
        )
        layers = past.layers[: self.spec.num_layers]
        return out.logits[0, -1].float(), [x.keys[0] for x in layers], [x.values[0] for x in layers]

    def _image_features(self, req: PreparedRequest, first: int) -> list[torch.Tensor]:
        """The vision tower and projector over images ``first ..`` only: one ``[n, hidden]`` per image."""
        cfg = self.model.config
        inputs = {k: t.to(self.lm.embed_tokens.weight.device) for k, t in req.model_inputs.items()}
        sizes = inputs.get("image_sizes")
        out = self.model.model.get_image_features(
            pixel_values=inputs["pixel_values"][first:].to(self.model.dtype),
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            image_sizes=sizes[first:] if sizes is not None else None,
        )
        return list(out.pooler_output)
