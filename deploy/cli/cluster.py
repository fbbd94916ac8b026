"""What ``vlkv serve`` and ``vlkv demo`` share: the server configuration their flags describe, the
compression-profile check before start-up, and a local cluster (Ray, the worker pools, the gateway) around
a body."""

from __future__ import annotations

from vlkv.common.config import (
    ConfigError,
    ModelConfig,
    PoolConfig,
    QueueConfig,
    SecurityConfig,
    ServerConfig,
    TransferConfig,
)
from vlkv.deploy.cli.verify_flags import verify_config


def server_config(args) -> ServerConfig:
    return ServerConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, device=args.device, torch_threads=args.threads),
        security=SecurityConfig(
            cert=args.tls_cert,
            key=args.tls_key,
            ca=args.tls_ca,
            mutual_tls=args.mtls,
            api_token=args.api_token,
            internal_token=_internal_token(args),
        ),
        pool=PoolConfig(
            pool_bytes=int(args.pool_mb * (1 << 20)),
            block_size=args.block_size,
            max_batch=args.max_batch,
            admission=args.admission,
            swap_bytes=int(args.swap_mb * (1 << 20)),
            decode_budget=args.decode_budget,
            decode_window=args.decode_window,
            prompt_weight=args.prompt_weight,
            batch_invariant=args.batch_invariant,
        ),
        queue=QueueConfig(max_waiting=args.max_waiting),
        transfer=TransferConfig(
            kv_transport=args.kv_transport,
            kv_dtype=args.kv_dtype,
            nixl_min_bytes=int(args.nixl_min_mb * (1 << 20)),
            max_unclaimed_per_sender=args.max_unclaimed,
            unclaimed_lease_s=args.unclaimed_lease_s,
        ),
        host=args.host,
        image_cache_mb=args.image_cache_mb,
        prefix_cache_mb=args.prefix_cache_mb,
        prefix_block=args.prefix_block,
        share_prefixes=args.share_prefixes,
        malloc_trim_mb=args.malloc_trim_mb,
        compression_profile=getattr(args, "compression_profile", ""),
        verify=_verify_config(args),
        learned_profile=getattr(args, "learned_profile", ""),
        prefill_concurrency=getattr(args, "prefill_concurrency", 1),
    )


def _verify_config(args):
    try:
        return verify_config(args)
    except ValueError as err:
        raise ConfigError(f"refusing to start: {err}") from None


def _internal_token(args) -> str:
    """The secret internal calls carry, if given; otherwise ``ServerConfig`` draws one (unless --mtls
    authenticates the workers instead), and Ray ships it to every worker with the rest of the
    configuration, so worker ports never take unauthenticated calls, loopback included."""
    return args.internal_token


async def with_cluster(args, body) -> int:
    from vlkv.deploy.autoscaler import PoolSpec
    from vlkv.deploy.local import LocalCluster

    def spec(kind, n, n_max, target):
        resources = {f"vlkv_{kind}": 1.0} if args.node_groups else {}
        return PoolSpec(n, max(n, n_max or n), target, args.worker_cpus, args.worker_gpus, resources)

    cluster = LocalCluster(
        server_config(args),
        prefill=spec("prefill", args.prefill, args.prefill_max, args.prefill_target),
        decode=spec("decode", args.decode, args.decode_max, args.decode_target),
        gateway_port=getattr(args, "port", 0),
        metrics_port=args.metrics_port,
        http_port=getattr(args, "http_port", None),
        http_front=_http_front_config(args),
        ray_address=args.ray_address,
    )
    print("starting vlkv: Ray, prefill and decode workers, gateway ...", flush=True)
    await cluster.start()
    try:
        return await body(cluster)
    finally:
        print("shutting down ...", flush=True)
        await cluster.stop()


def _http_front_config(args):
    from vlkv.services.http_front import HttpFrontConfig

    return HttpFrontConfig(allow_image_hosts=tuple(getattr(args, "http_allow_image_host", ())))


def check_profile(args) -> None:
    """Refuse a bad compression profile before anything starts (the prefill workers then check it against
    the model's fingerprint); say which one will be served."""
    from vlkv.common.compression.profile import find_profile, read_profile

    path = find_profile(args.model, getattr(args, "compression_profile", ""))
    if path is None:
        return
    try:
        profile = read_profile(path)
    except ValueError as err:
        raise ConfigError(f"refusing to start: {err}") from None
    budgets = ", ".join(f"{e.budget:g} -> {e.candidate}" for e in profile.entries)
    print(f"compression profile {profile.label} ({path}): {budgets}", flush=True)
