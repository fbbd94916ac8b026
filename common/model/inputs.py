"""The processor step: images + prompt text -> input ids, pixel values and a modality map.

The modality map records where the vision tokens are; ``tau`` is the number of language tokens after the
last vision token (the post-vision rows VL-Cache scores with). A text-only prompt has no vision tokens and
tau = m.
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from PIL import Image
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


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says, read without decoding its pixels."""

    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def read_headers(blobs: list[bytes], limits: Limits) -> list[ImageHeader]:
    """The cheap checks, before any pixel is decoded: count, bytes, format, pixels per image and in total.

    Only headers are parsed here (a few KiB of each blob at most), so a request that would be refused for
    its size costs next to nothing."""
    if len(blobs) > limits.max_images:
        raise InvalidInput(f"{len(blobs)} images exceed the limit of {limits.max_images}")
    headers, total = [], 0
    for i, blob in enumerate(blobs):
        if not blob:
            raise InvalidInput(f"image {i} is empty")
        if len(blob) > limits.max_image_bytes:
            raise InvalidInput(f"image {i} has {len(blob)} bytes, over the limit of {limits.max_image_bytes}")
        with _undecodable(i):
            with Image.open(io.BytesIO(blob)) as img:
                fmt, (w, h) = img.format, img.size
        if fmt not in ALLOWED_FORMATS:
            raise InvalidInput(f"image {i} is {fmt}; only PNG and JPEG are accepted")
        if w * h > limits.max_image_pixels:
            raise InvalidInput(f"image {i} is {w}x{h}, over the limit of {limits.max_image_pixels} pixels")
        total += w * h
        if total > limits.max_request_pixels:
            raise InvalidInput(
                f"the images hold {total} pixels or more, over the limit of {limits.max_request_pixels} pixels "
                "per request"
            )
        headers.append(ImageHeader(fmt, w, h))
    return headers


def decode_images(
    blobs: list[bytes], limits: Limits, max_side: int = 0, headers: list[ImageHeader] | None = None
) -> list[Image.Image]:
    """Decode PNG/JPEG bytes into RGB images, enforcing byte and pixel limits (``read_headers``) first.

    ``max_side``: the largest side the model's processor resizes an image to (``input_side``); 0 keeps the
    images as sent. Larger images are decoded smaller, while still at least twice ``max_side`` on their
    short side (the processor's own resize then only downscales, as Pillow's ``thumbnail`` does): JPEG
    through the decoder's DCT scaling (``draft``: fewer pixels decoded at all), PNG by ``reduce`` right
    after decoding, so a request holds one full-size image at a time. ``headers``: ``read_headers``'s
    answer for these blobs, if the caller has it already."""
    headers = read_headers(blobs, limits) if headers is None else headers
    images = []
    for i, (blob, header) in enumerate(zip(blobs, headers, strict=True)):
        factor = min(header.width, header.height) // (2 * max_side) if max_side > 0 else 1
        with _undecodable(i):
            img = Image.open(io.BytesIO(blob))
            if factor >= 2 and img.format == "JPEG":
                img.draft("RGB", (header.width // factor, header.height // factor))
            img.load()
            factor = min(img.size) // (2 * max_side) if max_side > 0 else 1
            if factor >= 2:
                if img.mode not in _REDUCIBLE_MODES:
                    img = img.convert("RGB")
                img = img.reduce(factor)
            images.append(img.convert("RGB"))
            del img
    return images


_REDUCIBLE_MODES = {"RGB", "RGBA", "L", "LA", "I", "F"}


@contextmanager
def _undecodable(i: int):
    """Any failure of the image library on image ``i`` is the input's fault: InvalidInput, never UNKNOWN
    (Pillow raises SyntaxError, struct.error, EOFError, zlib.error ... on corrupt files)."""
    try:
        yield
    except InvalidInput:
        raise
    except MemoryError:
        raise InvalidInput(f"image {i} is too large to decode") from None
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raised, the bytes are to blame
        raise InvalidInput(f"image {i} cannot be decoded: {exc}") from None


def input_side(processor) -> int:
    """The largest side (pixels) the processor resizes or crops an image to, 0 if it does not say: the
    ``size``/``crop_size`` of a LLaVA image processor, the largest grid pinpoint of a LLaVA-NeXT one."""
    ip = getattr(processor, "image_processor", None)
    sides = []
    for name in ("size", "crop_size"):
        value = getattr(ip, name, None)
        if isinstance(value, int):
            sides.append(value)
            continue
        for key in _SIDE_KEYS:  # a dict, or transformers' SizeDict
            side = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
            if isinstance(side, int):
                sides.append(side)
    for point in getattr(ip, "image_grid_pinpoints", None) or ():
        sides += [v for v in point if isinstance(v, int)]
    return max(sides, default=0)


_SIDE_KEYS = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width")


def count_placeholders(text: str, processor) -> int:
    return text.count(processor.image_token)


def check_placeholders(prompt: str, processor, num_images: int) -> None:
    """InvalidInput unless the prompt holds exactly one image placeholder per image."""
    placeholders = count_placeholders(prompt, processor)
    if placeholders != num_images:
        raise InvalidInput(
            f"the prompt has {placeholders} image placeholders but {num_images} images were sent"
        )


def prepare_inputs(processor, images: list[Image.Image], prompt: str, image_token_id: int) -> PreparedInputs:
    """Run the model's processor; the prompt must hold exactly one placeholder per image."""
    check_placeholders(prompt, processor, len(images))
    try:
        batch = processor(images=images or None, text=prompt, return_tensors="pt")
    except Exception as exc:  # noqa: BLE001 - the inputs were checked; whatever it refuses is the input's
        raise InvalidInput(f"the processor rejected the input: {exc}") from None
    input_ids = batch.pop("input_ids")
    batch.pop("attention_mask", None)
    if input_ids.numel() == 0:
        raise InvalidInput("the prompt tokenizes to nothing")
    modality = ModalityMap.from_input_ids(input_ids, image_token_id)
    return PreparedInputs(input_ids=input_ids, model_kwargs=dict(batch), modality=modality)
