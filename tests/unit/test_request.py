"""The validated request: made once at the gateway, carried to the prefill worker as ids and raw tensors.

The prefill worker rebuilds exactly what the gateway prepared (no second processor run), refuses a
malformed ``PrefillRequest`` with INVALID_ARGUMENT, and refusal reasons round-trip through metadata.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image, ImageDraw
from sample_images import random_png
from transformers import AutoConfig
from vlkv.common.config import Limits
from vlkv.common.errors import InvalidInput, Refusal, refusal_metadata, refusal_of
from vlkv.common.model.image_inputs import ImageInputs
from vlkv.common.model.inputs import decode_images, input_side, read_headers
from vlkv.common.model.loading import load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import (
    compression_to_proto,
    from_prefill_proto,
    prepare_request,
    tensor_from_proto,
    tensor_to_proto,
    to_prefill_proto,
)
from vlkv.deploy.client import build_request
from vlkv.v1 import worker_pb2


@pytest.fixture(scope="module")
def setup(tiny_model_dirs):
    path = tiny_model_dirs("llava-gqa")
    processor = load_processor(path)
    spec = ModelSpec.from_checkpoint(path, torch.float32, processor.tokenizer)
    images = ImageInputs.from_processor(processor, AutoConfig.from_pretrained(path), 8, 40_000_000)
    return processor, spec, images


def _prepared(setup, **kw):
    processor, spec, _ = setup
    req = build_request(images=[random_png(3)], question="what colour is the square ?", **kw)
    return prepare_request(req, processor, spec, Limits(), default_seed=123)


def test_prefill_proto_round_trip_is_exact(setup):
    _, spec, images = setup
    req = _prepared(setup, max_new_tokens=5)
    req.request_id = "r1"
    back = from_prefill_proto(to_prefill_proto(req, "127.0.0.1:1"), spec, Limits(), images)
    assert torch.equal(back.input_ids, req.input_ids)
    assert back.modality == req.modality and back.modality.tau == req.modality.tau
    assert set(back.model_inputs) == set(req.model_inputs)
    for name, t in req.model_inputs.items():
        assert back.model_inputs[name].dtype == t.dtype and torch.equal(back.model_inputs[name], t)
    assert back.sampling == req.sampling and back.sampling.seed == 123
    # budget and threshold are float32 on the wire, as they were in the client's request
    assert compression_to_proto(back.compression) == compression_to_proto(req.compression)
    assert back.compression.policy == req.compression.policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32])
def test_tensor_bytes_round_trip(dtype):
    t = (torch.randn(2, 3, 5) * 100).to(dtype)
    assert torch.equal(tensor_from_proto(tensor_to_proto("x", t)), t)


def _bad(pb, field, value):
    if field == "input_ids":
        del pb.input_ids[:]
        pb.input_ids.extend(value)
    elif field == "vision_spans":
        del pb.vision_spans[:]
        pb.vision_spans.extend(value)
    elif field == "tensor_bytes":
        pb.model_inputs[0].data = pb.model_inputs[0].data[:-4]
    elif field == "tensor_dtype":
        pb.model_inputs[0].dtype = "object"
    elif field == "decode_address":
        pb.decode_address = ""
    return pb


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("input_ids", [], "no input ids"),
        ("input_ids", [10**6], "outside the vocabulary"),
        ("vision_spans", [5, 2], "vision_spans"),
        ("vision_spans", [1], "vision_spans"),
        ("tensor_bytes", None, "do not hold"),
        ("tensor_dtype", None, "unsupported dtype"),
        ("decode_address", None, "decode_address"),
    ],
)
def test_malformed_prefill_request_is_invalid_input(setup, field, value, message):
    _, spec, images = setup
    req = _prepared(setup)
    req.request_id = "r1"
    pb = _bad(to_prefill_proto(req, "127.0.0.1:1"), field, value)
    with pytest.raises(InvalidInput, match=message):
        from_prefill_proto(pb, spec, Limits(), images)


class _FakeError:
    def __init__(self, metadata):
        self._metadata = metadata

    def trailing_metadata(self):
        return self._metadata


def test_refusal_reason_round_trips_through_metadata():
    for reason in Refusal.values():
        assert refusal_of(_FakeError(refusal_metadata(reason))) == reason
    assert refusal_of(_FakeError(())) == Refusal.REFUSAL_UNSPECIFIED
    assert refusal_of(_FakeError((("vlkv-refusal", "NOT_A_REASON"),))) == Refusal.REFUSAL_UNSPECIFIED
    assert worker_pb2.Refusal.Name(Refusal.REFUSAL_POOL_FULL) == "REFUSAL_POOL_FULL"


# -- cheap limits before expensive work; images decoded at the model's size (issue 15, items 5 and 6) -------
def _image(fmt: str, size: tuple[int, int]) -> bytes:
    img = Image.new("RGB", size, (200, 40, 40))
    ImageDraw.Draw(img).rectangle([size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2], fill=(0, 0, 255))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("kind, side", [("llava-gqa", 32), ("llava_next-gqa", 64)])
def test_input_side_is_the_largest_side_the_processor_uses(tiny_model_dirs, kind, side):
    assert input_side(load_processor(tiny_model_dirs(kind))) == side  # size, or the largest pinpoint


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_large_images_are_decoded_at_the_models_size(fmt):
    blob = _image(fmt, (2000, 1000))
    (full,) = decode_images([blob], Limits())
    assert full.size == (2000, 1000)
    (small,) = decode_images([blob], Limits(), max_side=32)
    assert small.mode == "RGB" and 64 <= min(small.size) < 250  # >= 2x the model's side, far below 1000
    assert abs(small.width / small.height - 2.0) < 0.05
    (kept,) = decode_images([_image(fmt, (100, 90))], Limits(), max_side=32)
    assert kept.size == (100, 90)  # under 2x the model's side: as sent


def test_the_pixel_limit_per_request_is_read_from_headers_before_decoding(monkeypatch):
    blobs = [_image("PNG", (3000, 3000))] * 3
    limits = Limits(max_request_pixels=20_000_000)
    monkeypatch.setattr(
        Image.Image, "load", lambda self: pytest.fail("decoded before the limits were checked")
    )
    with pytest.raises(InvalidInput, match="over the limit of 20000000 pixels per request"):
        decode_images(blobs, limits)
    assert [h.pixels for h in read_headers(blobs[:2], limits)] == [9_000_000, 9_000_000]


def test_prompt_bytes_are_checked_before_rendering_or_tokenizing(setup, monkeypatch):
    processor, spec, _ = setup
    monkeypatch.setattr(type(processor.tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenized"))
    for req in (build_request(prompt="é" * 600), build_request(question="é" * 600)):
        with pytest.raises(InvalidInput, match="the prompt has 1200 bytes, over the limit of 1000 bytes"):
            prepare_request(req, processor, spec, Limits(max_prompt_bytes=1000), default_seed=0)


def test_default_prompt_byte_limit_follows_the_context(setup):
    processor, spec, _ = setup
    limit = 32 * spec.context
    with pytest.raises(InvalidInput, match=f"over the limit of {limit} bytes"):
        prepare_request(build_request(prompt="a" * (limit + 1)), processor, spec, Limits(), default_seed=0)


def test_corrupt_png_chunks_are_invalid_input():
    png = random_png(3)
    cut = png.index(b"IDAT") + 40  # inside the IDAT data, then a chunk whose type is not letters
    corrupt = png[:cut] + b"\x00\x00\x00\x02\x01\x02\x03\x04xx\x00\x00\x00\x00"
    with pytest.raises(InvalidInput, match="image 0 cannot be decoded"):
        decode_images([corrupt], Limits())
