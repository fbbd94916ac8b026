"""The OpenAI-compatible HTTP front: FastAPI on uvicorn beside the gRPC gateway, on the same serving path.

``create_app`` serves ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /health``. Each request is parsed and translated (``openai_schema.py``) into the ``GenerateRequest``
a gRPC client would send and run through the gateway's own ``GatewayServicer.stream`` (validation,
router, admission queue, workers, metrics labelled ``front="http"``). Streams are server-sent events.
Errors answer in OpenAI's JSON error shape: the gateway's gRPC status becomes the HTTP status (400, 401,
429, 503, 504); bodies over the size limit and images over ``max_image_bytes`` are 413. Bodies are parsed
as strict UTF-8 JSON at most ``MAX_JSON_DEPTH`` deep (``openai_schema.load_json``); anything that fails
while the client's input is read is a 400, and only a fault of the server itself is a 500 (still in
OpenAI's shape). Remote image URLs on allowed hosts are fetched by ``image_fetch.ImageFetcher`` (one
deadline per fetch, a size cap, a per-host limit), beside each other and cancelled with the request. The
bearer token is the gateway's ``api_token``. A client that disconnects cancels its request at once (the
decode worker frees the blocks), while it waits for its first token as well as mid-stream.

``http_server.HttpServer`` runs the app with uvicorn inside the gateway's event loop; ``deploy/servers.py``
starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from vlkv.common.errors import VlkvError
from vlkv.services.gateway import GatewayServicer
from vlkv.services.http_server import BodyLimit
from vlkv.services.image_fetch import FetchConfig, ImageFetcher
from vlkv.services.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    api_error,
    chat_to_proto,
    completion_to_proto,
    decode_data_url,
    finish_reason,
    load_json,
    usage_json,
    validation_error,
)
from vlkv.v1 import generate_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpFrontConfig:
    model_id: str = ""  # the one model /v1/models lists and requests name (deploy: the model's directory)
    max_body_bytes: int = 0  # 0: the gateway's limits.max_message_bytes (as for a gRPC message)
    allow_image_hosts: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched; none by default
    fetch_deadline_s: float = 10.0  # one remote image, start to last byte (504 past it)
    fetch_per_host: int = 4  # remote image fetches from one host:port at a time


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
    fetch = FetchConfig(cfg.allow_image_hosts, cfg.fetch_deadline_s, cfg.fetch_per_host)
    fetcher = ImageFetcher(fetch, gateway.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await fetcher.close()

    app = FastAPI(
        title="vlkv OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
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

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        # Client input cannot get here (_build turns any failure to read it into a 400): a server fault.
        log.error("HTTP front: %s %s failed: %r", request.method, request.url.path, exc)
        return await _api_error(request, ApiError(500, "internal error; the server log has the details"))

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
        req = _build(_parse, ChatRequest, await request.body(), cfg.model_id)
        urls = req.image_urls()
        if len(urls) > limits.max_images:
            raise ApiError(
                400, f"{len(urls)} images exceed the limit of {limits.max_images}", "invalid_argument"
            )
        images = await _until_disconnected(request, _images(urls, limits.max_image_bytes, fetcher))
        rid = uuid.uuid4().hex
        pb = _build(chat_to_proto, req, images, rid)
        return await _respond(gateway, request, pb, req, _Shape(chat=True), cfg)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        req = _build(_parse, CompletionRequest, await request.body(), cfg.model_id)
        pb = _build(completion_to_proto, req, uuid.uuid4().hex)
        return await _respond(gateway, request, pb, req, _Shape(chat=False), cfg)

    return app


def _build(fn, *args):
    """``fn(*args)`` on the client's input: whatever it fails with is the client's doing, a 400 (never a 500)."""
    try:
        return fn(*args)
    except ApiError:
        raise
    except Exception as exc:  # e.g. a value the protobuf runtime refuses that validation let through
        log.info("HTTP front: unreadable request: %r", exc)
        raise ApiError(
            400, f"the request cannot be read: {type(exc).__name__}: {exc}", "invalid_argument"
        ) from None


def _parse(cls, raw: bytes, model_id: str):
    body = load_json(raw)
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


async def _images(urls: list[str], max_bytes: int, fetcher: ImageFetcher) -> list[bytes]:
    """Each image part's bytes, fetched at once: data URLs decoded, http(s) URLs on allowed hosts fetched."""

    async def one(url: str) -> bytes:
        return (
            decode_data_url(url, max_bytes)
            if url.startswith("data:")
            else await fetcher.fetch(url, max_bytes)
        )

    tasks = [asyncio.ensure_future(one(url)) for url in urls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # the first failure answers; the other fetches stop
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
        if task.cancelled():  # cancelled inside the service, not by this client (which is still there)
            raise ApiError(503, "the request was cancelled inside the service; retry it", "unavailable")
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
    except Exception as exc:  # a server fault mid-stream still ends the stream with an error event
        log.error("HTTP front: stream failed: %r", exc, exc_info=exc)
        yield _sse(ApiError(500, "internal error; the server log has the details").body())
        return
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
