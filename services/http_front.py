"""The OpenAI-compatible HTTP front: FastAPI on uvicorn beside the gRPC gateway, on the same serving path.

``create_app`` serves ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /health``. Each request is parsed and translated (``openai_schema.py``) into the ``GenerateRequest``
a gRPC client would send and run through the gateway's own ``GatewayServicer.stream`` (validation,
router, admission queue, workers, metrics labelled ``front="http"``). Streams are server-sent events.
Errors answer in OpenAI's JSON error shape: the gateway's gRPC status becomes the HTTP status (400, 401,
429, 503, 504); bodies over the size limit and images over ``max_image_bytes`` are 413. The bearer token is
the gateway's ``api_token``. A client that disconnects cancels its request at once (the decode worker frees
the blocks), while it waits for its first token as well as mid-stream.

``http_server.HttpServer`` runs the app with uvicorn inside the gateway's event loop; ``deploy/servers.py``
starts it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from vlkv.common.errors import VlkvError
from vlkv.services.gateway import GatewayServicer
from vlkv.services.http_server import BodyLimit
from vlkv.services.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    api_error,
    chat_to_proto,
    completion_to_proto,
    decode_data_url,
    finish_reason,
    usage_json,
    validation_error,
)
from vlkv.v1 import generate_pb2


@dataclass(frozen=True, slots=True)
class HttpFrontConfig:
    model_id: str = ""  # the one model /v1/models lists and requests name (deploy: the model's directory)
    max_body_bytes: int = 0  # 0: the gateway's limits.max_message_bytes (as for a gRPC message)
    allow_image_hosts: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched; none by default
    fetch_timeout_s: float = 10.0


class _ClientGone(Exception):
    """The client disconnected before its answer was ready; the request was cancelled."""


@dataclass(frozen=True, slots=True)
class _Shape:
    """What differs between chat and plain completions in OpenAI's JSON."""

    chat: bool

    @property
    def prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def obj(self, chunk: bool) -> str:
        return ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"

    def choice(self, text: str | None, *, chunk: bool, finish: str | None = None, ids=None) -> dict:
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        out = {"index": 0, **body, "finish_reason": finish, "logprobs": None}
        if ids is not None:
            out["token_ids"] = list(ids)
        return out


def create_app(gateway: GatewayServicer, cfg: HttpFrontConfig = HttpFrontConfig()) -> FastAPI:
    cfg = replace(cfg, model_id=cfg.model_id or "vlkv")
    limits = gateway.cfg.limits
    token = gateway.cfg.security.api_token
    expected = f"Bearer {token}".encode()
    app = FastAPI(title="vlkv OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes or limits.max_message_bytes)

    async def authorize(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if token and not hmac.compare_digest(got, expected):
            raise ApiError(401, "missing or invalid bearer token", "invalid_api_key")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(VlkvError)
    async def _vlkv_error(request: Request, exc: VlkvError) -> JSONResponse:
        return await _api_error(request, api_error(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return await _api_error(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.get("/health")
    async def health() -> JSONResponse:
        router = gateway.router
        workers = {"prefill_workers": len(router.prefill), "decode_workers": len(router.decode)}
        ok = all(workers.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", **workers}, 200 if ok else 503)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        model = {"id": cfg.model_id, "object": "model", "created": 0, "owned_by": "vlkv"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        req = _parse(ChatRequest, await _json_body(request), cfg.model_id)
        urls = req.image_urls()
        if len(urls) > limits.max_images:
            raise ApiError(
                400, f"{len(urls)} images exceed the limit of {limits.max_images}", "invalid_argument"
            )
        images = [await _image(url, limits.max_image_bytes, cfg) for url in urls]
        rid = uuid.uuid4().hex
        return await _respond(gateway, request, chat_to_proto(req, images, rid), req, _Shape(chat=True), cfg)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await _json_body(request), cfg.model_id)
        rid = uuid.uuid4().hex
        return await _respond(gateway, request, completion_to_proto(req, rid), req, _Shape(chat=False), cfg)

    return app


async def _json_body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", "invalid_argument") from None


def _parse(cls, body: object, model_id: str):
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_argument")
    try:
        req = cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.model != model_id:
        raise ApiError(
            404, f"model {req.model!r} does not exist; this server serves {model_id!r}", "model_not_found"
        )
    req.check_supported()
    return req


async def _image(url: str, max_bytes: int, cfg: HttpFrontConfig) -> bytes:
    """An image part's bytes: a data URL, or an http(s) URL on an allowed host (fetched, no redirects)."""
    if url.startswith("data:"):
        return decode_data_url(url, max_bytes)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ApiError(400, "image URLs must be data: URLs (PNG or JPEG)", "invalid_image_url")
    if parts.hostname not in cfg.allow_image_hosts:
        raise ApiError(
            400,
            f"remote image URLs are not fetched (host {parts.hostname!r} is not allowed); send the image as a "
            "data:image/png;base64,... URL",
            "invalid_image_url",
        )
    return await asyncio.to_thread(_fetch, url, max_bytes, cfg.fetch_timeout_s)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect could lead off the allowed hosts


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    try:
        with urllib.request.build_opener(_NoRedirect).open(url, timeout=timeout_s) as resp:
            blob = resp.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ApiError(400, f"cannot fetch image {url!r}: {exc}", "invalid_image_url") from None
    if len(blob) > max_bytes:
        raise ApiError(413, f"an image is over the limit of {max_bytes} bytes", "request_too_large")
    return blob


async def _until_disconnected(request: Request, aw):
    """Await ``aw`` unless the client disconnects first: then cancel it (and raise _ClientGone)."""
    task = asyncio.ensure_future(aw)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone


async def _collect(stream) -> tuple[str, list[int], generate_pb2.Finished]:
    text, ids, finished = [], [], None
    async for resp in stream:
        if resp.HasField("token"):
            text.append(resp.token.text)
            ids.extend(resp.token.token_ids)
        else:
            finished = resp.finished
    return "".join(text), ids, finished


async def _respond(gateway, request: Request, pb, req, shape: _Shape, cfg: HttpFrontConfig) -> Response:
    tenant = gateway.tenant(request.headers.get("authorization", ""))
    stream = gateway.stream(pb, front="http", tenant=tenant)
    rid, created = pb.request_id, int(time.time())
    head = {"id": shape.prefix + rid, "created": created, "model": cfg.model_id}
    headers = {"x-request-id": rid}
    want_ids = req.vlkv.return_token_ids
    if not req.stream:
        text, ids, finished = await _until_disconnected(request, _collect(stream))
        choice = shape.choice(
            text, chunk=False, finish=finish_reason(finished), ids=ids if want_ids else None
        )
        body = {**head, "object": shape.obj(False), "choices": [choice], "usage": usage_json(finished.usage)}
        return JSONResponse(body, headers=headers)
    # Errors before the first token (bad input, no room, no worker) keep their HTTP status.
    first = await _until_disconnected(request, anext(stream))
    usage = req.stream_options is not None and req.stream_options.include_usage
    events = _events(stream, first, {**head, "object": shape.obj(True)}, shape, usage, want_ids)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _events(stream, first, head: dict, shape: _Shape, include_usage: bool, want_ids: bool):
    """Server-sent events: a role chunk (chat), one chunk per token message, the finish, the usage."""

    def chunk(choices: list, usage=None) -> str:
        return _sse({**head, "choices": choices, **({"usage": usage} if include_usage else {})})

    try:
        if shape.chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        resp = first
        while True:
            if resp.HasField("token"):
                ids = resp.token.token_ids if want_ids else None
                yield chunk([shape.choice(resp.token.text, chunk=True, ids=ids)])
            else:
                yield chunk([shape.choice(None, chunk=True, finish=finish_reason(resp.finished))])
                if include_usage:
                    yield chunk([], usage_json(resp.finished.usage))
                break
            resp = await anext(stream)
    except VlkvError as exc:  # after the first token the status line is sent: the error is an event
        yield _sse(api_error(exc).body())
        return
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
