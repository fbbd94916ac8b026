"""Builds and starts each vlkv server (gateway, prefill worker, decode worker) from a ServerConfig.

Used by the Ray actors of ``deploy/`` (one server per actor process) and by tests that run servers
in-process. Each function loads what its server needs, binds ``host:port`` (0 = any free port) and returns
a handle whose ``address`` is what peers dial.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from vlkv.common.compression.profile import CompressionProfile, find_profile, read_profile
from vlkv.common.config import ServerConfig
from vlkv.common.errors import ConfigError
from vlkv.common.grpc_server import Server
from vlkv.common.handoff.grpc_transport import tune_malloc
from vlkv.common.handoff.transport import nixl_agent_for
from vlkv.common.heap import HeapTrimmer
from vlkv.common.model.image_inputs import ImageInputs
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.security import BearerTokenInterceptor
from vlkv.decode_worker.server import DecodeServicer, add_decode_servicer
from vlkv.prefill_worker.server import PrefillServicer
from vlkv.services.admin import AdminServicer
from vlkv.services.gateway import GatewayServicer
from vlkv.services.http_front import HttpFrontConfig, create_app
from vlkv.services.http_server import HttpServer
from vlkv.services.router import Router
from vlkv.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


def _service_name(pb2, name: str) -> str:
    return pb2.DESCRIPTOR.services_by_name[name].full_name


@dataclass
class Running:
    server: Server
    servicer: object
    grace_s: float
    admin: object = None
    trimmer: HeapTrimmer | None = None

    @property
    def address(self) -> str:
        return self.server.address

    def attach_admin(self, autoscaler) -> None:
        """Let the gateway's Admin service report the autoscaler's replicas and events."""
        self.admin.autoscaler = autoscaler

    async def stop(self) -> None:
        if hasattr(self.servicer, "draining"):
            self.servicer.draining = True
        if hasattr(self.servicer, "load_stream"):
            self.servicer.load_stream.close()  # the gateways' WatchLoad streams end now, not at the grace
        await self.server.stop(self.grace_s)
        stop = getattr(self.servicer, "stop", None)
        if stop is not None:
            await stop()
        close = getattr(getattr(self.servicer, "router", None), "close", None)
        if close is not None:
            await close()
        if self.trimmer is not None:
            await self.trimmer.stop()


def _load_worker(cfg: ServerConfig, model, processor=None, tokenizer=None):
    """The model (loaded unless given), its processor (loaded unless given; None when only a ``tokenizer``
    was given), its tokenizer and its ModelSpec, once per worker process."""
    # MiB-sized KV chunk buffers stay on the heap (see grpc_transport.tune_malloc); a thread's arena gives
    # back a free top over the trim threshold when it shrinks (malloc_trim never trims those tops). At 32 MiB
    # the tops a burst of large inputs left kept 7-94 MiB in the workers after ten refused inputs (median 36
    # prefill, 68 decode, 12 runs); at 4 MiB (the default), see docs/operations.md "Security" (issue 33).
    tune_malloc(trim_threshold=cfg.malloc_trim_mb << 20)
    torch.set_num_threads(cfg.model.torch_threads)
    model = model if model is not None else load_model(cfg.model)
    if processor is None and tokenizer is None:
        processor = load_processor(cfg.model.path)
    tokenizer = tokenizer if tokenizer is not None else processor.tokenizer
    return model, processor, tokenizer, ModelSpec.from_model(model, tokenizer)


def _worker_server(cfg: ServerConfig, port: int, service: str) -> Server:
    """An internal server: TLS as configured, the internal token checked on every call (client certificates
    instead under mutual TLS without a token), and pings answered (the gateway and prefill workers keep
    their connections here alive). Never one that takes unauthenticated calls, loopback included."""
    if not cfg.security.authenticates_workers:
        raise ConfigError("a worker needs an internal token or mutual TLS to authenticate its callers")
    return Server(
        cfg.host,
        port,
        [_service_name(worker_pb2, service)],
        cfg.limits.max_message_bytes,
        credentials=cfg.security.server_credentials(internal=True),
        interceptors=cfg.security.internal_interceptors(),
        accept_pings=True,
    )


def _checked_profile(path, fingerprint: str, what: str) -> CompressionProfile:
    """``path`` read, validated and checked against the model's ``fingerprint`` (when given); ConfigError."""
    try:
        profile = read_profile(path)
        if fingerprint:
            profile.check_model(fingerprint)
    except ValueError as err:
        raise ConfigError(f"refusing to start: {what}{err}") from None
    log.info("%scompression profile %s (budgets %s)", what, profile.label, profile.budgets)
    return profile


def load_compression_profile(cfg: ServerConfig, fingerprint: str = "") -> CompressionProfile | None:
    """The compression profile this deployment serves (``--compression-profile PATH``, else
    ``compression_profile.json`` beside the checkpoint; ``none``: no profile), validated, and checked
    against the model's ``fingerprint`` when one is given; ConfigError with the reason otherwise."""
    path = find_profile(cfg.model.path, cfg.compression_profile)
    return None if path is None else _checked_profile(path, fingerprint, "")


def load_learned_profile(cfg: ServerConfig, fingerprint: str = "") -> CompressionProfile | None:
    """The verifier's learned profile a restart starts from (``--learned-profile PATH`` when the file exists:
    the prefill workers write it), validated and checked against the model; ConfigError otherwise."""
    path = cfg.learned_profile
    if not path or not Path(path).is_file():
        return None
    return _checked_profile(path, fingerprint, "learned profile ")


async def start_prefill_worker(cfg: ServerConfig, port: int = 0, model=None, processor=None) -> Running:
    model, processor, _, spec = _load_worker(cfg, model, processor)
    profile = load_compression_profile(cfg, spec.fingerprint)
    learned = load_learned_profile(cfg, spec.fingerprint)
    nixl = nixl_agent_for("prefill", cfg.transfer.kv_transport, cfg.security.tls)
    limits = cfg.limits
    images = ImageInputs.from_processor(processor, model.config, limits.max_images, limits.max_image_pixels)
    servicer = PrefillServicer(
        model, spec, cfg.prefill(), nixl=nixl, images=images, profile=profile, learned=learned
    )
    server = _worker_server(cfg, port, "PrefillWorker")
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server.server)
    servicer.address = server.address
    await server.start()
    log.info("prefill worker serving on %s", server.address)
    return Running(server, servicer, cfg.grace_s, trimmer=_start_trimmer())


async def start_decode_worker(cfg: ServerConfig, port: int = 0, model=None, tokenizer=None) -> Running:
    model, _, tokenizer, spec = _load_worker(cfg, model, tokenizer=tokenizer)
    nixl = nixl_agent_for("decode", cfg.transfer.kv_transport, cfg.security.tls)
    servicer = DecodeServicer(model, tokenizer, spec, cfg.decode(), nixl=nixl)
    server = _worker_server(cfg, port, "DecodeWorker")
    add_decode_servicer(servicer, server.server)  # TransferKV on raw bytes: the zero-copy path
    servicer.address = server.address
    servicer.health = server.health  # NOT_SERVING (then exit) should its decode loop die
    await servicer.start()
    await server.start()
    log.info("decode worker serving on %s (%d KV blocks)", server.address, servicer.pool.num_blocks)
    return Running(server, servicer, cfg.grace_s, trimmer=_start_trimmer())


def _start_trimmer() -> HeapTrimmer:
    """A worker's background heap trimmer (``common.heap``): what a large request freed goes back to the OS."""
    trimmer = HeapTrimmer()
    trimmer.start()
    return trimmer


async def start_gateway(
    cfg: ServerConfig, prefill: list[str], decode: list[str], port: int = 0, processor=None
) -> Running:
    processor = processor if processor is not None else load_processor(cfg.model.path)
    spec = ModelSpec.from_checkpoint(cfg.model.path, cfg.model.torch_dtype, processor.tokenizer)
    router = Router(cfg.limits.max_message_bytes, cfg.security, keepalive_s=cfg.keepalive_s)
    router.windows = spec.windows
    for a in prefill:
        router.add_prefill(a)
    for a in decode:
        router.add_decode(a)
    servicer = GatewayServicer(processor, spec, cfg.gateway(), router)
    names = [_service_name(generate_pb2, "Generation"), _service_name(admin_pb2, "Admin")]
    token = cfg.security.api_token
    server = Server(
        cfg.host,
        port,
        names,
        cfg.limits.max_message_bytes,
        credentials=cfg.security.server_credentials(internal=False),
        interceptors=(BearerTokenInterceptor(token),) if token else (),
    )
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
    admin = AdminServicer(servicer)
    admin_pb2_grpc.add_AdminServicer_to_server(admin, server.server)
    await server.start()
    log.info("gateway serving on %s", server.address)
    return Running(server, servicer, cfg.grace_s, admin)


async def start_http_front(
    gateway: Running, port: int, cfg: ServerConfig, front: HttpFrontConfig | None = None
) -> HttpServer:
    """The OpenAI-compatible HTTP front on ``cfg.host:port``, serving through ``gateway``'s servicer in this
    event loop (the gateway's TLS certificate and token); stop it before the gateway."""
    front = front or HttpFrontConfig()
    if not front.model_id:
        front = replace(front, model_id=Path(cfg.model.path).name)  # the model is named by its directory
    server = HttpServer(create_app(gateway.servicer, front), cfg.host, port, cfg.security, cfg.grace_s)
    await server.start()
    log.info("OpenAI-compatible HTTP front serving on %s", server.url)
    return server
