"""The prefill forward through the image cache: reuse an image's K/V on a hit, fill the cache on a miss.

``ImageReuser.forward`` looks up every image of the request (key: model fingerprint, the digest this worker
computes of the image's pixel values, the caller's tenant). When all of them hit, the vision tower is skipped and ``reuse_forward`` runs
with each image placed at its position in this prompt (keys rotated) and a share of its earliest tokens
recomputed per layer (``reuse_schedule.layer_ratios``: the request's mode and ratio); an image whose prefix
(ids and images before and including it) is exactly the one it was computed under recomputes nothing. When
any image misses, the whole prompt runs the normal forward (the vision tower once, the language model over
all m tokens, from the same embeddings the model would build itself) and every image is stored.
Reuse is skipped (normal forward, cache filled) when the policy's statistics need query rows inside the
images (H2O, ZipCache: every row), or the prompt ends with an image token.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from vlkv.common.errors import InvalidInput
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.loading import language_model
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest
from vlkv.common.reuse import ANONYMOUS, image_hashes
from vlkv.prefill_worker.image_cache import ImageCache, ImageEntry, ImageKey
from vlkv.prefill_worker.reuse_forward import ReusedImage, reuse_forward, reuse_supported, rotate_layers
from vlkv.prefill_worker.reuse_schedule import Calibration, layer_ratios, load_calibration, recomputed_counts

log = logging.getLogger(__name__)


@dataclass
class ReuseReport:
    """What the image cache did for one request (usage): images looked up, reused, exact-prefix hits, and
    the image tokens recomputed (in the first layer; ``ratio``: share of image token-layers recomputed)."""

    images: int = 0
    hit: bool = False
    exact: int = 0
    recomputed_tokens: int = 0
    ratio: float = 1.0
    mode: str = ""
    layer_ratios: tuple[float, ...] = ()


@dataclass
class _Image:
    start: int
    n: int
    key: ImageKey
    prefix_hash: str


class ImageReuser:
    def __init__(self, model, spec: ModelSpec, cache: ImageCache, calibration: Calibration | None = None):
        self.model = model
        self.spec = spec
        self.cache = cache
        self.lm = language_model(model)
        self.hidden = int(self.lm.config.hidden_size)
        self.unsupported = reuse_supported(model)
        if self.unsupported:
            log.warning("image cache off: %s", self.unsupported)
        if calibration is None:
            path = getattr(model, "name_or_path", "") or ""
            calibration = load_calibration(path, spec.fingerprint, spec.num_layers) if path else None
        self.calibration = calibration
        self.hint_mismatches = 0  # requests whose image_hashes were not the digests of their pixel values

    @property
    def active(self) -> bool:
        return self.cache.enabled and not self.unsupported

    def images_of(self, req: PreparedRequest) -> list[_Image]:
        """Where each image's tokens sit (one contiguous run per image, of ``req.image_tokens`` tokens, equal
        shares without them) and its cache key: the digest of the pixel values this worker runs, never the
        request's own ``image_hashes`` (the gateway's hint, compared here: a mismatch is logged and counted)."""
        pixels = req.model_inputs.get("pixel_values")
        if pixels is None or pixels.shape[0] == 0:
            return []
        hashes = image_hashes(pixels, req.model_inputs.get("image_sizes"))
        if req.image_hashes and req.image_hashes != hashes:
            self.hint_mismatches += 1
            log.warning(
                "request %s: the image hashes it names are not those of its pixel values (%d so far); keyed on "
                "the pixel values",
                req.request_id,
                self.hint_mismatches,
            )
        ids = req.input_ids.reshape(-1)
        where = (ids == self.spec.image_token_id).nonzero().flatten()
        count = len(hashes)
        counts = list(req.image_tokens) or (
            [where.numel() // count] * count if where.numel() % count == 0 else []
        )
        if len(counts) != count or sum(counts) != where.numel():
            raise InvalidInput("the image tokens do not match the images")
        tenant = req.tenant or ANONYMOUS
        out, first = [], 0
        for i, n in enumerate(counts):
            pos = where[first : first + n]
            first += n
            start = int(pos[0])
            if int(pos[-1]) - start != n - 1:
                raise InvalidInput("an image's tokens are not contiguous")
            prefix = hashlib.blake2b(digest_size=16)
            prefix.update(ids[: start + n].numpy().astype("<i8").tobytes())
            prefix.update("|".join(hashes[: i + 1]).encode())
            key = ImageKey(self.spec.fingerprint, hashes[i], tenant)
            out.append(_Image(start, n, key, prefix.hexdigest()))
        return out

    def forward(self, req: PreparedRequest, observer, q_start: int):
        """``(logits, keys, values, ReuseReport)``; the cache is read and filled here."""
        settings = req.reuse
        if not settings.enabled:
            return (*self.full_forward(req, observer), ReuseReport(mode=settings.mode))
        images = self.images_of(req)
        report = ReuseReport(images=len(images), mode=settings.mode)
        if not images:
            return (*self.full_forward(req, observer), report)
        last_end = max(img.start + img.n for img in images)
        can_reuse = last_end < req.m and (observer is None or q_start >= last_end)
        entries = []
        if can_reuse:
            layout = (self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)
            for img in images:
                entries.append(self.cache.get(img.key, num_tokens=img.n, layout=layout, hidden=self.hidden))
        if can_reuse and all(e is not None for e in entries):
            logits, keys, values = self._reuse(req, images, entries, observer, report)
            return logits, keys, values, report
        features = self.image_features(req)
        logits, keys, values = self.full_forward(req, observer, features)
        for img, feats in zip(images, features, strict=True):
            span = slice(img.start, img.start + img.n)
            entry = ImageEntry(
                fingerprint=self.spec.fingerprint,
                features=feats.detach().clone(),
                keys=[k[:, span].clone() for k in keys],
                values=[v[:, span].clone() for v in values],
                start=img.start,
                prefix_hash=img.prefix_hash,
            )
            self.cache.put(img.key, entry)
        return logits, keys, values, report

    def _reuse(self, req, images, entries, observer, report: ReuseReport):
        settings = req.reuse
        L = self.spec.num_layers
        ratios = layer_ratios(settings.mode, settings.ratio, L, self.calibration)
        reused, work, total = [], 0, 0
        for img, entry in zip(images, entries, strict=True):
            exact = entry.prefix_hash == img.prefix_hash and entry.start == img.start
            counts = [0] * L if exact else recomputed_counts(ratios, img.n)
            report.exact += int(exact)
            delta = img.start - entry.start
            reused.append(
                ReusedImage(
                    start=img.start,
                    features=entry.features,
                    keys=rotate_layers(entry.keys, delta, self.model),  # each layer by its own rope
                    values=entry.values,
                    counts=counts,
                )
            )
            report.recomputed_tokens += counts[0]
            work += sum(counts)
            total += L * img.n
        report.hit = True
        report.ratio = work / total if total else 0.0
        report.layer_ratios = tuple(ratios)
        logits, keys, values = reuse_forward(self.model, req.input_ids, reused, observer)
        return logits, keys, values

    @torch.inference_mode()
    def image_features(self, req: PreparedRequest) -> list[torch.Tensor]:
        """The vision tower and projector: one ``[n, hidden]`` tensor per image."""
        cfg = self.model.config
        kwargs = {k: v.to(self.lm.embed_tokens.weight.device) for k, v in req.model_inputs.items()}
        pixels = kwargs.pop("pixel_values").to(self.model.dtype)
        out = self.model.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            image_sizes=kwargs.get("image_sizes"),
        )
        return list(out.pooler_output)

    @torch.inference_mode()
    def full_forward(self, req: PreparedRequest, observer, features: list[torch.Tensor] | None = None):
        """The whole prompt through the model from the embeddings (image features scattered in at the image
        tokens, as the model itself does): logits ``[vocab]`` and per-layer K, V ``[H_kv, m, D]``."""
        if features is None:
            features = self.image_features(req) if "pixel_values" in req.model_inputs else []
        device = self.lm.embed_tokens.weight.device
        ids = req.input_ids.to(device)
        embeds = self.lm.embed_tokens(ids)
        if features:
            mask = (ids == self.spec.image_token_id)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, torch.cat(features).to(embeds.dtype))
        cache = DynamicCache()  # every layer's whole prompt, as ``PrefillEngine.forward``
        out = self.model(
            inputs_embeds=embeds,
            **cache_arg(self.model, cache),
            use_cache=True,
            logits_to_keep=1,
            vlkv_stats=observer,
        )
        layers = cache.layers[: self.spec.num_layers]
        return out.logits[0, -1].float(), [x.keys[0] for x in layers], [x.values[0] for x in layers]
