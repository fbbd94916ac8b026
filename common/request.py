"""The request, validated once where it enters vlkv and carried on as the processor left it.

The gateway turns a public ``GenerateRequest`` into a :class:`PreparedRequest` (``prepare_request``): the
prompt rendered (plain text or chat template), the images decoded and checked, the processor run (input ids,
pixel values, the modality map), the prompt length checked against the limits and the model's context, and
the sampling and compression settings validated (a random seed drawn when none was given). The prefill
worker gets it as a ``PrefillRequest`` (``to_prefill_proto`` / ``from_prefill_proto``): tensors travel as
raw little-endian bytes, so it neither decodes images nor runs the processor again. Every proto is parsed
once at the edge of each process: the ``*_from_proto`` functions here are those edges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from vlkv.common.compression.registry import (
    DEFAULT_BUDGET,
    DEFAULT_POLICY,
    DEFAULT_THRESHOLD,
    CompressionSettings,
)
from vlkv.common.config import Limits
from vlkv.common.errors import InvalidInput
from vlkv.common.heap import release_memory
from vlkv.common.model.image_inputs import ImageInputs
from vlkv.common.model.inputs import (
    ModalityMap,
    check_placeholders,
    decode_images,
    input_side,
    prepare_inputs,
    read_headers,
)
from vlkv.common.model.spec import ModelSpec
from vlkv.common.reuse import REUSE_MODE_ALIASES, REUSE_MODES, ReuseSettings, image_hashes
from vlkv.common.sampling import SamplingConfig
from vlkv.v1 import generate_pb2, worker_pb2

MAX_STOP_CHARS = 256
MAX_CHAT_PARTS = 1024  # messages plus content parts of a chat prompt
PROMPT_BYTES_PER_TOKEN = 32  # Limits.max_prompt_bytes = 0: this many bytes per token of the model's context
RELEASE_AFTER_PIXELS = 4_000_000  # decoded pixels after which a request trims the heap (release_memory)
TENSOR_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}
MAX_MODEL_INPUTS = 8  # tensors beside the ids (pixel_values, image_sizes, ...)
MAX_TENSOR_DIMS = 8
MAX_TENSOR_DIM = 1 << 31  # elements along one dimension of a model input
MAX_REQUEST_ID = 128  # characters of a request id (the caller's at the gateway, the internal one at workers)
MAX_ADDRESS_CHARS = 256
MAX_HASH_CHARS = 128


@dataclass
class PreparedRequest:
    """What the prefill needs, validated: ids ``[1, m]``, model inputs (pixel_values ...), settings."""

    request_id: str
    input_ids: torch.Tensor  # [1, m] int64
    model_inputs: dict[str, torch.Tensor]
    modality: ModalityMap
    sampling: SamplingConfig
    compression: CompressionSettings
    reuse: ReuseSettings = field(default_factory=ReuseSettings)
    image_hashes: list[str] = field(default_factory=list)  # one per image: the gateway's digest (routing)
    tenant: str = ""  # the caller (image cache entries are per tenant); "" is the anonymous tenant
    image_tokens: list[int] = field(default_factory=list)  # per image, as the worker checked (empty: equal)

    @property
    def m(self) -> int:
        return self.modality.m


def prepare_request(
    pb: generate_pb2.GenerateRequest,
    processor,
    spec: ModelSpec,
    limits: Limits,
    *,
    default_seed: int,
    tenant: str = "",
) -> PreparedRequest:
    """Validate a public request and run the processor; InvalidInput names the first bad field.

    Cheap checks come before expensive work: the settings, the prompt's size in bytes before it is
    rendered or tokenized, the image count and placeholders, and every image's header (bytes, format,
    pixels, pixels in total) before any image is decoded; images are decoded at the size the model uses
    (``decode_images``). Synchronous and CPU-bound: the gateway runs it in a worker thread."""
    sampling = sampling_from_proto(pb.sampling, limits, default_seed=default_seed)
    compression = compression_from_proto(pb.compression)
    reuse = reuse_from_proto(pb.reuse)
    prompt = render_prompt(pb, processor, limits.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * spec.context)
    blobs = list(pb.images)
    check_placeholders(prompt, processor, len(blobs))  # before any image is decoded
    headers = read_headers(blobs, limits)
    large = sum(h.pixels for h in headers) >= RELEASE_AFTER_PIXELS or len(prompt) > 1 << 20
    images = decode_images(blobs, limits, input_side(processor), headers)
    try:
        inputs = prepare_inputs(processor, images, prompt, spec.image_token_id)
    finally:
        del images
        if large:  # give the decoded images' memory back to the OS now
            release_memory()
    m = inputs.modality.m
    limit = limits.max_prompt_tokens or spec.context
    if m > limit:
        raise InvalidInput(f"the prompt has {m} tokens, over the limit of {limit}")
    check_context(m, sampling.max_new_tokens, spec.context)
    model_inputs = {k: v for k, v in inputs.model_kwargs.items() if torch.is_tensor(v)}
    pixels, sizes = model_inputs.get("pixel_values"), model_inputs.get("image_sizes")
    hashes = image_hashes(pixels, sizes) if reuse.enabled else []
    return PreparedRequest(
        pb.request_id,
        inputs.input_ids,
        model_inputs,
        inputs.modality,
        sampling,
        compression,
        reuse,
        hashes,
        tenant,
    )


def check_context(m: int, max_new_tokens: int, context: int) -> None:
    if m + max_new_tokens > context:
        raise InvalidInput(
            f"prompt ({m} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{context} tokens"
        )


def to_prefill_proto(req: PreparedRequest, decode_address: str) -> worker_pb2.PrefillRequest:
    spans = [i for span in req.modality.vision_spans for i in span]
    return worker_pb2.PrefillRequest(
        request_id=req.request_id,
        sampling=sampling_to_proto(req.sampling),
        compression=compression_to_proto(req.compression),
        decode_address=decode_address,
        input_ids=req.input_ids.reshape(-1).tolist(),
        vision_spans=spans,
        model_inputs=[tensor_to_proto(k, v) for k, v in req.model_inputs.items()],
        image_hashes=req.image_hashes,
        reuse=reuse_to_proto(req.reuse),
    )


def from_prefill_proto(
    pb: worker_pb2.PrefillRequest, spec: ModelSpec, limits: Limits, images: ImageInputs | None = None
) -> PreparedRequest:
    """The prefill worker's edge, and its one validation of what it was sent, before any model code: the
    ids, the vision spans, the model inputs against the model's processor (``images``: names, dtypes,
    shapes, byte lengths, image sizes) and the image-token count they produce, the settings. The cheap
    checks on field sizes come first; tensors are built only once their layout passed. InvalidInput names
    the field. Without ``images`` (a caller with no processor) a request may carry no model inputs."""
    _check_ids(pb)
    m = len(pb.input_ids)
    if m == 0:
        raise InvalidInput("input_ids: the request has no input ids")
    limit = limits.max_prompt_tokens or spec.context
    if limit and m > limit:
        raise InvalidInput(f"input_ids: {m} tokens, over the limit of {limit}")
    if spec.vocab_size and max(pb.input_ids) >= spec.vocab_size:
        raise InvalidInput(f"input_ids: an id is outside the vocabulary of {spec.vocab_size}")
    input_ids = torch.tensor([list(pb.input_ids)], dtype=torch.long)
    modality = ModalityMap.from_input_ids(input_ids, spec.image_token_id)
    spans = list(pb.vision_spans)
    if spans != [i for span in modality.vision_spans for i in span]:
        raise InvalidInput(
            "vision_spans: must be the [start, end) runs of image tokens in input_ids, sorted and disjoint"
        )
    model_inputs = _model_inputs(pb, images)
    expected = images.image_tokens(model_inputs) if images is not None else []
    if sum(expected) != modality.num_vision_tokens:
        raise InvalidInput(
            f"input_ids: {modality.num_vision_tokens} image tokens where the pixel values produce {sum(expected)}"
        )
    sampling = sampling_from_proto(pb.sampling, limits)
    check_context(m, sampling.max_new_tokens, spec.context)
    if len(pb.image_hashes) > limits.max_images or any(len(h) > MAX_HASH_CHARS for h in pb.image_hashes):
        raise InvalidInput(
            f"image_hashes: at most {limits.max_images} of at most {MAX_HASH_CHARS} characters"
        )
    return PreparedRequest(
        request_id=pb.request_id,
        input_ids=input_ids,
        model_inputs=model_inputs,
        modality=modality,
        sampling=sampling,
        compression=compression_from_proto(pb.compression),
        reuse=reuse_from_proto(pb.reuse),
        image_hashes=list(pb.image_hashes),  # the gateway's digests: a routing hint, never a cache key
        image_tokens=expected,
    )


def _check_ids(pb: worker_pb2.PrefillRequest) -> None:
    if not pb.request_id or len(pb.request_id) > MAX_REQUEST_ID:
        raise InvalidInput(f"request_id: required, at most {MAX_REQUEST_ID} characters")
    if not pb.decode_address or len(pb.decode_address) > MAX_ADDRESS_CHARS:
        raise InvalidInput(f"decode_address: required, at most {MAX_ADDRESS_CHARS} characters")


def _model_inputs(pb: worker_pb2.PrefillRequest, images: ImageInputs | None) -> dict[str, torch.Tensor]:
    """The model inputs as tensors, once their count, names, dtypes, shapes and byte lengths passed."""
    if len(pb.model_inputs) > MAX_MODEL_INPUTS:
        raise InvalidInput(f"model_inputs: more than {MAX_MODEL_INPUTS} tensors")
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for t in pb.model_inputs:
        if t.name in layout:
            raise InvalidInput(f"model_inputs[{t.name[:64]}]: sent twice")
        _check_tensor(t)
        layout[t.name] = (t.dtype, tuple(t.shape))
    if images is not None:
        images.check_layout(layout)
    elif layout:
        raise InvalidInput("model_inputs: this worker takes no model inputs")
    tensors = {t.name: tensor_from_proto(t) for t in pb.model_inputs}
    pixels = tensors.get("pixel_values")
    if pixels is not None and not bool(torch.isfinite(pixels).all()):
        raise InvalidInput("model_inputs[pixel_values]: not all finite")
    return tensors


def _check_tensor(pb: worker_pb2.Tensor) -> None:
    """A tensor's metadata: a known dtype, a bounded shape and exactly its bytes (nothing built yet)."""
    name = pb.name[:64]
    if not pb.name or len(pb.name) > 64:
        raise InvalidInput(f"model_inputs[{name}]: a name of 1 to 64 characters is required")
    dtype = TENSOR_DTYPES.get(pb.dtype)
    if dtype is None:
        raise InvalidInput(f"model_inputs[{name}]: unsupported dtype {pb.dtype[:32]!r}")
    if len(pb.shape) > MAX_TENSOR_DIMS or any(d > MAX_TENSOR_DIM for d in pb.shape):
        raise InvalidInput(
            f"model_inputs[{name}]: at most {MAX_TENSOR_DIMS} dimensions of at most {MAX_TENSOR_DIM} each"
        )
    if math.prod(pb.shape) * dtype.itemsize != len(pb.data):
        raise InvalidInput(
            f"model_inputs[{name}]: {len(pb.data)} bytes do not hold {list(pb.shape)} {pb.dtype}"
        )


def tensor_to_proto(name: str, t: torch.Tensor) -> worker_pb2.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"model input {name!r} has unsupported dtype {t.dtype}")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return worker_pb2.Tensor(name=name, dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape), data=data)


def tensor_from_proto(pb: worker_pb2.Tensor) -> torch.Tensor:
    """Raw bytes viewed as the announced dtype and shape (never unpickled); InvalidInput if they disagree."""
    _check_tensor(pb)
    dtype = TENSOR_DTYPES[pb.dtype]
    if math.prod(pb.shape) == 0:
        return torch.empty(tuple(pb.shape), dtype=dtype)
    return torch.frombuffer(bytearray(pb.data), dtype=dtype).reshape(tuple(pb.shape))


def render_prompt(request: generate_pb2.GenerateRequest, processor, max_bytes: int = 0) -> str:
    """The prompt text with image placeholders, from plain text or chat messages; with ``max_bytes``, a
    prompt over that many UTF-8 bytes is refused before it is rendered (and again after)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        text = request.text
        _check_prompt_bytes(len(text.encode()), max_bytes)
    elif kind == "chat":
        parts = len(request.chat.messages) + sum(len(msg.content) for msg in request.chat.messages)
        if parts > MAX_CHAT_PARTS:
            raise InvalidInput(
                f"the chat prompt has {parts} messages and parts, over the limit of {MAX_CHAT_PARTS}"
            )
        _check_prompt_bytes(
            sum(len(p.text.encode()) for msg in request.chat.messages for p in msg.content), max_bytes
        )
        messages = []
        for msg in request.chat.messages:
            if msg.role not in ("user", "assistant", "system"):
                raise InvalidInput(f"unknown chat role {msg.role!r}")
            parts = []
            for part in msg.content:
                if part.WhichOneof("part") == "image":
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            messages.append({"role": msg.role, "content": parts})
        if not messages:
            raise InvalidInput("chat prompt has no messages")
        add_gen = (
            request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
        )
        try:
            text = processor.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - e.g. the template's own raise_exception on a bad order
            raise InvalidInput(f"the chat template rejected the messages: {exc}") from None
        _check_prompt_bytes(len(text.encode()), max_bytes)
    else:
        raise InvalidInput("the prompt is empty: set text or chat")
    if not text.strip():
        raise InvalidInput("the prompt is empty")
    return text


def _check_prompt_bytes(n: int, max_bytes: int) -> None:
    if max_bytes and n > max_bytes:
        raise InvalidInput(f"the prompt has {n} bytes, over the limit of {max_bytes} bytes")


def sampling_from_proto(
    pb: generate_pb2.SamplingParams, limits: Limits, *, default_seed: int = 0
) -> SamplingConfig:
    """Validate request sampling parameters; out-of-range values raise InvalidInput."""
    cfg = SamplingConfig(
        max_new_tokens=pb.max_new_tokens if pb.HasField("max_new_tokens") else limits.default_max_new_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else 0.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k if pb.HasField("top_k") else 0,
        seed=pb.seed if pb.HasField("seed") else default_seed,
        stop=list(pb.stop),
    )
    if not 1 <= cfg.max_new_tokens <= limits.max_new_tokens:
        raise InvalidInput(
            f"max_new_tokens must be in [1, {limits.max_new_tokens}], got {cfg.max_new_tokens}"
        )
    if not (math.isfinite(cfg.temperature) and 0.0 <= cfg.temperature <= 100.0):
        raise InvalidInput(f"temperature must be in [0, 100], got {cfg.temperature}")
    if not (math.isfinite(cfg.top_p) and 0.0 < cfg.top_p <= 1.0):
        raise InvalidInput(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k > 1_000_000:
        raise InvalidInput(f"top_k must be <= 1000000, got {cfg.top_k}")
    if len(cfg.stop) > limits.max_stop_strings:
        raise InvalidInput(f"at most {limits.max_stop_strings} stop strings are allowed")
    if any(not s or len(s) > MAX_STOP_CHARS for s in cfg.stop):
        raise InvalidInput(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
    return cfg


def sampling_to_proto(cfg: SamplingConfig) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        stop=cfg.stop,
    )


def compression_from_proto(pb: generate_pb2.CompressionParams) -> CompressionSettings:
    """Validated settings from the request's proto; InvalidInput with the reason for a bad value."""
    budget = pb.budget if pb.HasField("budget") else DEFAULT_BUDGET
    threshold = pb.threshold if pb.HasField("threshold") else DEFAULT_THRESHOLD
    try:
        lookahead = int(pb.lookahead) if pb.HasField("lookahead") else None
        weight = float(pb.lookahead_weight) if pb.HasField("lookahead_weight") else None
        return CompressionSettings(
            pb.policy or DEFAULT_POLICY,
            float(budget),
            float(threshold),
            pb.allocator,
            pb.exact_budget,
            explicit=bool(
                pb.policy or pb.allocator or pb.exact_budget or lookahead is not None or weight is not None
            ),
            lookahead=lookahead,
            lookahead_weight=weight,
            verify=pb.verify or None,
            fidelity_floor=float(pb.fidelity_floor) if pb.HasField("fidelity_floor") else None,
            max_budget=float(pb.max_budget) if pb.HasField("max_budget") else None,
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def compression_to_proto(cfg: CompressionSettings) -> generate_pb2.CompressionParams:
    pb = generate_pb2.CompressionParams(
        policy=cfg.policy if cfg.explicit else "",  # empty: the server's profile may choose
        budget=cfg.budget,
        threshold=cfg.threshold,
        allocator=cfg.allocator,
        exact_budget=cfg.exact_budget,
    )
    if cfg.lookahead is not None:
        pb.lookahead = cfg.lookahead
    if cfg.lookahead_weight is not None:
        pb.lookahead_weight = cfg.lookahead_weight
    if cfg.verify is not None:
        pb.verify = cfg.verify
    if cfg.fidelity_floor is not None:
        pb.fidelity_floor = cfg.fidelity_floor
    if cfg.max_budget is not None:
        pb.max_budget = cfg.max_budget
    return pb


def reuse_from_proto(pb: generate_pb2.ReuseParams) -> ReuseSettings:
    """Validated image-reuse settings; InvalidInput names a bad value."""
    if pb.reuse not in ("", "auto", "off"):
        raise InvalidInput(f"reuse must be auto or off, got {pb.reuse!r}")
    if pb.mode and pb.mode not in REUSE_MODES and pb.mode not in REUSE_MODE_ALIASES:
        raise InvalidInput(f"reuse mode must be one of {', '.join(REUSE_MODES)}, got {pb.mode!r}")
    kwargs = {"enabled": pb.reuse != "off"}
    if pb.conversation:
        kwargs["conversation"] = pb.conversation
    if pb.mode:
        kwargs["mode"] = pb.mode
    if pb.HasField("recompute_ratio"):
        kwargs["ratio"] = float(pb.recompute_ratio)
    try:
        return ReuseSettings(**kwargs)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def reuse_to_proto(cfg: ReuseSettings) -> generate_pb2.ReuseParams:
    return generate_pb2.ReuseParams(
        reuse="auto" if cfg.enabled else "off",
        recompute_ratio=cfg.ratio,
        mode=cfg.mode,
        conversation=cfg.conversation,
    )
