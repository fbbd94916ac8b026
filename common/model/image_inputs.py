"""What a model's processor produces for images, so a worker can check tensors it did not produce itself.

The prefill worker never runs the processor: the gateway sends its output (``pixel_values`` and, for
LLaVA-NeXT, ``image_sizes``). :class:`ImageInputs` holds the facts that output must agree with, taken from
the processor and the model's config once per worker: which tensors the model takes, their dtypes, the
pixel tile shape, how many tiles an image of a given size has (NeXT), and how many image tokens each image
turns into (the processor's own count, ``_get_num_multimodal_tokens``, the figure it expanded the
placeholders with). ``check_layout`` looks only at names, dtypes and shapes (before any tensor is built);
``image_tokens`` reads ``image_sizes`` and answers the image-token count of every image. Both raise
InvalidInput naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vlkv.common.errors import InvalidInput

PIXEL_DTYPES = ("float32", "float16", "bfloat16")
SIZE_DTYPES = ("int64", "int32")


@dataclass(frozen=True)
class ImageInputs:
    next_style: bool  # LLaVA-NeXT: tiles per image and image_sizes; LLaVA-1.5: one tile, no image_sizes
    channels: int
    tile: tuple[int, int]  # (height, width) of one tile of pixel_values
    max_images: int
    max_image_pixels: int  # bound on an image_sizes entry's height * width
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    vision_side: int = 0  # the vision tower's input side (NeXT tiles are cut at this size)
    processor: object = None  # answers the image-token counts (``_get_num_multimodal_tokens``)

    @classmethod
    def from_processor(cls, processor, config, max_images: int, max_image_pixels: int) -> ImageInputs:
        ip = processor.image_processor
        crop = getattr(ip, "crop_size", None) or getattr(ip, "size", None)
        height = _side(crop, "height", "shortest_edge")
        width = _side(crop, "width", "shortest_edge")
        vision = config.vision_config
        pinpoints = getattr(config, "image_grid_pinpoints", None) or getattr(ip, "image_grid_pinpoints", None)
        next_style = config.model_type == "llava_next"
        if next_style and not pinpoints:
            raise ValueError("a LLaVA-NeXT model without image_grid_pinpoints")
        return cls(
            next_style=next_style,
            channels=int(getattr(vision, "num_channels", 3)),
            tile=(height, width),
            max_images=max_images,
            max_image_pixels=max_image_pixels,
            grid_pinpoints=tuple(tuple(int(v) for v in p) for p in pinpoints or ()),
            vision_side=int(vision.image_size),
            processor=processor,
        )

    @property
    def names(self) -> frozenset[str]:
        return frozenset({"pixel_values", "image_sizes"} if self.next_style else {"pixel_values"})

    @property
    def max_tiles(self) -> int:
        """Tiles of a NeXT image at most: its base tile plus the largest grid's."""
        s = self.vision_side
        return 1 + max((h // s) * (w // s) for h, w in self.grid_pinpoints) if self.next_style else 1

    def check_layout(self, layout: dict[str, tuple[str, tuple[int, ...]]]) -> int:
        """``layout``: name -> (dtype, shape) of every model input. The number of images they hold."""
        unknown = set(layout) - self.names
        if unknown:
            allowed = ", ".join(sorted(self.names))
            raise InvalidInput(
                f"model_inputs: {sorted(unknown)} are not inputs of this model (it takes {allowed})"
            )
        if not layout:
            return 0
        if set(layout) != self.names:
            raise InvalidInput(f"model_inputs: this model takes {', '.join(sorted(self.names))} together")
        dtype, shape = layout["pixel_values"]
        if dtype not in PIXEL_DTYPES:
            raise InvalidInput(f"model_inputs[pixel_values]: dtype {dtype!r} is not one of {PIXEL_DTYPES}")
        tiles = (None,) if self.next_style else ()
        want = (None, *tiles, self.channels, *self.tile)
        if len(shape) != len(want) or any(w is not None and w != s for w, s in zip(want, shape, strict=True)):
            raise InvalidInput(f"model_inputs[pixel_values]: shape {list(shape)} is not {_shape_text(want)}")
        n = shape[0]
        if not 1 <= n <= self.max_images:
            raise InvalidInput(f"model_inputs[pixel_values]: {n} images, not in [1, {self.max_images}]")
        if self.next_style:
            if not 1 <= shape[1] <= self.max_tiles:
                raise InvalidInput(
                    f"model_inputs[pixel_values]: {shape[1]} tiles, not in [1, {self.max_tiles}]"
                )
            sizes_dtype, sizes_shape = layout["image_sizes"]
            if sizes_dtype not in SIZE_DTYPES or tuple(sizes_shape) != (n, 2):
                raise InvalidInput(
                    f"model_inputs[image_sizes]: {sizes_dtype} {list(sizes_shape)} is not one (height, width) "
                    f"pair per image ({n}, 2) of {' or '.join(SIZE_DTYPES)}"
                )
        return n

    def image_tokens(self, tensors: dict[str, torch.Tensor]) -> list[int]:
        """The image-token count of every image (``check_layout`` passed): what the processor expanded each
        image's placeholder to, for these pixel values and image sizes."""
        pixels = tensors.get("pixel_values")
        if pixels is None:
            return []
        n = int(pixels.shape[0])
        if not self.next_style:
            sizes = [list(self.tile)] * n
        else:
            sizes = tensors["image_sizes"].tolist()
            for h, w in sizes:
                if not (1 <= h and 1 <= w and h * w <= self.max_image_pixels):
                    raise InvalidInput(
                        f"model_inputs[image_sizes]: {h}x{w} is outside [1, {self.max_image_pixels}] pixels"
                    )
            tiles = max(self.tiles_of(h, w) for h, w in sizes)
            if tiles != pixels.shape[1]:
                raise InvalidInput(
                    f"model_inputs[pixel_values]: {pixels.shape[1]} tiles per image where image_sizes need {tiles}"
                )
        counts = self.processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
        return [int(c) for c in counts]

    def tiles_of(self, height: int, width: int) -> int:
        """Tiles of a NeXT image of ``height`` x ``width`` (the model's own count)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return int(
            image_size_to_num_patches(
                (height, width), [list(p) for p in self.grid_pinpoints], self.vision_side
            )
        )


def _side(size, key: str, fallback: str) -> int:
    if isinstance(size, int):
        return size
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    if value is None:
        value = size.get(fallback) if isinstance(size, dict) else getattr(size, fallback, None)
    return int(value)


def _shape_text(shape) -> str:
    return (
        "["
        + ", ".join(
            "n" if i == 0 and s is None else "tiles" if s is None else str(s) for i, s in enumerate(shape)
        )
        + "]"
    )
