"""The prefill worker's one validation of a PrefillRequest (``request.from_prefill_proto`` with the model's
``ImageInputs``), before any model code: every inconsistent or malformed field the internal-API probe of
issue 33 found is INVALID_ARGUMENT naming the field, for LLaVA-1.5 and LLaVA-NeXT."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig
from vlkv.common.config import Limits
from vlkv.common.errors import InvalidInput
from vlkv.common.model.image_inputs import ImageInputs
from vlkv.common.model.loading import load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import from_prefill_proto, prepare_request, tensor_to_proto, to_prefill_proto
from vlkv.deploy.client import build_request
from vlkv.v1 import worker_pb2


def _png(seed: int, width: int, height: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


class Model:
    def __init__(self, path: str) -> None:
        self.processor = load_processor(path)
        self.spec = ModelSpec.from_checkpoint(path, torch.float32, self.processor.tokenizer)
        self.images = ImageInputs.from_processor(
            self.processor, AutoConfig.from_pretrained(path), 8, 40_000_000
        )

    def request(self, n_images: int = 1, sizes=((40, 30),)) -> worker_pb2.PrefillRequest:
        pngs = [_png(i, *sizes[i % len(sizes)]) for i in range(n_images)]
        pb = build_request(images=pngs, question="what colour is the square ?", max_new_tokens=4)
        req = prepare_request(pb, self.processor, self.spec, Limits(), default_seed=1)
        req.request_id = "r1"
        return to_prefill_proto(req, "127.0.0.1:1")

    def parse(self, pb: worker_pb2.PrefillRequest):
        return from_prefill_proto(pb, self.spec, Limits(), self.images)


@pytest.fixture(scope="module")
def llava(tiny_model_dirs):
    return Model(tiny_model_dirs("llava-gqa"))


@pytest.fixture(scope="module")
def llava_next(tiny_model_dirs):
    return Model(tiny_model_dirs("llava_next-gqa"))


def _tensor(pb, name: str) -> worker_pb2.Tensor:
    return next(t for t in pb.model_inputs if t.name == name)


def _set_ids(pb, ids) -> None:
    del pb.input_ids[:]
    pb.input_ids.extend(ids)


def _set_spans(pb, spans) -> None:
    del pb.vision_spans[:]
    pb.vision_spans.extend(spans)


def _replace(pb, name: str, t: torch.Tensor) -> None:
    _tensor(pb, name).CopyFrom(tensor_to_proto(name, t))


def _raw(pb, name: str, shape, data: bytes = b"", dtype: str | None = None) -> None:
    t = _tensor(pb, name)
    del t.shape[:]
    t.shape.extend(shape)
    t.data = data
    if dtype is not None:
        t.dtype = dtype


def _image_token(model) -> int:
    return model.spec.image_token_id


def _extra_image_token(model, pb):
    ids = list(pb.input_ids)
    start, end = pb.vision_spans[0], pb.vision_spans[1]
    _set_ids(pb, ids[:end] + [_image_token(model)] + ids[end:])
    _set_spans(pb, [start, end + 1])


def _missing_image_token(model, pb):
    ids = list(pb.input_ids)
    start, end = pb.vision_spans[0], pb.vision_spans[1]
    _set_ids(pb, ids[: end - 1] + ids[end:])
    _set_spans(pb, [start, end - 1])


def _pixels_for(k):
    def bad(model, pb):
        pixels = torch.randn(k, *list(_tensor(pb, "pixel_values").shape)[1:])
        _replace(pb, "pixel_values", pixels)

    return bad


CASES = {
    # (mutation, field the message names)
    "one image token more": (_extra_image_token, "input_ids"),
    "one image token short": (_missing_image_token, "input_ids"),
    "pixels for 2 images, one span": (_pixels_for(2), "input_ids|image_sizes"),
    "pixels for 44 images": (_pixels_for(44), "pixel_values"),
    "pixel_values [0, 2^64-1]": (lambda m, pb: _raw(pb, "pixel_values", [0, 2**64 - 1]), "pixel_values"),
    "pixel_values of no image": (
        lambda m, pb: _raw(pb, "pixel_values", [0, *_tensor(pb, "pixel_values").shape[1:]]),
        "pixel_values",
    ),
    "4-channel pixels": (
        lambda m, pb: _replace(
            pb,
            "pixel_values",
            torch.randn(
                *[
                    4 if i == len(_tensor(pb, "pixel_values").shape) - 3 else d
                    for i, d in enumerate(_tensor(pb, "pixel_values").shape)
                ]
            ),
        ),
        "pixel_values",
    ),
    "NaN pixels": (
        lambda m, pb: _replace(
            pb, "pixel_values", torch.full(list(_tensor(pb, "pixel_values").shape), float("nan"))
        ),
        "pixel_values",
    ),
    "int pixels": (
        lambda m, pb: _replace(
            pb, "pixel_values", torch.zeros(list(_tensor(pb, "pixel_values").shape), dtype=torch.int64)
        ),
        "pixel_values",
    ),
    "truncated bytes": (
        lambda m, pb: setattr(_tensor(pb, "pixel_values"), "data", _tensor(pb, "pixel_values").data[:-4]),
        "pixel_values",
    ),
    "overlapping spans": (
        lambda m, pb: _set_spans(
            pb, [pb.vision_spans[0], pb.vision_spans[1], pb.vision_spans[0], pb.vision_spans[1]]
        ),
        "vision_spans",
    ),
    "1M span pairs": (lambda m, pb: _set_spans(pb, [0, 1] * 1_000_000), "vision_spans"),
    "unsorted spans": (
        lambda m, pb: _set_spans(pb, [pb.vision_spans[1], pb.vision_spans[0]]),
        "vision_spans",
    ),
    "span off the image tokens": (
        lambda m, pb: _set_spans(pb, [pb.vision_spans[0] + 1, pb.vision_spans[1] + 1]),
        "vision_spans",
    ),
    "span past the prompt": (lambda m, pb: _set_spans(pb, [0, len(pb.input_ids) + 5]), "vision_spans"),
    "no spans": (lambda m, pb: _set_spans(pb, []), "vision_spans"),
    "id outside the vocabulary": (lambda m, pb: _set_ids(pb, [*pb.input_ids[:-1], 10**6]), "input_ids"),
    "64 KB request_id": (lambda m, pb: setattr(pb, "request_id", "x" * 65536), "request_id"),
    "unknown tensor": (
        lambda m, pb: pb.model_inputs.add().CopyFrom(
            tensor_to_proto("attention_mask", torch.ones(1, 3, dtype=torch.int64))
        ),
        "model_inputs",
    ),
    "tensor sent twice": (
        lambda m, pb: pb.model_inputs.add().CopyFrom(_tensor(pb, "pixel_values")),
        "pixel_values",
    ),
    "no pixels, image tokens": (
        lambda m, pb: [pb.model_inputs.remove(t) for t in list(pb.model_inputs)],
        "input_ids",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", ["llava", "llava_next"])
def test_inconsistent_prefill_requests_are_invalid_argument_naming_the_field(request, model, case):
    m = request.getfixturevalue(model)
    pb = m.request()
    m.parse(pb)  # the unchanged request passes
    mutate, field = CASES[case]
    mutate(m, pb)
    with pytest.raises(InvalidInput, match=field):
        m.parse(pb)


def test_llava_1_5_takes_no_image_sizes(llava):
    pb = llava.request()
    pb.model_inputs.add().CopyFrom(tensor_to_proto("image_sizes", torch.tensor([[30, 40]])))
    with pytest.raises(InvalidInput, match="image_sizes"):
        llava.parse(pb)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([[2**40, 2**40]], "image_sizes"),  # huge
        ([[0, 30]], "image_sizes"),
        ([[30, 40], [30, 40]], "image_sizes"),  # two rows for one image
        ([[64, 64]], "tiles"),  # an image this size has more tiles than were sent
    ],
)
def test_llava_next_image_sizes_are_one_bounded_pair_per_image(llava_next, sizes, message):
    pb = llava_next.request(sizes=((20, 40),))
    _replace(pb, "image_sizes", torch.tensor(sizes))
    with pytest.raises(InvalidInput, match=message):
        llava_next.parse(pb)


def test_llava_next_images_of_different_sizes_get_their_own_token_counts(llava_next):
    """Two images whose sizes give different token counts (52 and 88 here): the worker's per-image counts
    are the processor's, and they add up to the prompt's image tokens."""
    req = llava_next.parse(llava_next.request(2, sizes=((40, 20), (90, 90))))
    assert len(req.image_tokens) == 2 and req.image_tokens[0] != req.image_tokens[1]
    assert sum(req.image_tokens) == req.modality.num_vision_tokens
