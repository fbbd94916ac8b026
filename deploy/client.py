"""A small client of the public API, used by ``vlkv generate``, ``vlkv demo``, the evaluation and tests."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from vlkv.v1 import generate_pb2, generate_pb2_grpc


def png_bytes(image) -> bytes:
    """A PIL image as the PNG bytes a request carries."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def build_request(
    prompt: str | None = None,
    images: list[bytes] = (),
    *,
    question: str | None = None,
    request_id: str = "",
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] = (),
    policy: str = "",
    budget: float | None = None,
    threshold: float | None = None,
    allocator: str = "",
    exact_budget: bool = False,
    lookahead: int | None = None,
    lookahead_weight: float | None = None,
    verify: str = "",
    fidelity_floor: float | None = None,
    max_budget: float | None = None,
) -> generate_pb2.GenerateRequest:
    """A request with a plain-text ``prompt``, or, with ``question``, a one-turn chat: images then text."""
    sampling = generate_pb2.SamplingParams(stop=list(stop))
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    compression = generate_pb2.CompressionParams(
        policy=policy, allocator=allocator, exact_budget=exact_budget
    )
    if budget is not None:
        compression.budget = budget
    if threshold is not None:
        compression.threshold = threshold
    if lookahead is not None:
        compression.lookahead = lookahead
    if lookahead_weight is not None:
        compression.lookahead_weight = lookahead_weight
    compression.verify = verify
    if fidelity_floor is not None:
        compression.fidelity_floor = fidelity_floor
    if max_budget is not None:
        compression.max_budget = max_budget
    req = generate_pb2.GenerateRequest(
        request_id=request_id, images=list(images), sampling=sampling, compression=compression
    )
    if question is not None:
        parts = [generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder()) for _ in images]
        parts.append(generate_pb2.ContentPart(text=question))
        req.chat.messages.append(generate_pb2.ChatMessage(role="user", content=parts))
    elif prompt is not None:
        req.text = prompt
    return req


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: generate_pb2.Finished | None = None


def stream(stub: generate_pb2_grpc.GenerationStub, request, timeout: float | None = None) -> Iterator:
    """Yield the response messages of one Generate call."""
    yield from stub.Generate(request, timeout=timeout)


def generate(stub, request, timeout: float | None = None) -> Result:
    """Collect a whole Generate call; raises grpc.RpcError on a failed call."""
    out = Result()
    for resp in stream(stub, request, timeout):
        if resp.HasField("token"):
            out.token_ids.extend(resp.token.token_ids)
            out.text += resp.token.text
        else:
            out.finished = resp.finished
    return out


def open_channel(
    address: str, max_message_bytes: int = 64 << 20, *, token: str = "", ca: str = ""
) -> grpc.Channel:
    """A channel to the gateway: TLS when ``ca`` (a PEM file) is given; ``token`` is sent as a bearer token."""
    opts = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if ca:
        creds = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    elif token:  # plaintext on loopback: local credentials still carry the token
        creds = grpc.local_channel_credentials()
    else:
        return grpc.insecure_channel(address, options=opts)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, creds, options=opts)


def connect(
    address: str, max_message_bytes: int = 64 << 20, *, token: str = "", ca: str = ""
) -> tuple[grpc.Channel, generate_pb2_grpc.GenerationStub]:
    channel = open_channel(address, max_message_bytes, token=token, ca=ca)
    return channel, generate_pb2_grpc.GenerationStub(channel)
