"""The validated request: made once at the gateway, carried to the prefill worker as ids and raw tensors.

The prefill worker rebuilds exactly what the gateway prepared (no second processor run), refuses a
malformed ``PrefillRequest`` with INVALID_ARGUMENT, and refusal reasons round-trip through metadata.
"""

from __future__ import annotations

import pytest
import torch
from vlkv.common.config import Limits
from vlkv.common.errors import InvalidInput, Refusal, refusal_metadata, refusal_of
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
from vlkv.tools.client import build_request
from vlkv.v1 import worker_pb2

from tests.test_e2e_equality import random_png


@pytest.fixture(scope="module")
def setup(tiny_model_dirs):
    path = tiny_model_dirs("llava-gqa")
    processor = load_processor(path)
    spec = ModelSpec.from_checkpoint(path, torch.float32, processor.tokenizer)
    return processor, spec


def _prepared(setup, **kw):
    processor, spec = setup
    req = build_request(images=[random_png(3)], question="what colour is the square ?", **kw)
    return prepare_request(req, processor, spec, Limits(), default_seed=123)


def test_prefill_proto_round_trip_is_exact(setup):
    _, spec = setup
    req = _prepared(setup, max_new_tokens=5)
    req.request_id = "r1"
    back = from_prefill_proto(to_prefill_proto(req, "127.0.0.1:1"), spec, Limits())
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
    _, spec = setup
    req = _prepared(setup)
    req.request_id = "r1"
    pb = _bad(to_prefill_proto(req, "127.0.0.1:1"), field, value)
    with pytest.raises(InvalidInput, match=message):
        from_prefill_proto(pb, spec, Limits())


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
