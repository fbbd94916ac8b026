"""The ``vlkv`` command line: serve, generate, demo, status, eval, calibrate, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from vlkv.common.config import (
    DEFAULT_MODEL_DIR,
    DEFAULT_PROMPT_WEIGHT,
    ConfigError,
    ModelConfig,
    PoolConfig,
    QueueConfig,
    SecurityConfig,
    ServerConfig,
    TransferConfig,
)
from vlkv.tools.eval.command import POLICY_HELP, add_eval_parser
from vlkv.tools.jobs import jobs_flag
from vlkv.tools.verify_flags import add_verify_flags, format_verifier, verify_config


def _server_config(args) -> ServerConfig:
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


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local LLaVA checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (each worker sees the GPU Ray gave it)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (the pool's minimum)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (the pool's minimum)")
    p.add_argument("--prefill-max", type=int, default=None, help="autoscale prefill workers up to this many")
    p.add_argument("--decode-max", type=int, default=None, help="autoscale decode workers up to this many")
    p.add_argument("--prefill-target", type=float, default=2.0, help="ongoing+queued prefills per replica")
    p.add_argument("--decode-target", type=float, default=0.8, help="KV pool occupancy per decode replica")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs each worker asks Ray for")
    p.add_argument("--worker-gpus", type=float, default=0.0, help="GPUs each worker asks Ray for")
    p.add_argument(
        "--node-groups",
        action="store_true",
        help='place prefill/decode workers on nodes with the custom resources "vlkv_prefill"/"vlkv_decode"',
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--pool-mb", type=float, default=256, help="KV pool size of each decode worker (MiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences in one decode step")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="decode each sequence as a batch of one: its tokens do not depend on what else is decoding "
        "(bfloat16/float16 round differently with the batch size), at the cost of throughput",
    )
    p.add_argument(
        "--admission",
        default="grow",
        choices=["grow", "reserve"],
        help="grow: caches take blocks as they decode, the newest is preempted to host memory when the "
        "pool fills; reserve: each cache reserves max_new_tokens at admission",
    )
    p.add_argument("--swap-mb", type=float, default=0, help="host memory for preempted sequences (0: = pool)")
    p.add_argument(
        "--kv-transport",
        choices=["auto", "grpc", "nixl"],
        default="auto",
        help="how caches go from prefill to decode: nixl (one-sided writes into the decode pool, "
        "unencrypted: trusted fabrics only), grpc, or auto (nixl where both workers have it and TLS is off)",
    )
    p.add_argument(
        "--nixl-min-mb",
        type=float,
        default=8.0,
        help="auto: caches smaller than this go over gRPC (NIXL's extra round trip costs more there; 0: none)",
    )
    p.add_argument(
        "--max-unclaimed",
        type=int,
        default=8,
        help="decode side: caches one sending host may park unclaimed at once (a cache a Decode call has "
        "not claimed yet)",
    )
    p.add_argument(
        "--unclaimed-lease-s",
        type=float,
        default=5.0,
        help="decode side: an unclaimed cache is freed after this many seconds",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["fp16", "int8", "fp8"],
        default="fp16",
        help="how compact caches travel and are stored: fp16 (the model's dtype), int8 (KIVI: per-channel "
        "K and per-token V scales; about half the bytes, twice the sequences per pool) or fp8 (E4M3 with "
        "the same scales and bytes)",
    )
    p.add_argument(
        "--decode-budget",
        type=float,
        default=0.0,
        help="decode-phase re-compression (0: off): a layer keeps at most this fraction of its prompt-time "
        "tokens plus --decode-window, dropping the least-attended older tokens as it grows",
    )
    p.add_argument("--decode-window", type=int, default=32, help="recent tokens re-compression always keeps")
    p.add_argument(
        "--prompt-weight",
        type=float,
        default=DEFAULT_PROMPT_WEIGHT,
        help="re-compression: a prompt token's accumulated attention mass starts at this x its prompt-time "
        "score (0: decode-time mass alone)",
    )
    p.add_argument(
        "--max-waiting", type=int, default=256, help="requests queued while no decode worker has room"
    )
    p.add_argument(
        "--malloc-trim-mb",
        type=int,
        default=4,
        help="glibc trim threshold in each worker (MiB): memory a burst of large requests left above it goes "
        "back to the OS; raise it (e.g. 32) where hand-offs of whole uncompressed caches dominate",
    )
    p.add_argument(
        "--image-cache-mb",
        type=int,
        default=256,
        help="each prefill worker's image cache (reused image K/V, LRU) in MiB; 0 = off",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="each prefill worker's prefix cache (prompts' full K/V by block, LRU) in MiB: a follow-up turn "
        "prefills only what follows its longest cached prefix; 0 = off",
    )
    p.add_argument("--prefix-block", type=int, default=16, help="tokens per prefix-cache block")
    p.add_argument(
        "--share-prefixes",
        action="store_true",
        help="one tenant's cached prefixes serve another's prompts (off: each API token has its own)",
    )
    p.add_argument(
        "--compression-profile",
        default="",
        metavar="PATH",
        help="compression profile (vlkv calibrate) for requests that name no policy: the entry nearest their "
        "budget chooses the policy; default: compression_profile.json beside the checkpoint if there is one; "
        "'none': no profile. Another model's profile or a bad file is refused at start-up",
    )
    add_verify_flags(p)
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster (ray://host:10001)")
    p.add_argument(
        "--tls-cert", default="", help="PEM certificate: TLS on every server (public and internal)"
    )
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA bundle that signed the workers' certificates")
    p.add_argument("--mtls", action="store_true", help="workers require and verify client certificates")
    p.add_argument(
        "--api-token", default=os.environ.get("VLKV_API_TOKEN", ""), help="bearer token for clients"
    )
    p.add_argument(
        "--internal-token",
        default=os.environ.get("VLKV_INTERNAL_TOKEN", ""),
        help="secret every internal call carries (default without --mtls: a random one, drawn at start-up)",
    )


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token", default=os.environ.get("VLKV_API_TOKEN", ""), help="bearer token (or VLKV_API_TOKEN)"
    )
    p.add_argument("--tls-ca", default="", help="PEM CA bundle to verify the gateway (enables TLS)")


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--policy", default="", help=POLICY_HELP)
    p.add_argument("--budget", type=float, default=None, help="KV budget alpha in (0, 1]; default 0.1")
    p.add_argument("--threshold", type=float, default=None, help="sparsity threshold p; default 0.01")
    p.add_argument("--allocator", default="", help="sparsity, uniform, pyramid or cake")
    p.add_argument("--exact-budget", action="store_true")
    p.add_argument(
        "--verify",
        default="",
        choices=["", "off", "select", "floor"],
        help="verified compression (default: the server's for a request that names no policy)",
    )
    p.add_argument("--fidelity-floor", type=float, default=None, help="draft agreement --verify floor asks")
    p.add_argument(
        "--max-budget", type=float, default=None, help="the largest budget --verify floor raises to"
    )


def _request_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        policy=args.policy,
        budget=args.budget,
        threshold=args.threshold,
        allocator=args.allocator,
        exact_budget=args.exact_budget,
        verify=args.verify,
        fidelity_floor=args.fidelity_floor,
        max_budget=args.max_budget,
    )


async def _with_cluster(args, body) -> int:
    from vlkv.deploy.autoscaler import PoolSpec
    from vlkv.deploy.local import LocalCluster

    def spec(kind, n, n_max, target):
        resources = {f"vlkv_{kind}": 1.0} if args.node_groups else {}
        return PoolSpec(n, max(n, n_max or n), target, args.worker_cpus, args.worker_gpus, resources)

    cluster = LocalCluster(
        _server_config(args),
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


def _check_profile(args) -> None:
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


def cmd_serve(args) -> int:
    _check_profile(args)

    async def body(cluster) -> int:
        if cluster.http is not None:
            print(f"OpenAI-compatible HTTP API on {cluster.http.url}", flush=True)
        print(f"vlkv gateway listening on {cluster.address} (Ctrl-C to stop)", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0

    return asyncio.run(_with_cluster(args, body))


def cmd_generate(args) -> int:
    import grpc
    from vlkv.tools.client import build_request, connect, stream

    images = [Path(p).read_bytes() for p in args.image]
    if args.chat:
        req = build_request(images=images, question=args.prompt, **_request_kwargs(args))
    else:
        req = build_request(prompt=args.prompt, images=images, **_request_kwargs(args))
    channel, stub = connect(args.address, token=args.token, ca=args.tls_ca)
    try:
        for resp in stream(stub, req, timeout=args.timeout):
            if resp.HasField("token"):
                print(resp.token.text, end="", flush=True)
            else:
                u = resp.finished.usage
                print(
                    f"\n[{_reason(resp.finished.reason)}] prompt {u.prompt_tokens} tokens "
                    f"({u.vision_tokens} vision), generated {u.generated_tokens}, KV kept {u.kv_bytes_kept} of "
                    f"{u.kv_bytes_full} bytes (ratio {u.compression_ratio:.3f}, policy {u.policy}), "
                    f"TTFT {u.ttft_ms:.0f} ms",
                    file=sys.stderr,
                )
                if u.verify:
                    met = "met" if u.floor_met else "NOT met"
                    print(
                        f"verified ({u.verify}): kept {u.verified_candidate}, agreement {u.verified_agreement:.3f} "
                        f"over {u.draft_tokens} draft tokens, KL {u.verified_kl:.4f}, budget {u.verified_budget:g} "
                        f"after {u.budget_raises} raises, floor {met}",
                        file=sys.stderr,
                    )
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    return 0


def _reason(reason: int) -> str:
    from vlkv.v1 import generate_pb2

    return generate_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def cmd_demo(args) -> int:
    from vlkv.tools.client import build_request, connect, generate, png_bytes
    from vlkv.tools.demo_summary import DemoSummary
    from vlkv.tools.task.synthetic_task import MAX_NEW_TOKENS, is_correct, make_examples

    examples = make_examples(args.n, seed=args.seed, split="heldout")
    compare = args.compare_full and args.policy != "full"

    async def body(cluster) -> int:
        channel, stub = connect(cluster.address, token=args.api_token, ca=args.tls_ca)
        summary = DemoSummary(args.policy or "verified", args.budget)
        try:
            for i, ex in enumerate(examples):
                images = [png_bytes(im) for im in ex.images]

                def ask(policy, budget, images=images, question=ex.question):
                    req = build_request(
                        images=images,
                        question=question,
                        max_new_tokens=MAX_NEW_TOKENS,
                        policy=policy,
                        budget=budget,
                    )
                    return asyncio.to_thread(generate, stub, req, 300)

                out = await ask(args.policy, args.budget)
                ok = is_correct(out.text, ex)
                ref = await ask("full", None) if compare else None
                summary.add(out, ok, ref, is_correct(ref.text, ex) if ref else None)
                u = out.finished.usage
                print(f"[{i + 1}/{len(examples)}] {len(ex.images)} image(s) | Q: {ex.question}")
                print(f"    A: {out.text.strip()!r} (expected {ex.answer!r}) {'correct' if ok else 'WRONG'}")
                if ref is not None:
                    same = "same" if ref.text.strip() == out.text.strip() else "differs"
                    print(f"    full cache: {ref.text.strip()!r} ({same})")
                print(
                    f"    prompt {u.prompt_tokens} tokens ({u.vision_tokens} vision), generated "
                    f"{u.generated_tokens}, KV kept {u.kv_bytes_kept}/{u.kv_bytes_full} bytes "
                    f"(ratio {u.compression_ratio:.3f}, {u.policy}), TTFT {u.ttft_ms:.0f} ms",
                    flush=True,
                )
                if u.verify:
                    print(
                        f"    verified: kept {u.verified_candidate} at {u.verified_budget:.0%} "
                        f"({u.budget_raises} raises), draft agreement {u.verified_agreement:.3f}"
                        f"{'' if u.floor_met else ' (floor not met)'}",
                        flush=True,
                    )
            pool = await asyncio.to_thread(_decode_pool, cluster.address, args)
        finally:
            channel.close()
        print(summary.render(pool, block_size=args.block_size, max_new_tokens=MAX_NEW_TOKENS))
        return 0 if summary.correct > 0 else 1

    return asyncio.run(_with_cluster(args, body))


def _decode_pool(address: str, args) -> tuple[int, int] | None:
    """(blocks, workers) of the first decode worker's pool, from the gateway's admin API."""
    import grpc
    from vlkv.tools.client import open_channel
    from vlkv.v1 import admin_pb2, admin_pb2_grpc

    try:
        with open_channel(address, token=args.api_token, ca=args.tls_ca) as channel:
            st = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)
    except grpc.RpcError as exc:
        print(f"(no pool figures: the admin API answered {exc.code().name})", file=sys.stderr)
        return None
    decode = [w for w in st.workers if w.kind == "decode" and w.total_blocks]
    return (decode[0].total_blocks, len(decode)) if decode else None


def cmd_status(args) -> int:
    import time

    import grpc
    from vlkv.tools.client import open_channel
    from vlkv.v1 import admin_pb2, admin_pb2_grpc

    with open_channel(args.address, token=args.token, ca=args.tls_ca) as channel:
        try:
            st = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(
        f"requests in flight: {st.requests_in_flight}   served since start: {st.requests_total}   "
        f"waiting for KV room: {st.admission_queue}"
    )
    print(
        f"{'kind':8} {'address':22} {'state':12} {'in-flight':>9} {'running':>8} {'waiting':>8} {'KV pool (blocks, bytes)':>16} "
        f"{'preempted':>10}"
    )
    caches, prefixes = [], []
    for w in st.workers:
        if w.kind == "prefill" and w.HasField("image_cache"):
            caches.append((w.address, w.image_cache))
        if w.kind == "prefill" and w.HasField("prefix_cache") and w.prefix_cache.capacity_bytes:
            prefixes.append((w.address, w.prefix_cache))
        pool = swapped = ""
        if w.kind == "decode" and w.total_blocks:
            used = w.total_blocks - w.free_blocks
            pool = f"{used}/{w.total_blocks} ({used / w.total_blocks:.0%})"
            if w.block_bytes:  # the pool's bytes in its kv dtype
                pool += f" {w.kv_dtype} {used * w.block_bytes / (1 << 20):.0f}/{w.total_blocks * w.block_bytes / (1 << 20):.0f}MiB"
            swapped = f"{w.swapped} now/{w.preemptions}"
        print(
            f"{w.kind:8} {w.address:22} {w.state:12} {w.in_flight:>9} {w.running:>8} {w.waiting:>8} {pool:>16} "
            f"{swapped:>10}"
        )
    for w in st.workers:
        if w.kind == "prefill":
            print(
                f"compression profile {w.address}: {w.compression_profile or 'none (the policies defaults)'}"
            )
    for w in st.workers:
        if w.kind == "prefill" and w.HasField("verifier") and w.verifier.verified:
            print(f"verification {w.address}: {format_verifier(w.verifier)}")
        if w.kind == "prefill" and w.kv_bytes_window_saved:
            print(
                f"sliding windows {w.address}: {w.kv_bytes_window_saved / (1 << 20):.1f} MiB of full cache not kept"
            )
    for address, c in caches:
        looked = c.hits + c.misses
        print(
            f"image cache {address}: {c.entries} images, {c.bytes_held / (1 << 20):.1f}/"
            f"{c.capacity_bytes / (1 << 20):.0f} MiB, hits {c.hits}/{looked}"
            f"{f' ({c.hits / looked:.0%})' if looked else ''}, evictions {c.evictions}"
        )
    for address, c in prefixes:
        print(
            f"prefix cache {address}: {c.blocks} blocks, {c.bytes_held / (1 << 20):.1f}/"
            f"{c.capacity_bytes / (1 << 20):.0f} MiB, hits {c.hits}/{c.lookups} prompts, "
            f"{c.hit_tokens}/{c.lookup_tokens} tokens, evictions {c.evictions}"
        )
    for e in st.events[-args.events :]:
        stamp = time.strftime("%H:%M:%S", time.localtime(e.unix_time))
        print(f"{stamp} {e.kind} {e.action}: {e.replicas} serving ({e.reason})")
    return 0


def cmd_calibrate(args) -> int:
    from vlkv.tools.calibrate import calibrate, format_table
    from vlkv.tools.pool import WorkerFailed

    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if args.verifier:
        from vlkv.tools.calibrate_verifier import calibrate_verified, format_learned

        path, profile, seconds = calibrate_verified(
            args.model, args.prompts, budgets, args.out, args.dtype, args.max_prompts
        )
        print(format_learned(profile))
        print(f"\nwrote {path} ({profile.label}) in {seconds:.0f} s: serve it with --learned-profile {path}")
        return 0
    try:
        path, profile, seconds = calibrate(
            args.model,
            args.prompts,
            budgets,
            args.n,
            args.out,
            args.dtype,
            args.max_prompts,
            chunk=args.chunk,
            screen=args.screen,
            keep=args.keep,
            trace=args.trace,
            jobs=args.jobs,
            rerank=args.rerank,
            rerank_prompts=args.rerank_prompts,
        )
    except WorkerFailed as err:  # its traceback, then which prompts and why
        print(f"calibrate worker {err.worker}:\n{err.error}", file=sys.stderr)
        print(f"vlkv calibrate: calibrate {err}", file=sys.stderr)
        return 1
    print(format_table(profile))
    chosen = ", ".join(f"{e.budget:g}: {e.candidate}" for e in profile.entries)
    print(f"\nchosen: {chosen}\nwrote {path} ({profile.label}) in {seconds:.0f} s")
    return 0


def cmd_calibrate_reuse(args) -> int:
    from vlkv.tools.calibrate_reuse import run

    path = run(args.model, n=args.n, seed=args.seed, out=args.out)
    print(f"wrote {path}")
    return 0


def cmd_bench(args) -> int:
    if args.what == "kernels":
        from vlkv.tools.bench.kernels import main as run_kernels

        out = args.out if args.out != "out/bench" else "out/bench_kernels"
        run_kernels(["--out", out] + ["--quick"] * args.quick + ["--model-only"] * args.model_only)
        return 0
    if args.what == "gpu":
        from vlkv.tools.bench.gpu import run as run_gpu

        return run_gpu(args.out if args.out != "out/bench" else "out/bench_gpu", args.quick)
    if args.what == "image-reuse":
        from vlkv.tools.bench.image_reuse import run as run_image_reuse

        return run_image_reuse(args.model, args.out, args.quick, load=not args.no_load)
    if args.what == "capacity":
        from vlkv.tools.bench.capacity import run as run_capacity

        return run_capacity(args.out if args.out != "out/bench" else "out/bench_capacity", args.quick)
    if args.what == "soak":
        from vlkv.tools.soak import main as run_soak

        flags = ["-n", str(args.n), "--concurrency", str(args.concurrency), "--model", args.model]
        return run_soak(flags + ["--chaos"] * args.chaos)
    if args.what == "kvpress":
        from vlkv.tools.bench import kvpress_text

        args.out = args.out if args.out != "out/bench" else "out/bench_kvpress"
        return kvpress_text.main(args)
    if args.what == "handoff-latency":
        from vlkv.tools.bench import handoff_latency

        args.out = Path(args.out if args.out != "out/bench" else "out/bench_handoff")
        handoff_latency.main(args)
        return 0
    if args.what == "verify-cost":
        from vlkv.tools.bench import verify_cost

        args.out = args.out if args.out != "out/bench" else "out/bench_verify_cost"
        return verify_cost.main(args)
    if args.what == "prefix-ttft":
        from vlkv.tools.bench import prefix_ttft

        args.out = args.out if args.out != "out/bench" else "out/bench_prefix_ttft"
        return prefix_ttft.main(args)
    if args.what == "window-kv":
        from vlkv.tools.bench import window_kv

        args.out = args.out if args.out != "out/bench" else "out/bench_window_kv"
        return window_kv.main(args)
    from vlkv.tools.bench.compare_systems import run_bench

    return run_bench(args)


def cmd_kernels(args) -> int:
    from vlkv.tools.bench.kernel_compile import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vlkv", description="Disaggregated VLM serving with compressed KV caches"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start a local cluster: gateway + prefill + decode workers on Ray")
    _add_server_flags(p)
    p.add_argument("--port", type=int, default=50051, help="public gRPC port of the gateway")
    p.add_argument(
        "--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API on this port"
    )
    p.add_argument(
        "--http-allow-image-host",
        action="append",
        default=[],
        metavar="HOST",
        help="HTTP API: fetch http(s) image URLs on this host (repeatable; default: data: URLs only)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="send one request to a running gateway and stream the answer")
    p.add_argument("--address", default="127.0.0.1:50051")
    _add_client_flags(p)
    p.add_argument("--image", action="append", default=[], help="PNG/JPEG file (repeatable)")
    p.add_argument("--prompt", required=True, help='prompt text; "<image>" marks each image unless --chat')
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat turn after the images")
    p.add_argument("--timeout", type=float, default=300)
    _add_request_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "demo", help="start a local cluster and answer synthetic questions with the default model"
    )
    _add_server_flags(p)
    p.add_argument("-n", type=int, default=8, help="number of questions")
    p.add_argument("--seed", type=int, default=0)
    # VL-Cache at 10% by default, each question also asked with the full cache for the summary's comparison
    # (`vlkv eval --table` measures accuracy across policies and budgets).
    p.add_argument(
        "--policy",
        default="",
        help=POLICY_HELP + " (default: none named, so the server verifies its candidates: --verify)",
    )
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument(
        "--no-compare-full",
        dest="compare_full",
        action="store_false",
        help="do not ask each question a second time with the full cache",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("status", help="workers, their load, KV pool occupancy and requests in flight")
    p.add_argument("--address", default="127.0.0.1:50051")
    _add_client_flags(p)
    p.add_argument("--events", type=int, default=20, help="scaling events to show")
    p.set_defaults(func=cmd_status)

    add_eval_parser(sub)  # eval

    p = sub.add_parser("bench", help="benchmark report: vlkv (vlcache, full) against a Hugging Face server")
    p.add_argument(
        "what",
        choices=[
            "all",
            "image-reuse",
            "capacity",
            "kernels",
            "gpu",
            "handoff-latency",
            "soak",
            "kvpress",
            "verify-cost",
            "window-kv",
            "prefix-ttft",
        ],
        help="what to run (all: every table and figure; image-reuse: the image cache's TTFT, accuracy, load; "
        "capacity: sequences per pool with int8 caches and decode re-compression, their wire bytes, int8 vs "
        "fp16 decode speed -> out/bench_capacity; kernels: the Triton kernels (CUDA) or their references "
        "(CPU) beside the roofline cost model -> out/bench_kernels; gpu: on a CUDA machine every GPU "
        "measurement in one report -> out/bench_gpu, on CPU a one-line notice; handoff-latency: p50/p99 of "
        "small gRPC hand-offs and 7B-layout throughput, --before a second checkout in the same run -> "
        "out/bench_handoff); soak: -n requests at --concurrency through a local cluster, pools checked after, "
        "--chaos through both fronts while workers are killed and stopped (tools/chaos_soak.py); kvpress "
        "--suite text: NVIDIA kvpress's presses on SmolLM2 over the real-text suite -> out/bench_kvpress; prefix-ttft: a follow-up turn's TTFT from the prefix cache and "
        "continued against a cold prefill at 1K/2K histories, and the hit rate under mixed conversations -> "
        "out/bench_prefix_ttft)",
    )
    p.add_argument("--quick", action="store_true", help="small counts: finishes within 10 minutes on 2 cores")
    p.add_argument("--out", default="out/bench", help="where report.md, results.json and the plots go")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--kv-mb", type=float, default=None, help="KV memory of each system (MiB; default 24)")
    p.add_argument(
        "--kvpress", default="auto", choices=["auto", "off"], help="compare NVIDIA kvpress presses"
    )
    p.add_argument("--no-load", action="store_true", help="image-reuse: skip the load run through the API")
    p.add_argument("--model-only", action="store_true", help="kernels: print the cost model, measure nothing")
    p.add_argument("--before", type=Path, default=None, help="handoff-latency: a checkout to measure beside")
    p.add_argument(
        "--n", type=int, default=1000, help="handoff-latency: hand-offs per size and checkout; soak: requests"
    )
    p.add_argument("--concurrency", type=int, default=64, help="soak: requests in flight")
    p.add_argument("--chaos", action="store_true", help="soak: SIGKILL/SIGSTOP workers during the load")
    p.add_argument("--repeats", type=int, default=7, help="handoff-latency: 7B-layout transfers per budget")
    p.add_argument(
        "--kv-transport",
        default="auto",
        choices=["auto", "nixl", "grpc"],
        help="all: the KV hand-off of the vlkv systems (auto: NIXL where both workers have it)",
    )
    from vlkv.tools.bench.kvpress_text import add_args as add_kvpress_args

    add_kvpress_args(p)
    from vlkv.tools.bench.verify_cost import add_args as add_verify_cost_args

    add_verify_cost_args(p)
    from vlkv.tools.bench.window_kv import add_args as add_window_kv_args

    add_window_kv_args(p)
    from vlkv.tools.bench.prefix_ttft import add_args as add_prefix_ttft_args

    add_prefix_ttft_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("kernels", help="ahead-of-time checks of the Triton kernels (no GPU needed)")
    ksub = p.add_subparsers(dest="kernels_command", required=True)
    kp = ksub.add_parser(
        "compile",
        help="compile every kernel specialization the product launches for sm_80/90/100; report registers, "
        "shared memory, spills, occupancy; exit 1 on an error, a spill or occupancy under a floor",
    )
    from vlkv.tools.bench.kernel_compile import add_args as add_compile_args

    add_compile_args(kp)
    kp.set_defaults(func=cmd_kernels)

    p = sub.add_parser(
        "calibrate",
        help="choose compression settings per budget on a checkpoint's own prompts (agreement with the full "
        "cache, no labels); write compression_profile.json beside the model",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument(
        "--prompts", required=True, help="JSONL, one public-API request per line (tools/calibrate_prompts.py)"
    )
    p.add_argument("--budgets", default="0.02,0.05,0.1", help="comma-separated budgets in (0, 1)")
    p.add_argument(
        "-n",
        type=int,
        default=64,
        help="at most this many tokens of the full cache's answer compared per prompt (the first included; the "
        "answer ends sooner at its end token)",
    )
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument(
        "--verifier",
        action="store_true",
        help="run the served verifier (its candidates, the 16-token draft) over the prompts instead of the "
        "grid, and write its learned profile (default <model>/learned_profile.json) for --learned-profile",
    )
    p.add_argument(
        "--screen",
        type=int,
        default=12,
        help="successive halving: every candidate on the first N prompts, then per budget only the --keep best "
        "distinct ones and the default (default 12, tools/calibrate.py DEFAULT_SCREEN; 0: every candidate on "
        "every prompt)",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=6,
        help="with --screen: distinct candidates kept per budget (default 6, DEFAULT_KEEP)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=8,
        help="prompts prefilled and decoded as one batch, the unit a --jobs worker takes",
    )
    p.add_argument(
        "--jobs",
        default="auto",
        type=jobs_flag,
        help="worker processes sharing the prompts, one torch thread each; the same table as one process "
        "(auto: min(2, CPUs); 1: this process)",
    )
    p.add_argument(
        "--trace", default="", help="write each prompt's agreement and KL per candidate (JSON lines)"
    )
    p.add_argument(
        "--rerank",
        type=int,
        default=4,
        help="per budget decode the K best by agreement and the default free-running and rank them by answer "
        "recall first: the share of the full cache's answer words the question does not give found in theirs, "
        "each word weighted by its rarity in the prompt, 1/(1 + its count) (default 4; 0: off, the agreement "
        "ranking alone)",
    )
    p.add_argument(
        "--rerank-prompts",
        type=int,
        default=40,
        help="with --rerank: decode free-running on the first N prompts only (0: all; the rerank set is chosen "
        "on every prompt's agreement)",
    )
    p.add_argument("--dtype", default="float32", help="the dtype the model will be served in (fingerprinted)")
    p.add_argument("--out", default="", help="where to write (default: <model>/compression_profile.json)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "calibrate-reuse",
        help="measure per-layer sensitivity to reused image K/V; write reuse_calibration.json beside the model",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("-n", type=int, default=8, help="examples (synthetic task, training split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="where to write (default: <model>/reuse_calibration.json)")
    p.set_defaults(func=cmd_calibrate_reuse)

    from vlkv.tools.sim import main as sim_main

    sim_main.add_parser(sub)  # simulate
    sim_main.add_profile_parser(sub)  # profile

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from vlkv.common.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"vlkv: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
