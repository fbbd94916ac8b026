"""The vision side of the real-decoder members (``smol_objects``, ``smol_codes``): a tiny CLIP tower and
LLaVA's projector, aligned to SmolLM2's word embeddings without running the decoder.

Images follow the zoo's visual language (``lab/vlkv_lab/task/synthetic_task``: a dark background, silhouettes
with a light outline, each shape with its own texture whose period puts two repeats in every 14-pixel
patch, colours jittered): a 196 x 196 canvas of 14-pixel patches, **14 x 14 = 196 vision tokens**, one
object per image, 6 x 6 patches wide.

Alignment (stage 1, ``align``): every vision token's projected embedding is trained to equal the decoder's
input embedding of a word describing its patch: on an object, its colour word on patches whose
``row + col`` is even and its shape word on the others (the object then reads ``red circle red circle
...``); elsewhere the background word ``.``. The loss is the squared error to that embedding row plus a
cross-entropy over the descriptor words (dot products with their rows), so each token lands on its word
and not between two. A pretrained decoder then reads the image as text it knows.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch
from PIL import Image
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, LlavaConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Geometry, Obj, render_image

from vlkv_lab.zoo.scenes import place

GEOM = Geometry(image=196, patch=14, span=6)
TOKENS_PER_IMAGE = GEOM.grid * GEOM.grid  # 196
BACKGROUND_WORD = "."
DESCRIPTORS: tuple[str, ...] = (*COLOURS, *SHAPES, BACKGROUND_WORD)
"""The words vision tokens are aligned to (each one token of SmolLM2's tokenizer after a space)."""


def vision_config() -> CLIPVisionConfig:
    """A 2-layer CLIP tower, hidden 64: 196 patch tokens (+ CLS, dropped by LLaVA's "default" strategy)."""
    return CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=GEOM.image,
        patch_size=GEOM.patch,
        num_channels=3,
        projection_dim=64,
    )


class VisionParts(nn.Module):
    """``vision_tower`` + ``multi_modal_projector`` as LLaVA holds them (state-dict keys match the LLaVA
    model's ``model.*`` once prefixed), and LLaVA's feature path: the last hidden state, CLS dropped."""

    def __init__(self, text_config, vconfig: CLIPVisionConfig | None = None):
        super().__init__()
        vconfig = vconfig or vision_config()
        llava = LlavaConfig(  # a copy: LlavaConfig resets the text config's attention implementation
            vision_config=vconfig,
            text_config=copy.deepcopy(text_config),
            projector_hidden_act="gelu",
            vision_feature_select_strategy="default",
            vision_feature_layer=-1,
        )
        self.vision_tower = CLIPVisionModel(vconfig)
        self.multi_modal_projector = LlavaMultiModalProjector(llava)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states[-1][:, 1:]
        return self.multi_modal_projector(hidden)  # [images, TOKENS_PER_IMAGE, text hidden]

    def llava_state(self) -> dict[str, torch.Tensor]:
        """Weights keyed as in ``LlavaForConditionalGeneration.state_dict()``."""
        return {f"model.{k}": v.detach().clone() for k, v in self.state_dict().items()}


def draw_object(rng: random.Random, colour: str, shape: str) -> tuple[Image.Image, Obj]:
    """One object (``shape`` in ``colour``) at a random patch-aligned place."""
    (obj,) = place(rng, [(shape, colour)], GEOM)
    return render_image([obj], rng, GEOM), obj


def patch_words(image: Image.Image, obj: Obj, min_cover: float = 0.5) -> list[str]:
    """Per vision token (row-major) its descriptor word: the object's colour / shape word on the patches it
    covers at least ``min_cover`` of (colour where row + col is even), else the background word. Coverage is
    read off the pixels (away from the background colour of the corner pixel)."""
    px = np.asarray(image, dtype=np.int16)
    fg = np.abs(px - px[0, 0]).max(axis=-1) > 24
    n, p = GEOM.grid, GEOM.patch
    cover = fg[: n * p, : n * p].reshape(n, p, n, p).mean(axis=(1, 3))
    words = []
    for r in range(n):
        for c in range(n):
            if cover[r, c] >= min_cover:
                words.append(obj.colour if (r + c) % 2 == 0 else obj.shape)
            else:
                words.append(BACKGROUND_WORD)
    return words


def descriptor_ids(tokenizer) -> list[int]:
    ids = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in DESCRIPTORS]
    if any(len(i) != 1 for i in ids):
        raise ValueError(
            f"descriptor words must be single tokens: {dict(zip(DESCRIPTORS, ids, strict=True))}"
        )
    return [i[0] for i in ids]


def align(
    parts: VisionParts,
    embed: torch.Tensor,
    tokenizer,
    image_processor,
    *,
    steps: int,
    batch: int = 8,
    pool: int = 512,
    lr: float = 3e-3,
    seed: int = 0,
    log=print,
) -> dict:
    """Stage 1: train ``parts`` so each vision token's embedding equals its patch's descriptor word's row of
    ``embed`` (the decoder's input embeddings, frozen), on batches drawn from ``pool`` images rendered once.
    Returns the final per-token word accuracy on 64 fresh images (nearest descriptor row by dot product)."""
    ids = torch.tensor(descriptor_ids(tokenizer))
    rows = embed[ids].detach().float()  # [words, hidden]
    scale = rows.pow(2).sum(-1).mean()
    index = {w: i for i, w in enumerate(DESCRIPTORS)}
    rng = random.Random(f"vlkv-smol-align/{seed}")
    opt = torch.optim.AdamW(parts.parameters(), lr=lr, weight_decay=0.0)

    def draw(n: int):
        images, labels = [], []
        for _ in range(n):
            image, obj = draw_object(rng, rng.choice(list(COLOURS)), rng.choice(SHAPES))
            images.append(image)
            labels.append([index[w] for w in patch_words(image, obj)])
        pixels = image_processor(images=images, return_tensors="pt")["pixel_values"]
        return pixels, torch.tensor(labels)

    pool_pixels, pool_labels = draw(pool)  # rendered once: the steps are compute only
    parts.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        pick = torch.tensor(rng.sample(range(pool), batch))
        pixels, labels = pool_pixels[pick], pool_labels[pick]
        out = parts(pixels)
        mse = (out - rows[labels]).pow(2).sum(-1).mean() / scale
        ce = nn.functional.cross_entropy((out @ rows.T).flatten(0, 1), labels.flatten())
        loss = mse + ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log(f"align step {step}: mse {mse.item():.4f} ce {ce.item():.4f}")
    parts.eval()
    with torch.no_grad():
        pixels, labels = draw(64)
        out = parts(pixels)
        acc = (out @ rows.T).argmax(-1).eq(labels).float().mean().item()
        rel = ((out - rows[labels]).norm(dim=-1) / rows[labels].norm(dim=-1)).mean().item()
    log(f"align: word accuracy {acc:.4f}, relative error {rel:.4f}")
    return {"word_accuracy": acc, "relative_error": rel}
