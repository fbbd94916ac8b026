"""OpenAI's request and response shapes, translated to and from vlkv's public API (``vlkv.v1``).

The HTTP front (``http_front.py``) parses a body into :class:`ChatRequest` or :class:`CompletionRequest`,
turns it into the same ``GenerateRequest`` a gRPC client would send (``chat_to_proto``,
``completion_to_proto``), and builds OpenAI's JSON from the gateway's ``GenerateResponse`` messages
(``usage_json``, ``finish_reason``). vlkv's own settings travel in an extra ``vlkv`` object with the gRPC
API's names (``policy``, ``budget``, ``threshold``, ``allocator``, ``exact_budget``); the usage carries
vlkv's KV figures under ``usage.vlkv``. Nothing here does I/O.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json
from vlkv.common.errors import Refusal, VlkvError
from vlkv.v1 import generate_pb2

UINT32 = (1 << 32) - 1
MAX_JSON_DEPTH = 32  # nesting of a request body; OpenAI's own shapes need under 10
DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg")


class ApiError(Exception):
    """An error the HTTP front answers in OpenAI's JSON shape with ``status``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
        504: "timeout",
    }

    def __init__(self, status: int, message: str, code: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or None}
        }


# gRPC status of a VlkvError -> HTTP status; the error's `code` field names the gRPC status in lower case.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def api_error(exc: VlkvError) -> ApiError:
    status = HTTP_STATUS.get(exc.code, 500)
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.reason == Refusal.REFUSAL_NEVER_FITS:
        status = 413  # retrying will not help: the request is larger than a decode worker's pool
    return ApiError(status, exc.message, exc.code.name.lower())


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"])
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], "invalid_argument", param)


def load_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> object:
    """A request body parsed as strict UTF-8 JSON (``pydantic_core``'s Rust parser: its recursion limit
    bounds the work, lone surrogates are refused) and at most ``max_depth`` levels deep; 400 otherwise."""
    try:
        body = from_json(raw)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise _too_deep(max_depth) from None
        raise ApiError(400, f"the body is not valid JSON: {exc}", "invalid_argument") from None
    stack = [(body, 1)] if isinstance(body, dict | list) else []
    while stack:  # iterative: no Python recursion on hostile nesting
        node, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return body


def _too_deep(max_depth: int) -> ApiError:
    return ApiError(400, f"the body is nested deeper than {max_depth} levels", "invalid_argument")


# ---------------------------------------------------------------------------------------------------------
# Requests.


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields vlkv has no use for (user, store)


class VlkvOptions(BaseModel):
    """The ``vlkv`` extra body field: compression settings (gRPC names), top_k, and token ids in replies."""

    model_config = ConfigDict(extra="forbid")
    policy: str = ""
    budget: float | None = None
    threshold: float | None = None
    allocator: str = ""
    exact_budget: bool = False
    lookahead: int | None = Field(None, ge=0, le=UINT32)  # draft-query scoring (Policy.lookahead)
    lookahead_weight: float | None = None
    verify: str = ""  # verified compression: "off", "select", "floor" ("": the server's default)
    fidelity_floor: float | None = None
    max_budget: float | None = None
    top_k: int | None = Field(None, ge=0, le=UINT32)
    return_token_ids: bool = False  # choices (and stream deltas) carry the generated token ids
    reuse: str = ""  # image cache: "auto" (default) or "off" (ReuseParams)
    recompute_ratio: float | None = None
    reuse_mode: str = ""  # "layerwise" (default; "vlcache" is an old alias), "mpic", "none"
    conversation: str = (
        ""  # a follow-up turn: "recompress" (default) or "continue" (ReuseParams.conversation)
    )


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL | str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(_Model):
    model: str
    temperature: float | None = None  # unset: vlkv's default, greedy (OpenAI's default is 1)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0, le=UINT32)  # as vLLM accepts it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    vlkv: VlkvOptions = Field(default_factory=VlkvOptions)

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", "invalid_argument", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported", "invalid_argument", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "invalid_argument", "logit_bias")


class ChatRequest(_Common):
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=0, le=UINT32)
    max_completion_tokens: int | None = Field(None, ge=0, le=UINT32)
    logprobs: bool | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", "invalid_argument", "logprobs")
        if self.tools:
            raise ApiError(400, "tools are not supported", "invalid_argument", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ApiError(400, "only the text response format is supported", "invalid_argument")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def image_urls(self) -> list[str]:
        """Every image part's URL, in prompt order."""
        return [
            p.image_url if isinstance(p.image_url, str) else p.image_url.url
            for m in self.messages
            if isinstance(m.content, list)
            for p in m.content
            if isinstance(p, ImagePart)
        ]


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(None, ge=0, le=UINT32)  # unset: vlkv's default (OpenAI's is 16)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ApiError(400, "prompt must be one string", "invalid_argument", "prompt")
        for name, off in (("echo", False), ("logprobs", None), ("suffix", None)):
            if getattr(self, name) not in (off, 0):
                raise ApiError(400, f"{name} is not supported", "invalid_argument", name)
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", "invalid_argument", "best_of")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 ``data:image/png|jpeg`` URL; 413 over ``max_bytes``, 400 for anything else."""
    head, sep, data = url.partition(",")
    media = head[len("data:") :].split(";")
    if not sep or media[0].lower() not in DATA_URL_TYPES or "base64" not in media[1:]:
        raise ApiError(400, "image data URLs must be data:image/png;base64,... or data:image/jpeg;base64,...")
    if len(data) * 3 // 4 > max_bytes + 3:
        raise ApiError(413, f"an image is over the limit of {max_bytes} bytes", "request_too_large")
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "an image data URL is not valid base64", "invalid_argument") from None
    if len(blob) > max_bytes:
        raise ApiError(413, f"an image is over the limit of {max_bytes} bytes", "request_too_large")
    return blob


def _sampling(r: ChatRequest | CompletionRequest) -> generate_pb2.SamplingParams:
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or ())
    s = generate_pb2.SamplingParams(stop=stop)
    top_k = r.vlkv.top_k if r.vlkv.top_k is not None else r.top_k
    seed = None if r.seed is None else r.seed % (1 << 64)
    for name, value in (
        ("max_new_tokens", r.max_new_tokens),
        ("temperature", r.temperature),
        ("top_p", r.top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(s, name, value)
    return s


def _compression(v: VlkvOptions) -> generate_pb2.CompressionParams:
    c = generate_pb2.CompressionParams(policy=v.policy, allocator=v.allocator, exact_budget=v.exact_budget)
    if v.budget is not None:
        c.budget = v.budget
    if v.threshold is not None:
        c.threshold = v.threshold
    if v.lookahead is not None:
        c.lookahead = v.lookahead
    if v.lookahead_weight is not None:
        c.lookahead_weight = v.lookahead_weight
    c.verify = v.verify
    if v.fidelity_floor is not None:
        c.fidelity_floor = v.fidelity_floor
    if v.max_budget is not None:
        c.max_budget = v.max_budget
    return c


def _reuse(v: VlkvOptions) -> generate_pb2.ReuseParams:
    out = generate_pb2.ReuseParams(reuse=v.reuse, mode=v.reuse_mode, conversation=v.conversation)
    if v.recompute_ratio is not None:
        out.recompute_ratio = v.recompute_ratio
    return out


def chat_to_proto(r: ChatRequest, images: list[bytes], request_id: str) -> generate_pb2.GenerateRequest:
    """The gRPC request for a chat completion; ``images`` are the decoded ``image_urls()``, in order."""
    req = generate_pb2.GenerateRequest(
        request_id=request_id, images=images, sampling=_sampling(r), compression=_compression(r.vlkv)
    )
    req.reuse.CopyFrom(_reuse(r.vlkv))
    req.chat.SetInParent()
    for m in r.messages:
        parts = []
        content = [TextPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content or []
        for p in content:
            if isinstance(p, ImagePart):
                parts.append(generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder()))
            else:
                parts.append(generate_pb2.ContentPart(text=p.text))
        role = "system" if m.role == "developer" else m.role
        req.chat.messages.append(generate_pb2.ChatMessage(role=role, content=parts))
    return req


def completion_to_proto(r: CompletionRequest, request_id: str) -> generate_pb2.GenerateRequest:
    """The gRPC request for a plain-text completion (no images)."""
    return generate_pb2.GenerateRequest(
        request_id=request_id, text=r.text, sampling=_sampling(r), compression=_compression(r.vlkv)
    )


# ---------------------------------------------------------------------------------------------------------
# Responses.

FINISH_REASONS = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_EOS: "stop",
    generate_pb2.FINISH_REASON_STOP_STRING: "stop",
}


def finish_reason(finished: generate_pb2.Finished) -> str:
    return FINISH_REASONS.get(finished.reason, "stop")


def usage_json(u: generate_pb2.Usage) -> dict:
    """OpenAI's usage (``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache served),
    plus vlkv's figures (vision tokens, KV kept and full, ratio, layer budgets, TTFT, the
    compression profile in force, and what verification did: null when the request was not verified)."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "vlkv": {
            "vision_tokens": u.vision_tokens,
            "kv_bytes_kept": u.kv_bytes_kept,
            "kv_bytes_full": u.kv_bytes_full,
            "compression_ratio": round(u.compression_ratio, 6),
            "layer_budgets": list(u.layer_budgets),
            "ttft_ms": round(u.ttft_ms, 3),
            "policy": u.policy,
            "image_cache_hit": u.image_cache_hit,
            "recomputed_image_tokens": u.recomputed_image_tokens,
            "recompute_ratio": round(u.recompute_ratio, 6),
            "compression_profile": u.compression_profile,
            "kv_bytes_window_saved": u.kv_bytes_window_saved,
            "continued_tokens": u.continued_tokens,
            "continue_refused": u.continue_refused,
            "continued_on": u.continued_on,
            "verification": None
            if not u.verify
            else {
                "mode": u.verify,
                "candidate": u.verified_candidate,
                "agreement": round(u.verified_agreement, 6),
                "kl": round(u.verified_kl, 6),
                "budget_raises": u.budget_raises,
                "floor_met": u.floor_met,
                "budget": round(u.verified_budget, 6),
                "draft_tokens": u.draft_tokens,
            },
        },
    }
