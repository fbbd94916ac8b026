"""``vlkv calibrate-reuse``: measure each layer's sensitivity to reused image K/V; store it beside the model.

For each of a few synthetic-task examples (training split), the image's K/V is cached under one text
prefix and the example is asked under another (the image moves: keys rotated, K/V computed under the
wrong prefix). ``S_l(r)`` is the output error when every layer reuses the cached K/V except that layer l
holds the correct K/V (from a full forward of this prompt) for the image's earliest ``r`` share of tokens,
``r = 0, 0.1, ..., 1``: the mean squared error of the logits (002's measure) at the positions of the
example's reference answer (appended to the prompt, teacher-forced), against the full forward's, averaged
over the examples. The result is JSON (``reuse_schedule.Calibration``) written to
``<model>/reuse_calibration.json``; prefill workers load it at start (only for the model whose fingerprint
it carries) and allocate per-layer recompute ratios from it greedily (``reuse_schedule.greedy_ratios``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import language_model, load_model, load_processor
from vlkv.common.reuse import ReuseSettings
from vlkv.deploy.calibrate.reuse_prompts import prompt_with_prefix, random_prefix
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.synthetic_task import make_examples
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.image_reuse import ImageReuser
from vlkv.prefill_worker.reuse_forward import ReusedImage, reuse_forward, rotate
from vlkv.prefill_worker.reuse_schedule import CALIBRATION_FILE, STEPS, Calibration

FULL = CompressionSettings("full", 1.0, 0.01)
METRIC = "MSE of the logits over the reference answer's positions (teacher-forced), reused vs full"


def mse(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    return float(((ref_logits.double() - logits.double()) ** 2).mean())


@torch.inference_mode()
def measure(engine: InProcessEngine, n: int = 8, seed: int = 0) -> Calibration:
    spec, model, proc = engine.spec, engine.model, engine.processor
    reuser = ImageReuser(model, spec, ImageCache(1 << 30))
    if reuser.unsupported:
        raise SystemExit(f"image reuse is not supported for this model: {reuser.unsupported}")
    rope = language_model(model).rotary_emb
    L = spec.num_layers
    layout = (L, spec.num_kv_heads, spec.head_dim)
    total = [[0.0] * (STEPS + 1) for _ in range(L)]
    rng = random.Random(seed)
    examples = [e for e in make_examples(4 * n, seed=seed, split="train") if len(e.images) == 1][:n]
    for ex in examples:
        prefix = random_prefix(rng)
        first = engine.prepare(ex.images, prompt_with_prefix(proc, ex, prefix), compression=FULL)
        text = prompt_with_prefix(proc, ex, random_prefix(rng, other=prefix)) + " " + ex.answer
        asked = engine.prepare(ex.images, text, compression=FULL)
        keep = len(proc.tokenizer(" " + ex.answer, add_special_tokens=False).input_ids)
        asked.reuse = first.reuse = ReuseSettings(mode="none", ratio=0.0)
        reuser.forward(first, None, 0)  # caches the image under the first prefix
        (img,) = reuser.images_of(asked)
        entry = reuser.cache.get(img.key, num_tokens=img.n, layout=layout, hidden=reuser.hidden)
        span = slice(img.start, img.start + img.n)
        stale_k = [rotate(k, img.start - entry.start, rope) for k in entry.keys]
        exact = ReusedImage(img.start, entry.features, stale_k, entry.values, [img.n] * L)  # all recomputed
        ref_logits, ref_k, ref_v = reuse_forward(model, asked.input_ids, [exact], logits_to_keep=keep)
        for layer in range(L):
            for step in range(STEPS + 1):
                t = math.ceil(round(step / STEPS * img.n, 6))
                keys, values = list(stale_k), list(entry.values)
                keys[layer] = torch.cat([ref_k[layer][:, span][:, :t], stale_k[layer][:, t:]], dim=1)
                values[layer] = torch.cat([ref_v[layer][:, span][:, :t], entry.values[layer][:, t:]], dim=1)
                image = ReusedImage(img.start, entry.features, keys, values, [0] * L)
                logits, _, _ = reuse_forward(model, asked.input_ids, [image], logits_to_keep=keep)
                total[layer][step] += mse(ref_logits, logits) / len(examples)
    return Calibration(spec.fingerprint, total, examples=len(examples), metric=METRIC)


def run(model_dir: str, n: int = 8, seed: int = 0, out: str = "") -> Path:
    torch.manual_seed(seed)
    cfg = ModelConfig(path=model_dir)
    engine = InProcessEngine(load_model(cfg), load_processor(cfg.path))
    cal = measure(engine, n, seed)
    path = Path(out) if out else Path(model_dir) / CALIBRATION_FILE
    path.write_text(cal.to_json() + "\n")
    return path
