"""A ``GenerationStub`` look-alike that sends each ``GenerateRequest`` through the OpenAI-compatible HTTP
front with the official ``openai`` client, so the load generator drives either front with one code path.

``Generate`` streams a chat completion (or a plain completion for a text prompt without images), asks for
the token ids (``vlkv.return_token_ids``) and the usage chunk, and yields the ``GenerateResponse``
messages the gRPC API would: token chunks, then ``finished`` with vlkv's usage. HTTP errors are raised as
``grpc.aio.AioRpcError`` with the gRPC status the front named in the error's ``code``.
"""

from __future__ import annotations

import base64

import grpc
from vlkv.v1 import generate_pb2

FINISH = {"length": generate_pb2.FINISH_REASON_LENGTH, "stop": generate_pb2.FINISH_REASON_EOS}
HTTP_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
}


def _media(blob: bytes) -> str:
    return "image/png" if blob.startswith(b"\x89PNG") else "image/jpeg"


def openai_body(req: generate_pb2.GenerateRequest) -> tuple[str, dict]:
    """("chat" or "completion", the OpenAI request body less ``model`` and ``stream``) for ``req``."""
    s, c = req.sampling, req.compression
    body: dict = {}
    for name, key in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if s.HasField(name):
            body[key] = getattr(s, name)
    if s.HasField("seed"):
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    vlkv: dict = {"return_token_ids": True, "policy": c.policy, "allocator": c.allocator}
    vlkv.update({k: getattr(c, k) for k in ("budget", "threshold") if c.HasField(k)})
    if c.exact_budget:
        vlkv["exact_budget"] = True
    if s.HasField("top_k"):
        vlkv["top_k"] = s.top_k
    body["vlkv"] = vlkv
    if req.WhichOneof("prompt") == "text":
        if req.images:
            raise ValueError("the HTTP front takes images in chat messages only, not in a text prompt")
        return "completion", {**body, "prompt": req.text}
    images = iter(req.images)
    messages = []
    for m in req.chat.messages:
        parts = []
        for p in m.content:
            if p.WhichOneof("part") == "image":
                blob = next(images)
                url = f"data:{_media(blob)};base64," + base64.b64encode(blob).decode()
                parts.append({"type": "image_url", "image_url": {"url": url}})
            else:
                parts.append({"type": "text", "text": p.text})
        messages.append({"role": m.role, "content": parts})
    return "chat", {**body, "messages": messages}


class OpenAIGenerationStub:
    def __init__(self, base_url: str, api_key: str = "none", model: str | None = None) -> None:
        import openai  # the `openai` package (pip install openai): only the HTTP target needs it

        self.openai = openai
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0)
        self.model = model

    async def close(self) -> None:
        await self.client.close()

    async def _model(self) -> str:
        if self.model is None:
            self.model = (await self.client.models.list()).data[0].id
        return self.model

    async def Generate(self, req: generate_pb2.GenerateRequest, timeout: float | None = None, metadata=()):
        kind, body = openai_body(req)
        vlkv = body.pop("vlkv")
        api = self.client.chat.completions if kind == "chat" else self.client.completions
        try:
            stream = await api.create(
                model=await self._model(),
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"vlkv": vlkv},
                timeout=timeout,
                **body,
            )
            reason = None
            async for chunk in stream:
                if chunk.usage is not None:
                    yield _finished(reason, chunk.usage)
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        reason = choice.finish_reason
                    ids = (choice.model_extra or {}).get("token_ids")
                    if ids:
                        text = choice.delta.content if kind == "chat" else choice.text
                        yield generate_pb2.GenerateResponse(
                            token=generate_pb2.TokenChunk(token_ids=ids, text=text or "")
                        )
        except self.openai.APIStatusError as exc:
            code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
            name = (code or "").upper()
            if name not in grpc.StatusCode.__members__:
                name = HTTP_CODES.get(exc.status_code, "UNKNOWN")
            raise grpc.aio.AioRpcError(grpc.StatusCode[name], None, None, exc.message) from None
        except self.openai.APITimeoutError:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "timed out") from None
        except self.openai.APIConnectionError as exc:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, str(exc)) from None
        except self.openai.APIError as exc:  # an error event after the first token
            name = str(exc.code or "").upper()
            code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
            raise grpc.aio.AioRpcError(code, None, None, exc.message) from None


def _finished(reason: str | None, usage) -> generate_pb2.GenerateResponse:
    v = (usage.model_extra or {}).get("vlkv") or {}
    u = generate_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        vision_tokens=v.get("vision_tokens", 0),
        generated_tokens=usage.completion_tokens,
        kv_bytes_kept=v.get("kv_bytes_kept", 0),
        kv_bytes_full=v.get("kv_bytes_full", 0),
        compression_ratio=v.get("compression_ratio", 0.0),
        layer_budgets=v.get("layer_budgets", []),
        ttft_ms=v.get("ttft_ms", 0.0),
        policy=v.get("policy", ""),
    )
    finished = generate_pb2.Finished(reason=FINISH.get(reason or "", 0), usage=u)
    return generate_pb2.GenerateResponse(finished=finished)
