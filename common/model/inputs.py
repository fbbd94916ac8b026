"""The processor step: images + prompt text -> input ids, pixel values and a modality map.

The modality map records where the vision tokens are; ``tau`` is the number of language tokens after the
last vision token (the post-vision rows VL-Cache scores with). A text-only prompt has no vision tokens and
tau = m.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image, UnidentifiedImageError
from vlkv.common.config import Limits
from vlkv.common.errors import InvalidInput

ALLOWED_FORMATS = {"PNG", "JPEG"}


@dataclass
class ModalityMap:
    """Where the vision tokens sit in a prompt of m tokens."""

    m: int
    vision_spans: list[tuple[int, int]]  # [start, end) of each run of vision tokens

    @property
    def num_vision_tokens(self) -> int:
        return sum(e - s for s, e in self.vision_spans)

    @property
    def tau(self) -> int:
        """Language tokens after the last vision token (m for a text-only prompt)."""
        return self.m - self.vision_spans[-1][1] if self.vision_spans else self.m

    @classmethod
    def from_input_ids(cls, input_ids: torch.Tensor, image_token_id: int) -> ModalityMap:
        ids = input_ids.reshape(-1)
        is_vision = (ids == image_token_id).to(torch.int8)
        edges = torch.diff(
            is_vision, prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8)
        )
        starts = (edges == 1).nonzero().flatten().tolist()
        ends = (edges == -1).nonzero().flatten().tolist()
        return cls(m=ids.numel(), vision_spans=list(zip(starts, ends, strict=True)))


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # [1, m]
    model_kwargs: dict  # pixel_values, image_sizes, attention_mask ...
    modality: ModalityMap


def decode_images(blobs: list[bytes], limits: Limits) -> list[Image.Image]:
    """Decode PNG/JPEG bytes into RGB images, enforcing byte and pixel limits."""
    if len(blobs) > limits.max_images:
        raise InvalidInput(f"{len(blobs)} images exceed the limit of {limits.max_images}")
    images = []
    for i, blob in enumerate(blobs):
        if not blob:
            raise InvalidInput(f"image {i} is empty")
        if len(blob) > limits.max_image_bytes:
            raise InvalidInput(f"image {i} has {len(blob)} bytes, over the limit of {limits.max_image_bytes}")
        try:
            img = Image.open(io.BytesIO(blob))
            if img.format not in ALLOWED_FORMATS:
                raise InvalidInput(f"image {i} is {img.format}; only PNG and JPEG are accepted")
            w, h = img.size
            if w * h > limits.max_image_pixels:
                raise InvalidInput(
                    f"image {i} is {w}x{h}, over the limit of {limits.max_image_pixels} pixels"
                )
            img.load()
            images.append(img.convert("RGB"))
        except InvalidInput:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise InvalidInput(f"image {i} cannot be decoded: {exc}") from None
    return images


def count_placeholders(text: str, processor) -> int:
    return text.count(processor.image_token)


def prepare_inputs(processor, images: list[Image.Image], prompt: str, image_token_id: int) -> PreparedInputs:
    """Run the model's processor; the prompt must hold exactly one placeholder per image."""
    placeholders = count_placeholders(prompt, processor)
    if placeholders != len(images):
        raise InvalidInput(
            f"the prompt has {placeholders} image placeholders but {len(images)} images were sent"
        )
    try:
        batch = processor(images=images or None, text=prompt, return_tensors="pt")
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"the processor rejected the input: {exc}") from None
    input_ids = batch.pop("input_ids")
    batch.pop("attention_mask", None)
    if input_ids.numel() == 0:
        raise InvalidInput("the prompt tokenizes to nothing")
    modality = ModalityMap.from_input_ids(input_ids, image_token_id)
    return PreparedInputs(input_ids=input_ids, model_kwargs=dict(batch), modality=modality)
